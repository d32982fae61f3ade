"""Weight-only quantization: how a weight is quantized, by its row of the format table.

Both per-channel formats keep one float32 scale per output channel, symmetric: ``int8`` stores
``round(w / s)`` with ``s = max|w_row| / 127``; ``fp8`` stores ``float8_e4m3fn(w / s)`` with
``s = max|w_row| / 448`` (``kernels/formats.py`` holds each row). The weight stays quantized in memory on
every device. Which GEMM runs a quantized linear is ``kernels/quant_linear.py``'s
(:func:`~kiln.engine.kernels.quant_linear.quant_path`).
"""

from __future__ import annotations

import torch
from kiln.engine.kernels import formats


def quantize_weight(w: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric quantization of a [out, in] weight -> (q, float32 scale[out])."""
    return formats.runtime_quantizable(method).quantize(w)
