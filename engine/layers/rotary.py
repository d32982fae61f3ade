"""Rotary position embeddings with the scaling variants Llama-family configs use.

The cos/sin tables are computed once for every position up to the engine's
max_seq_len, exactly as transformers computes them (same inverse frequencies,
same float32 outer product), so fp32 results match Hugging Face bit for bit.
`dynamic` scaling follows vLLM: the table is computed once for the scaled
context, not re-derived from the longest sequence of each forward pass.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from kiln.engine.rope_config import SUPPORTED_ROPE_TYPES
from torch import nn


def _yarn(inv_freq_base: torch.Tensor, dim: int, base: float, p: dict[str, Any], max_pos: int):
    factor = p["factor"]
    orig = p.get("original_max_position_embeddings") or max_pos

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = get_mscale(factor, p["mscale"]) / get_mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def compute_inv_freq(head_dim: int, params: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, attention scaling) for one rope config."""
    base = float(params["rope_theta"])
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "dynamic":
        factor = params["factor"]
        orig = params.get("original_max_position_embeddings") or max_position
        seq_len = max(max_position, orig)
        if seq_len > orig:
            base = base * ((factor * seq_len / orig) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim)), 1.0
    if rope_type == "llama3":
        factor, low_ff, high_ff = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low_ff, old_len / high_ff
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        return _yarn(inv_freq, dim, base, params, max_position)
    raise ValueError(f"rope_type {rope_type!r} is not supported ({', '.join(SUPPORTED_ROPE_TYPES)})")


class RotaryEmbedding(nn.Module):
    """Applies rotate-half RoPE to packed q/k of shape [num_tokens, heads, head_dim]."""

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        inv_freq, scaling = compute_inv_freq(head_dim, params, max_position)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # Not persistent: derived from the config, never part of a checkpoint.
        self.register_buffer("cos_cache", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scaling, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token tables [num_tokens, 1, rotary_dim], looked up once per forward pass for all layers."""
        return (self.cos_cache[positions].unsqueeze(1).to(dtype), self.sin_cache[positions].unsqueeze(1).to(dtype))



def apply_rotary(cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor):
    """Rotate packed q [T, heads, d] and k [T, kv_heads, d] with tables from ``RotaryEmbedding.cos_sin``."""
    cos, sin = cos_sin
    dim = cos.shape[-1]
    return _apply(q, cos, sin, dim), _apply(k, cos, sin, dim)


def apply_rotary_qk(cos_sin: tuple[torch.Tensor, torch.Tensor], qk: torch.Tensor) -> torch.Tensor:
    """Rotate q and k heads packed side by side, [T, heads + kv_heads, d], in one pass (same values)."""
    cos, sin = cos_sin
    return _apply(qk, cos, sin, cos.shape[-1])


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    half = rotary_dim // 2
    if rotary_dim == x.shape[-1]:
        # rotate_half(x) = cat(-x2, x1) is roll by half with the first half negated: fewer, larger ops.
        rotated = torch.roll(x, half, dims=-1)
        rotated[..., :half].neg_()
        out = x * cos
        return out.add_(rotated.mul_(sin))
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos + rotated * sin
    return torch.cat((out, rest), dim=-1)
