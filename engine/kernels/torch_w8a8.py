"""torch's own W8A8 linear as a tactic candidate (``torch-w8a8``): ``torch.ops.quantized.linear_dynamic``.

The int8 weight (kiln's per-channel values and scales, ``layers/quant.py``) is prepacked once by torch's
``x86`` quantized engine (FBGEMM or oneDNN inside, its choice); each call quantizes the activations
dynamically, per tensor (one scale for the whole call, 7-bit with ``reduce_range`` so that hosts without
VNNI cannot saturate), multiplies int8 by int8 into int32 and dequantizes. That is coarser than kiln's
per-32-block W8A8 (``csrc/gemm_w8a8.c``), and it takes float32 activations only: bf16 ones are widened and the
output rounded back. It is timed beside kiln's kernels where torch has the op; the table picks, where the build's
quality gate measured it and let it (``builder_job/stages/quality_runtime.py``).
"""

from __future__ import annotations

import warnings

import torch

ENGINE = "x86"


def unavailable() -> str | None:
    """Why torch's dynamic int8 linear cannot run here (None: it can)."""
    if ENGINE not in torch.backends.quantized.supported_engines:
        return f"torch has no {ENGINE!r} quantized engine here"
    if not hasattr(torch.ops.quantized, "linear_dynamic"):
        return "torch has no quantized.linear_dynamic"
    return None


class QLinear:
    """An int8 weight [out, in] with its float32 per-channel ``scale``, prepacked for ``linear_dynamic``."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        n = weight.shape[0]
        before = torch.backends.quantized.engine
        with warnings.catch_warnings():  # quantized tensors are deprecated in torch; the op still is the library's
            warnings.simplefilter("ignore")
            qw = torch._make_per_channel_quantized_tensor(weight.detach().contiguous(), scale.double(),
                                                          torch.zeros(n, dtype=torch.long), 0)
            try:
                torch.backends.quantized.engine = ENGINE
                self.packed = torch.ops.quantized.linear_prepack(qw, None)
            finally:
                torch.backends.quantized.engine = before
        self.out_features = n

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.ops.quantized.linear_dynamic(x2.float(), self.packed, True)
        if bias is not None:
            y = y + bias
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)
