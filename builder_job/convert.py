"""Convert checkpoint weights to the envelope's dtype and weight quantization.

Conversion works on the checkpoint's own tensor names (Hugging Face names); the
shard stage maps them to the runtime's parameter names per rank.

Quantization is weight-only and symmetric with one float32 scale per output
channel (row of the ``[out, in]`` weight):

- ``int8``: ``q = round(w / s)`` clamped to [-127, 127], ``s = max|w_row| / 127``;
- ``fp8``: ``q = float8_e4m3fn(w / s)``, ``s = max|w_row| / 448`` (e4m3's largest finite).

A quantized ``<name>.weight`` is stored as the int8/float8 tensor next to
``<name>.weight_scale``. Only linear projections inside decoder layers are
quantized (:func:`kiln.builder.check.is_quantizable`); embeddings, ``lm_head``
and norms stay in ``dtype``, which is where most of the quality is. A per-row
scale stays valid when a row-parallel layer is split along its input dimension,
so quantizing before sharding gives every rank the same numbers.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from kiln.builder.check import is_quantizable
from safetensors import safe_open

log = logging.getLogger("kiln.build.convert")

INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0
SCALE_SUFFIX = "_scale"


def load_checkpoint(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files (float32 copies are not made here)."""
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(checkpoint_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                tensors[name] = st.get_tensor(name)
    return tensors


def _engine_quantize():
    """The runtime's own quantizer when it has one, so builder and runtime agree on the format."""
    try:
        from kiln.engine.artifact import quantize_weight
    except ImportError:  # a runtime without artifact support: the documented format below
        return None
    return quantize_weight


def quantize_weight(weight: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` for a 2-D weight; scale is float32 of shape ``[out]``."""
    engine_quantize = _engine_quantize()
    if engine_quantize is not None:
        return engine_quantize(weight, method)
    w = weight.float()
    absmax = w.abs().amax(dim=1).clamp(min=1e-8)
    if method == "int8":
        scale = absmax / INT8_MAX
        q = torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    elif method == "fp8":
        scale = absmax / FP8_E4M3_MAX
        q = (w / scale[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    else:
        raise ValueError(f"unknown quantization {method!r}")
    return q, scale.to(torch.float32)


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.to(torch.float32) * scale.to(torch.float32)[:, None]).to(dtype)


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
    log.info("converted %d tensors to %s (%d quantized %s)", len(tensors), dtype, num_quantized, quantization)
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
