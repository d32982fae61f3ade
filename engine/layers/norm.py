"""RMSNorm, computed in float32 like transformers' LlamaRMSNorm."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual)."""
        if residual is not None:
            x = x + residual
            residual = x
        # torch.rms_norm on the float32 upcast is transformers' pow/mean/rsqrt/mul, bit for bit, in one op.
        h = torch.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=self.eps)
        out = self.weight * h.to(x.dtype)
        return out if residual is None else (out, residual)
