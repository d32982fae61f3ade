"""A PEFT LoRA adapter checked against the base engine it will be served with, and cast to the engine's dtype.

The check reads only ``adapter_config.json`` and the safetensors headers' shapes, against the base
artifact's ``config.json`` (architecture and shapes) and the spec's ``maxLoraRank``: every problem is an
:class:`~kiln.builder.errors.InvalidSpec` (exit 2) naming ``spec.lora.adapters[i].source``.

The conversion keeps PEFT's layout (``adapter_config.json`` + ``adapter_model.safetensors``, the same
tensor names, whole unsharded A and B): the runtime loads PEFT directories, and with tensor parallelism each
rank slices its part of A (row-parallel layers: o/down) or B (column-parallel: q/k/v/gate/up) at load,
which costs nothing at these sizes, so no per-rank files are written. Only the dtype changes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln.builder.errors import InvalidSpec
from kiln.engine.lora.adapter import MODULES, TENSOR_NAME, module_shapes

TARGETS = tuple(MODULES)  # the PEFT modules the engine serves LoRA on
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def read_adapter_config(adapter_dir: Path, field: str) -> dict[str, Any]:
    path = adapter_dir / ADAPTER_CONFIG
    if not path.is_file() or not (adapter_dir / ADAPTER_WEIGHTS).is_file():
        raise InvalidSpec(f"{field}: not a PEFT adapter directory: it needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} "
                          f"(save it with `model.save_pretrained(dir)`); found "
                          f"{', '.join(sorted(p.name for p in adapter_dir.iterdir())) or 'nothing'}")
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise InvalidSpec(f"{field}: {ADAPTER_CONFIG} is not JSON ({exc})") from None


def config_problems(cfg: dict[str, Any], max_rank: int) -> list[str]:
    """What in ``adapter_config.json`` the runtime cannot serve: not LoRA, rank, DoRA, extra trained modules."""
    problems = []
    if cfg.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type is {cfg.get('peft_type')}, not LORA")
    ranks = [cfg.get("r", 8), *(cfg.get("rank_pattern") or {}).values()]
    if max(ranks) > max_rank:
        problems.append(f"rank {max(ranks)} > maxLoraRank {max_rank} (raise spec.lora.maxLoraRank: it rebuilds the "
                        "engine)")
    if cfg.get("use_dora"):
        problems.append("use_dora is set: DoRA adapters are not served")
    if cfg.get("modules_to_save"):
        problems.append(f"modules_to_save {cfg['modules_to_save']}: only LoRA A/B weights are served, not "
                        "fully trained modules")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        problems.append(f"bias {cfg.get('bias')!r}: adapters with trained biases are not served")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        problems.append("rank_pattern/alpha_pattern: per-module ranks or alphas are not served yet")
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    if missing := sorted(set(targets) - set(TARGETS)):
        problems.append(f"target_modules {missing}: the engine has no such module (it serves LoRA on "
                        f"{', '.join(TARGETS)})")
    return problems


def tensor_problems(shapes: dict[str, list[int]], base_cfg: dict[str, Any]) -> list[str]:
    """Each lora_A [r, in] / lora_B [out, r] against the base's layers and module shapes."""
    layers, modules = base_cfg["num_hidden_layers"], module_shapes(base_cfg)
    problems = []
    for name, shape in sorted(shapes.items()):
        match = TENSOR_NAME.search(name)
        if match is None:
            problems.append(f"tensor {name}: not a LoRA A/B weight of a layer's q/k/v/o/gate/up/down projection")
            continue
        layer, module, which = int(match[1]), match[3], match[4]
        if module not in modules:
            problems.append(f"tensor {name}: the engine has no module {module}")
        elif layer >= layers:
            problems.append(f"tensor {name}: layer {layer}, but the base has {layers} layers")
        else:
            fin, fout = modules[module]
            want = fin if which == "A" else fout
            got = shape[1] if which == "A" else shape[0]
            if len(shape) != 2 or got != want:
                problems.append(f"tensor {name}: shape {shape} does not fit the base's {module} ({fin} -> {fout}): "
                                "an adapter trained for another model")
        if len(problems) >= 5:
            break
    return problems


def check_adapter(adapter_dir: Path, base_cfg: dict[str, Any], max_rank: int, field: str) -> dict[str, Any]:
    """The adapter's config when it fits the base and the slots; else :class:`InvalidSpec` naming ``field``."""
    from safetensors import safe_open

    cfg = read_adapter_config(adapter_dir, field)
    problems = config_problems(cfg, max_rank)
    with safe_open(adapter_dir / ADAPTER_WEIGHTS, framework="pt") as f:
        shapes = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    problems += tensor_problems(shapes, base_cfg)
    if problems:
        raise InvalidSpec(f"{field}: " + "; ".join(problems))
    return cfg


def convert_adapter(adapter_dir: Path, out_dir: Path, dtype: str) -> dict[str, Any]:
    """``adapter_dir`` into ``out_dir`` in the engine's ``dtype``, PEFT layout unchanged; returns what it wrote."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(adapter_dir / ADAPTER_WEIGHTS)
    target = getattr(torch, dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(target).contiguous() for k, v in tensors.items()}, out_dir / ADAPTER_WEIGHTS,
              metadata={"format": "pt"})
    (out_dir / ADAPTER_CONFIG).write_text((adapter_dir / ADAPTER_CONFIG).read_text())
    return {"dtype": dtype, "tensors": len(tensors), "layout": "peft (unsharded; ranks slice at load)"}
