"""Weight-only quantization: how a weight is quantized.

Both modes keep one float32 scale per output channel, symmetric: ``int8`` stores
``round(w / s)`` with ``s = max|w_row| / 127``; ``fp8`` stores ``float8_e4m3fn(w / s)`` with
``s = max|w_row| / 448``. The weight stays quantized in memory on every device. Which GEMM runs a
quantized linear is ``kernels/quant_linear.py``'s (:func:`~kiln.engine.kernels.quant_linear.quant_path`).
"""

from __future__ import annotations

import torch
from kiln.engine.kernels.fp8 import FP8_DTYPE, FP8_MAX

# gguf: GGUF block weights kept as the file's bytes (kernels/gguf_blocks.py); made by the builder, never here
QUANT_DTYPES = {"int8": torch.int8, "fp8": FP8_DTYPE, "gguf": torch.uint8}
_QMAX = {"int8": 127.0, "fp8": FP8_MAX}


def quantize_weight(w: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric quantization of a [out, in] weight -> (q, float32 scale[out])."""
    if method == "gguf":
        raise ValueError("quantization gguf keeps a GGUF file's own blocks: build the GGUF source into an artifact "
                         "(spec.quantization: gguf); a float checkpoint cannot be quantized to it at load")
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
