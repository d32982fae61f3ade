"""Convert checkpoint weights to the envelope's dtype and weight quantization.

Conversion works on the checkpoint's own tensor names (Hugging Face names); the
shard stage maps them to the runtime's parameter names per rank.

Quantization is weight-only and symmetric with one float32 scale per output
channel (row of the ``[out, in]`` weight):

- ``int8``: ``q = round(w / s)`` clamped to [-127, 127], ``s = max|w_row| / 127``;
- ``fp8``: ``q = float8_e4m3fn(w / s)``, ``s = max|w_row| / 448`` (e4m3's largest finite).

A quantized ``<name>.weight`` is stored as the int8/float8 tensor next to
``<name>.weight_scale``. Only linear projections inside decoder layers are
quantized (:func:`kiln.builder.model_facts.is_quantizable`), as the runtime does;
embeddings, ``lm_head`` and norms stay in ``dtype``. The quantizer is the
runtime's own (``kiln.engine.artifact.quantize_weight``).

These converted tensors feed the quality gate's reference model. The artifact's
per-rank files are written by the runtime's ``shard_checkpoint``, which quantizes
each rank's slice: identical for TP=1 and for column-parallel layers; for
row-parallel layers at TP>1 each rank's scales cover its half of the row, which
the gate's second, runtime-side measurement covers.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from kiln.builder.model_facts import is_quantizable
from kiln.engine.artifact import quantize_weight
from safetensors import safe_open

log = logging.getLogger("kiln.build.convert")

SCALE_SUFFIX = "_scale"


def load_checkpoint(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files."""
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(checkpoint_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                tensors[name] = st.get_tensor(name)
    return tensors


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """As the runtime's forward does it: both factors in the activation dtype."""
    return q.to(dtype) * scale.to(dtype)[:, None]


def convert_state_dict(
    tensors: dict[str, torch.Tensor], dtype: str, quantization: str
) -> tuple[dict[str, torch.Tensor], dict]:
    """Cast to ``dtype`` and quantize the quantizable linears; returns the tensors and a summary."""
    target = getattr(torch, dtype)
    out: dict[str, torch.Tensor] = {}
    num_quantized = 0
    for name, t in tensors.items():
        if quantization in ("int8", "fp8") and is_quantizable(name, list(t.shape)):
            q, scale = quantize_weight(t, quantization)
            out[name] = q
            out[name + SCALE_SUFFIX] = scale
            num_quantized += 1
        elif t.is_floating_point():
            out[name] = t.to(target)
        else:
            out[name] = t
    summary = {"dtype": dtype, "quantization": quantization, "num_tensors": len(tensors),
               "num_quantized_tensors": num_quantized,
               "converted_bytes": sum(t.numel() * t.element_size() for t in out.values())}
    log.info("converted %d tensors to %s (%s)", len(tensors), dtype,
             f"{num_quantized} quantized to {quantization}" if num_quantized else "no quantization")
    return out, summary


def dequantized_state_dict(converted: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """The converted weights as plain ``dtype`` tensors under checkpoint names (for reference models)."""
    target = getattr(torch, dtype)
    out = {}
    for name, t in converted.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = converted.get(name + SCALE_SUFFIX)
        out[name] = dequantize_weight(t, scale, target) if scale is not None else t
    return out
