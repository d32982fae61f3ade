"""``quantization: gguf``: a GGUF file's quantized tensors kept as they are, into the artifact.

At fetch (:func:`write_blocks`, beside the dequantized checkpoint the quality gate's reference reads), every
tensor of a type kiln runs (``kiln.engine.kernels.gguf_blocks.GGUF_TYPES``: Q8_0, Q4_0, Q4_1) is copied, byte
for byte, as ``uint8 [rows, K/32 x block bytes]`` under its Hugging Face name into
``gguf-blocks/blocks.safetensors`` (Llama's q/k rows un-permuted as transformers' loader does: whole rows, so
blocks move unchanged); its metadata lists the type of every tensor of the file (``kiln_gguf_all``).

At check (:func:`refuse_unrunnable`): with ``quantization: gguf`` every decoder linear must be in one of those
types, or the build stops naming the tensor and its type. The token embedding and the output (LM head) may be
of any type: in another one (Q6_K, say) they are dequantized to the engine's dtype, as for the other modes.

At shard (:func:`write_gguf_ranks`): each rank's state is built as for an unquantized artifact, then its
linears (fused q|k|v and gate|up by rows, column-parallel slices by rows, row-parallel ones by K-blocks of 32),
its embedding and an untied output (vocabulary rows, padded with zero blocks) are replaced by the blocks; the
file's ``kiln_gguf_types`` metadata says which (``kiln.engine.weights.load_engine_state``).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import torch
from kiln.builder.errors import InvalidSpec

log = logging.getLogger("kiln.build.gguf")

BLOCKS_DIR, BLOCKS_FILE = "gguf-blocks", "blocks.safetensors"
RUNNABLE = ("Q4_0", "Q4_1", "Q8_0")  # = kiln.engine.kernels.gguf_blocks.GGUF_TYPES (the builder imports no engine here)
_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}
_BLK = re.compile(r"blk\.(\d+)\.(\w+)\.weight$")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF weight kiln may keep as blocks (None: a norm, a bias, ...)."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    m = _BLK.match(gguf_name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.weight"
    return None


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    dim = rows.shape[0] // heads // 2
    return rows.reshape(heads, dim, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


def write_blocks(reader, architecture: str, config: dict, dest: Path) -> Path:
    """The file's runnable block tensors into ``dest/gguf-blocks/blocks.safetensors`` (see the module doc)."""
    from safetensors.numpy import save_file  # deferred: as the rest of the GGUF path

    tensors, types, everything = {}, {}, {}
    for t in reader.tensors:
        name = hf_name(t.name)
        everything[t.name] = t.tensor_type.name
        if name is None or t.tensor_type.name not in RUNNABLE:
            continue
        data = np.asarray(t.data, dtype=np.uint8)
        data = data.reshape(int(t.shape[-1]) if len(t.shape) > 1 else 1, -1)  # [rows, row bytes]
        if architecture == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
            heads = config["num_attention_heads"] if ".attn_q." in t.name else config["num_key_value_heads"]
            data = _unpermute(data, heads)
        tensors[name], types[name] = np.ascontiguousarray(data), t.tensor_type.name
    out = dest / BLOCKS_DIR
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / BLOCKS_FILE), metadata={"kiln_gguf_types": json.dumps(types),
                                                         "kiln_gguf_all": json.dumps(everything)})
    log.info("kept %d GGUF block tensors (%s) for quantization gguf", len(tensors),
             ", ".join(sorted(set(types.values()))) or "none")
    return out / BLOCKS_FILE


def _metadata(checkpoint_dir: Path) -> dict:
    from safetensors import safe_open

    path = Path(checkpoint_dir) / BLOCKS_DIR / BLOCKS_FILE
    if not path.is_file():
        return {}
    with safe_open(str(path), framework="pt") as f:
        return f.metadata() or {}


def refuse_unrunnable(checkpoint_dir: Path, is_gguf: bool) -> dict[str, int]:
    """InvalidSpec naming the tensor and its type where a decoder linear is not a type kiln runs; returns the
    kept blocks' types (type -> tensors)."""
    if not is_gguf:
        raise InvalidSpec("spec.quantization: gguf keeps a GGUF file's own blocks: spec.model.source must be a "
                          ".gguf file (or use quantization none, int8 or fp8)")
    meta = _metadata(checkpoint_dir)
    everything = json.loads(meta.get("kiln_gguf_all") or "{}")
    for name, kind in sorted(everything.items()):
        m = _BLK.match(name)
        if m and m.group(2) in _LAYER and kind not in RUNNABLE:
            raise InvalidSpec(f"spec.quantization: gguf: tensor {name} is {kind}, which kiln cannot run (it runs "
                              f"{', '.join(RUNNABLE)}); use quantization none or int8 (dequantized), or a GGUF whose "
                              "decoder linears are all in those types")
    kept: dict[str, int] = {}
    for kind in json.loads(meta.get("kiln_gguf_types") or "{}").values():
        kept[kind] = kept.get(kind, 0) + 1
    if not kept:
        raise InvalidSpec("spec.quantization: gguf: the GGUF holds no Q4_0, Q4_1 or Q8_0 tensors to keep")
    return kept


def _rows(t: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """``size`` rows from ``start``, zero rows (zero blocks) past the tensor's end."""
    part = t[start:start + size]
    if part.shape[0] == size:
        return part
    return torch.cat([part, part.new_zeros(size - part.shape[0], t.shape[1])])


def _k_blocks(t: torch.Tensor, kind: str, rank: int, tp: int, name: str) -> torch.Tensor:
    per_block = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    blocks = t.shape[1] // per_block
    if blocks % tp:
        raise InvalidSpec(f"spec.tensorParallel: {tp} does not divide the {blocks} blocks of 32 of {name}'s rows: a "
                          "row-parallel GGUF linear is split by whole blocks")
    b = t.view(t.shape[0], blocks, per_block)
    return b.narrow(1, rank * blocks // tp, blocks // tp).reshape(t.shape[0], -1).contiguous()


def rank_blocks(state: dict[str, torch.Tensor], blocks, types: dict[str, str], rank: int, tp: int
                ) -> dict[str, str]:
    """Replace ``state``'s tensors (engine names) that have blocks by this TP rank's blocks; returns their types."""
    out: dict[str, str] = {}
    fused = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
             "self_attn.o_proj": ("self_attn.o_proj",), "mlp.down_proj": ("mlp.down_proj",)}
    for name in list(state):
        m = re.match(r"(model\.layers\.\d+)\.(self_attn\.\w+|mlp\.\w+)\.weight$", name)
        if m and m.group(2) in fused:
            parts = [f"{m.group(1)}.{p}.weight" for p in fused[m.group(2)]]
            if not all(p in types for p in parts):
                continue
            kinds = {types[p] for p in parts}
            if len(kinds) > 1:
                raise InvalidSpec(f"spec.quantization: gguf: {', '.join(parts)} are fused into one linear but have "
                                  f"types {', '.join(types[p] for p in parts)}; kiln fuses them in one type only")
            kind = kinds.pop()
            if m.group(2) in ("self_attn.o_proj", "mlp.down_proj"):  # row-parallel: K-blocks
                t = _k_blocks(blocks.get_tensor(parts[0]), kind, rank, tp, parts[0])
            else:
                pieces = []
                for p in parts:
                    full = blocks.get_tensor(p)
                    size = full.shape[0] // tp
                    pieces.append(full[rank * size:(rank + 1) * size])
                t = torch.cat(pieces).contiguous()
        elif name in ("model.embed_tokens.weight", "lm_head.weight") and name in types:
            kind, full = types[name], blocks.get_tensor(name)
            shard = state[name].shape[0]
            t = _rows(full, rank * shard, shard).contiguous()
        else:
            continue
        state[name], out[name] = t, kind
    return out


def write_gguf_ranks(checkpoint_dir: Path, out_dir: Path, spec, pp_size: int) -> list[tuple[Path, int]]:
    """One ``rank-r-of-n.safetensors`` per rank, its GGUF-typed linears, embedding and head as the file's blocks."""
    from kiln.engine.artifact import iter_rank_states, weights_file_name
    from safetensors import safe_open
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tp, written = spec.tensor_parallel, []
    blocks_path = Path(checkpoint_dir) / BLOCKS_DIR / BLOCKS_FILE
    with safe_open(str(blocks_path), framework="pt") as blocks:
        types = json.loads((blocks.metadata() or {}).get("kiln_gguf_types") or "{}")
        for state in iter_rank_states(checkpoint_dir, tp, spec.dtype, None, pp_size):
            rank = len(written)
            kinds = rank_blocks(state, blocks, types, rank % tp, tp)
            path = out_dir / weights_file_name(rank, tp * pp_size)
            save_file(state, str(path), metadata={
                "format": "pt", "kiln_rank": str(rank), "kiln_tp": str(tp), "kiln_pp": str(pp_size),
                "kiln_pp_stage": str(rank // tp), "kiln_gguf_types": json.dumps(kinds)})
            written.append((path, len(state)))
            del state
    return written
