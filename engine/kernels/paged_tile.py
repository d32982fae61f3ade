"""One key tile of paged attention, shared by the decode and prefill kernels.

Reads the tile's K and V through a sequence's block table (``block_row`` points at its first
entry) from the head-major pool, and folds the tile into a running online softmax: scores in
float32, scaled for ``exp2``, keys outside ``visible`` (past the context; in prefill also past
each query's causal position) masked out. Returns the updated (row max, row sum, accumulator).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.cache
def _capability(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


def capability_of(t: torch.Tensor, capability: int | None = None) -> int | None:
    """The compute capability (10 x major + minor) the kernels size their tiles for: ``capability`` when
    given (the ahead-of-time check compiles for one), else ``t``'s CUDA device's; None on CPU."""
    if capability is not None or not t.is_cuda:
        return capability
    return _capability(t.device.index if t.device.index is not None else torch.cuda.current_device())


@triton.jit
def attend_kv_tile(
    q, m_i, l_i, acc, k_base, v_base, block_row, offs_n, n_mask, visible, offs_d, d_mask,
    stride_kb, stride_kt, stride_vb, stride_vt, scale_log2,
    BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    block = tl.load(block_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    slot = offs_n % BLOCK_SIZE
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_base + block[:, None] * stride_kb + slot[:, None] * stride_kt + offs_d[None, :],
                mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + block[:, None] * stride_vb + slot[:, None] * stride_vt + offs_d[None, :],
                mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return m_new, l_i, acc
