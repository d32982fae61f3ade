"""Read a PEFT LoRA adapter directory and check it against the base model.

A PEFT adapter is ``adapter_config.json`` + ``adapter_model.safetensors`` (``save_pretrained``); its
tensors are named ``base_model.model.model.layers.{i}.{self_attn|mlp}.{q_proj..down_proj}.lora_{A|B}.weight``
(``lora_A`` is ``[r, in]``, ``lora_B`` ``[out, r]``). The checks, each refusing with a message that names the
field: ``peft_type`` LORA; ``r`` (and each tensor's rank) <= ``max_lora_rank``; ``fan_in_fan_out`` false
(Llama's projections are ``Linear``); no ``modules_to_save``, ``use_dora``, ``bias``, ``lora_bias``,
``rank_pattern``/``alpha_pattern``; every target module one the engine has (q/k/v/o, gate/up/down); every
tensor's shape the base's (an adapter trained for another base fails on its hidden sizes); a file size
within what a rank-``max_lora_rank`` adapter of this base can be (checked before reading it, so a huge file
is refused, never loaded). ``adapter_model.bin`` (a pickle) is refused: nothing untrusted is unpickled.

The scaling (``lora_alpha / r``, or ``/ sqrt(r)`` with ``use_rslora``) is folded into ``B`` here. ``lora_alpha``
must be a positive number giving a scaling of at most :data:`MAX_SCALING`, and every weight must be finite in
the engine's dtype after scaling: the slot-dense path multiplies every slot for every token, so one inf or NaN
would reach every row of a step, the base model's included.

The files are read once into memory and hashed as read: ``digest`` (SHA-256 of ``adapter_config.json`` and
``adapter_model.safetensors``) names this version of the adapter's weights, and the prefix cache keys its
blocks by it, never by the served name (``prefix_hash.root_key``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from kiln.engine.errors import RequestError

# PEFT module name -> (kiln's linear, the part of a fused linear, or None)
MODULES: dict[str, tuple[str, Any]] = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "o_proj": ("o_proj", None),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None),
}
# A tensor of a PEFT LoRA checkpoint: ...layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight
TENSOR_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)(?:\.[\w-]+)?\.weight$")
_UNSUPPORTED = ("modules_to_save", "use_dora", "lora_bias", "rank_pattern", "alpha_pattern")
# The largest scaling (lora_alpha / r, or / sqrt(r) with rsLoRA) served: PEFT's defaults give 1-2, published
# adapters stay under 16; a larger one is a mistake or an attempt to overflow the activations.
MAX_SCALING = 64.0


def module_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Each PEFT module's full (in, out) features in the base model described by ``cfg`` (config.json)."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def max_adapter_bytes(cfg: dict[str, Any], max_rank: int) -> int:
    """The most a rank-``max_rank`` float32 adapter on every module of every layer can hold (+ header room)."""
    per_layer = sum(max_rank * (i + o) for i, o in module_shapes(cfg).values())
    return per_layer * cfg["num_hidden_layers"] * 4 + (1 << 20)


@dataclass
class LoRAAdapter:
    """A loaded adapter in host memory: per (layer, kiln linear) its parts' ``(A [r, in], B [out, r] * scaling)``."""

    name: str
    path: str
    int_id: int
    rank: int
    scaling: float
    target_modules: list[str]
    weights: dict[tuple[int, str], dict[Any, tuple[torch.Tensor, torch.Tensor]]] = field(repr=False)
    nbytes: int = 0
    load_seconds: float = 0.0
    digest: str = ""  # SHA-256 of its files: this version's identity (prefix-cache root)
    removed: bool = False  # unloaded: requests still under it finish, and publish no prefix blocks


def _fail(message: str) -> RequestError:
    return RequestError("lora_path", message, code="invalid_lora_adapter")


def read_adapter_config(path: Path, max_rank: int) -> dict[str, Any]:
    cfg_path = path / "adapter_config.json"
    if not cfg_path.is_file():
        raise _fail(f"LoRA adapter {path} has no adapter_config.json (a PEFT adapter directory is expected)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as exc:
        raise _fail(f"LoRA adapter {path}: adapter_config.json is not JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise _fail(f"LoRA adapter {path}: adapter_config.json must be a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _fail(f"LoRA adapter {path}: peft_type is {cfg.get('peft_type')!r}; only LORA adapters are served")
    for key in _UNSUPPORTED:
        if cfg.get(key):
            raise _fail(f"LoRA adapter {path}: {key} = {cfg[key]!r} is not supported (kiln serves plain LoRA on "
                        "the attention and MLP projections); retrain without it")
    if cfg.get("bias", "none") != "none":
        raise _fail(f"LoRA adapter {path}: bias = {cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("fan_in_fan_out"):
        raise _fail(f"LoRA adapter {path}: fan_in_fan_out = true is for GPT-2-style Conv1D layers; this base's "
                    "projections are Linear")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        other = sorted(t for t in targets if t.rsplit(".", 1)[-1] not in MODULES)
        if other:
            raise _fail(f"LoRA adapter {path}: target module {other[0]!r} is not one this engine adapts "
                        f"({', '.join(MODULES)})")
    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        raise _fail(f"LoRA adapter {path}: r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise _fail(f"LoRA adapter {path}: r = {r} is over --max-lora-rank {max_rank}; serve with a larger "
                    "--max-lora-rank")
    cfg["scaling"] = _scaling(path, cfg, r)
    return cfg


def _scaling(path: Path, cfg: dict[str, Any], r: int) -> float:
    alpha = cfg.get("lora_alpha", r)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise _fail(f"LoRA adapter {path}: lora_alpha must be a positive number, got {alpha!r}; fix "
                    "adapter_config.json (PEFT's default is 8)")
    scaling = alpha / (math.sqrt(r) if cfg.get("use_rslora") else r)
    if scaling > MAX_SCALING:
        raise _fail(f"LoRA adapter {path}: lora_alpha {alpha!r} gives a scaling of {scaling:g} (lora_alpha / "
                    f"{'sqrt(r)' if cfg.get('use_rslora') else 'r'}), over the {MAX_SCALING:g} kiln serves; "
                    "fix lora_alpha in adapter_config.json")
    return scaling


def read_adapter_files(path: Path, max_rank: int, base_cfg: dict[str, Any]) -> tuple[dict, dict, str]:
    """(adapter config, its tensors by name, the content digest) of the PEFT directory ``path``: each file
    read once, size-checked before the read, hashed as read (what is checked is what is loaded)."""
    from safetensors.torch import load as load_safetensors

    if not path.is_dir():
        raise _fail(f"LoRA adapter path {str(path)!r} is not a directory")
    cfg = read_adapter_config(path, max_rank)
    file = path / "adapter_model.safetensors"
    if not file.is_file():
        extra = " (adapter_model.bin is a pickle and is never loaded: save with safe_serialization)" \
            if (path / "adapter_model.bin").exists() else ""
        raise _fail(f"LoRA adapter {path} has no adapter_model.safetensors{extra}")
    limit = max_adapter_bytes(base_cfg, max_rank)
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise _fail(f"LoRA adapter {path}: adapter_model.safetensors is {size} bytes, more than a "
                        f"rank-{max_rank} adapter of this base can hold ({limit}); it is not for this base")
        data = f.read(limit + 1)
    digest = hashlib.sha256(b"kiln-lora-v1\x00")
    digest.update(json.dumps(cfg, sort_keys=True).encode())  # the config as parsed, not re-read
    digest.update(b"\x00")
    digest.update(data)
    try:
        tensors = load_safetensors(data)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for a bad header
        raise _fail(f"LoRA adapter {path}: adapter_model.safetensors is not a safetensors file: {exc}") from None
    return cfg, tensors, digest.hexdigest()


def _pairs(path: Path, tensors: dict[str, torch.Tensor], layers: int) -> dict[tuple[int, str], dict[str, Any]]:
    """The adapter's tensors as (layer, PEFT module) -> {"A": ..., "B": ...}, refusing any other tensor."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = TENSOR_NAME.search(key)
        if m is None:
            raise _fail(f"LoRA adapter {path}: tensor {key!r} is not a LoRA weight of a decoder layer's "
                        "projection (target_modules may name only q/k/v/o_proj and gate/up/down_proj)")
        layer, module, half = int(m.group(1)), m.group(3), m.group(4)
        if module not in MODULES:
            raise _fail(f"LoRA adapter {path}: target module {module!r} is not one this engine adapts "
                        f"({', '.join(MODULES)})")
        if layer >= layers:
            raise _fail(f"LoRA adapter {path}: layer {layer} does not exist in the base ({layers} layers)")
        halves.setdefault((layer, module), {})[half] = tensor
    return halves


def load_adapter(path: str | Path, name: str, int_id: int, base_cfg: dict[str, Any], max_rank: int,
                 dtype: torch.dtype) -> LoRAAdapter:
    """Read and check the adapter at ``path`` for the base described by ``base_cfg``; raises ``RequestError``
    (param ``lora_path``) naming the field that is wrong."""
    path = Path(path)
    cfg, tensors, digest = read_adapter_files(path, max_rank, base_cfg)
    r, scaling = cfg["r"], cfg["scaling"]
    shapes = module_shapes(base_cfg)
    weights: dict[tuple[int, str], dict[Any, tuple[torch.Tensor, torch.Tensor]]] = {}
    nbytes, targets = 0, set()
    for (layer, module), ab in sorted(_pairs(path, tensors, base_cfg["num_hidden_layers"]).items()):
        a, b = ab.get("A"), ab.get("B")
        where = f"layers.{layer}.{module}"
        if a is None or b is None:
            raise _fail(f"LoRA adapter {path}: {where} has lora_{'A' if a is None else 'B'} missing")
        fan_in, fan_out = shapes[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or b.shape[0] != fan_out or a.shape[0] != b.shape[1]:
            raise _fail(f"LoRA adapter {path}: {where} has lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}, but "
                        f"the base's {module} maps {fan_in} -> {fan_out} features: the adapter is for another base")
        if a.shape[0] > max_rank:
            raise _fail(f"LoRA adapter {path}: {where} has rank {a.shape[0]}, over --max-lora-rank {max_rank}")
        kiln_module, part = MODULES[module]
        a = a.to(dtype).contiguous()
        b = (b.float() * scaling).to(dtype).contiguous()
        for half, t in (("A", a), ("B", b)):
            if not torch.isfinite(t).all():
                raise _fail(f"LoRA adapter {name!r} ({path}): {where}.lora_{half} holds inf or NaN"
                            f"{' once scaled and cast to ' + str(dtype).removeprefix('torch.') if half == 'B' else ''}"
                            "; it is not loaded (one such weight would reach every row of a batch): retrain or "
                            "re-export the adapter with finite weights")
        weights.setdefault((layer, kiln_module), {})[part] = (a, b)
        nbytes += a.numel() * a.element_size() + b.numel() * b.element_size()
        targets.add(module)
    if not weights:
        raise _fail(f"LoRA adapter {path}: adapter_model.safetensors holds no LoRA weights")
    return LoRAAdapter(name=name, path=str(path), int_id=int_id, rank=r, scaling=scaling,
                       target_modules=sorted(targets), weights=weights, nbytes=nbytes, digest=digest)
