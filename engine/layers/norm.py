"""RMSNorm, computed in float32 like transformers' LlamaRMSNorm (the weight multiply in the model dtype)."""

from __future__ import annotations

import torch
from kiln.engine.layers.building import build_dtype
from torch import nn


class RMSNorm(nn.Module):
    native_ops = None  # kernels.native.Kernels when the runner serves on kiln's CPU kernels (one fused pass)

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=build_dtype()), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual)."""
        native = self.native_ops
        if (native is not None and x.dim() == 2 and x.is_contiguous() and x.dtype == self.weight.dtype
                and (residual is None or residual.is_contiguous())):
            return native.rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            residual = x
        # torch.rms_norm computes in float32 for bf16/fp16 input and rounds once at the end: transformers'
        # upcast/pow/mean/rsqrt/mul/downcast, bit for bit, without the two copies.
        out = self.weight * torch.rms_norm(x, (x.shape[-1],), eps=self.eps)
        return out if residual is None else (out, residual)
