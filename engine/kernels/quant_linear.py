"""Which GEMM runs a weight-only quantized linear (``layers/quant.py`` quantizes the weight), and running it.

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
from kiln.engine.kernels.fp8 import can_use_scaled_mm, fp8_linear

log = logging.getLogger("kiln.engine")

_HAS_INT8_MM = hasattr(torch, "_weight_int8pack_mm")


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
        from kiln.engine.kernels.int8_gemm import int8_weight_only_linear  # deferred: imports triton

        return int8_weight_only_linear(x, weight, scale, bias)
    if path == "scaled_mm":
        return fp8_linear(x, weight, scale, bias)
    return F.linear(x, dequantize(weight, scale, x.dtype), bias)
