"""Weight-only quantization: how a weight is quantized, and which GEMM runs a quantized linear.

Both modes keep one float32 scale per output channel, symmetric: ``int8`` stores
``round(w / s)`` with ``s = max|w_row| / 127``; ``fp8`` stores ``float8_e4m3fn(w / s)`` with
``s = max|w_row| / 448``. The weight stays quantized in memory on every device.

:func:`quant_path` is the one dispatch rule for ``y = x @ (q * s).T``:

============  =====================================================  ==========================================
weight        where                                                  what runs
============  =====================================================  ==========================================
int8          CPU, bf16 activations, K % 32 == 0                     ``torch._weight_int8pack_mm``
int8          CUDA (triton installed)                                Triton weight-only GEMM (kernels/int8_gemm)
fp8           CUDA, :func:`~kiln.engine.kernels.fp8.fp8_gemm_supported`,  ``torch._scaled_mm`` with per-token
              bf16/fp16 activations, K and N multiples of 16         activation scales (kernels/fp8)
otherwise                                                            dequantize into the activation dtype per
                                                                     call, then ``F.linear``
============  =====================================================  ==========================================
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch
import torch.nn.functional as F
from kiln.engine.kernels.fp8 import FP8_DTYPE, FP8_MAX, can_use_scaled_mm, fp8_linear

log = logging.getLogger("kiln.engine")

QUANT_DTYPES = {"int8": torch.int8, "fp8": FP8_DTYPE}
_QMAX = {"int8": 127.0, "fp8": FP8_MAX}
_HAS_INT8_MM = hasattr(torch, "_weight_int8pack_mm")


def quantize_weight(w: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric quantization of a [out, in] weight -> (q, float32 scale[out])."""
    if method not in QUANT_DTYPES:
        raise ValueError(f"quantization must be one of {', '.join(QUANT_DTYPES)}, got {method!r}")
    w32 = w.to(torch.float32)
    scale = (w32.abs().amax(dim=1) / _QMAX[method]).clamp(min=1e-12)
    scaled = w32 / scale[:, None]
    if method == "int8":
        q = scaled.round().clamp(-127, 127).to(torch.int8)
    else:
        q = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


@functools.lru_cache(maxsize=1)
def _has_triton() -> bool:
    found = importlib.util.find_spec("triton") is not None
    if not found:
        log.warning("triton is not installed: int8 linears on CUDA dequantize their weights per call "
                    "(install kiln[gpu] for the int8 GEMM kernel)")
    return found


def quant_path(x: torch.Tensor, weight: torch.Tensor) -> str:
    """Which GEMM runs ``x`` against this quantized ``weight``: int8pack, triton_int8, scaled_mm or dequantize."""
    if weight.dtype == torch.int8:
        if x.is_cpu:
            # torch's int8 x bf16 kernel reads the int8 weight once instead of materializing a bf16
            # copy. It crashes (segfault, torch 2.13) for input sizes that are not a multiple of 8;
            # 32 keeps clear.
            if x.dtype == torch.bfloat16 and _HAS_INT8_MM and x.shape[-1] % 32 == 0:
                return "int8pack"
        elif x.is_cuda and _has_triton():
            return "triton_int8"
    elif can_use_scaled_mm(x, weight):
        return "scaled_mm"
    return "dequantize"


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return weight.to(dtype) * scale.to(dtype)[:, None]


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T + bias`` by the path :func:`quant_path` names."""
    path = quant_path(x, weight)
    if path == "int8pack":
        y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).contiguous(), weight, scale.to(x.dtype))
        y = y.view(*x.shape[:-1], -1)
        return y if bias is None else y + bias
    if path == "triton_int8":
        from kiln.engine.kernels.int8_gemm import int8_weight_only_linear

        return int8_weight_only_linear(x, weight, scale, bias)
    if path == "scaled_mm":
        return fp8_linear(x, weight, scale, bias)
    return F.linear(x, dequantize(weight, scale, x.dtype), bias)
