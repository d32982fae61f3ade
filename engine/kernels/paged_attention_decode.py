"""Paged decode attention: one query token per sequence, split-K over the context (flash-decoding).

K/V are read straight from the head-major block pool ``[kv_heads, num_blocks, block_size, head_dim]``
through each sequence's block table, up to its length: nothing is gathered or padded. One program
handles one (sequence, KV head, context split) and all the query heads of that KV head's group at
once (GQA: each K/V tile is loaded once for the whole group; the group is padded to 16 rows so the
two products are tensor-core dots). Each split writes its normalized partial output and the log-sum-exp
of its scores in float32; a second small kernel combines the splits. Scores, softmax and accumulation
are float32 whatever the cache dtype.

The number of splits is a launch constant (``num_splits`` in ``layers/paged_metadata.py``); a
split past a sequence's length does no work and contributes nothing, so the same launch serves any
lengths (a CUDA graph captures it once per batch size).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kiln.engine.kernels.paged_tile import attend_kv_tile, capability_of

_BLOCK_N = 64  # context tokens per inner-loop tile (spans several KV blocks)


def block_n(dtype: torch.dtype, head_dim: int, capability: int | None = None) -> int:
    """Context tokens per tile: 64, or 32 for float32 at head sizes past 64 below sm_89, where a 64-token tile
    spilled 1.2 KB per thread on sm_80 (and 32 spills ~0.5 KB on sm_89/90: the ahead-of-time check,
    tests/engine/test_aot_compile.py). On an H200 with Triton 3.6 the 64-token tile spills too and still
    timed as fast or faster (``aot.SPILL_BASELINES``). ``capability`` None: as sm_80."""
    return 32 if dtype == torch.float32 and head_dim > 64 and (capability or 0) < 89 else _BLOCK_N


_MIN_GROUP_ROWS = 16  # tl.dot needs at least 16 rows


@triton.jit
def _decode_split_kernel(
    Q, K, V, BlockTables, SeqLens, PartOut, PartLse,
    stride_qt, stride_qh,
    stride_kh, stride_kb, stride_kt,
    stride_vh, stride_vb, stride_vt,
    stride_bt,
    stride_ot, stride_oh, stride_os,
    stride_lt, stride_lh,
    scale_log2,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + seq)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + offs_h
    h_mask = offs_h < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(Q + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    k_base = K + kv_head.to(tl.int64) * stride_kh  # 64-bit offsets: a pool can exceed 2**31 elements
    v_base = V + kv_head.to(tl.int64) * stride_vh
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        m_i, l_i, acc = attend_kv_tile(q, m_i, l_i, acc, k_base, v_base, BlockTables + seq * stride_bt, offs_n,
                                       n_mask, n_mask[None, :], offs_d, d_mask, stride_kb, stride_kt, stride_vb,
                                       stride_vt, scale_log2, BLOCK_SIZE, DOT_PRECISION)

    has = l_i > 0  # an empty split (past the sequence's end) stores 0 and a log-sum-exp of -inf
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(PartOut + seq * stride_ot + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :], out,
             mask=h_mask[:, None] & d_mask[None, :])
    tl.store(PartLse + seq * stride_lt + heads * stride_lh + split, lse, mask=h_mask)


@triton.jit
def _decode_reduce_kernel(
    PartOut, PartLse, Out,
    stride_ot, stride_oh, stride_os,
    stride_lt, stride_lh,
    stride_yt, stride_yh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(PartLse + seq * stride_lt + head * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    weight = tl.math.exp2(lse - tl.max(lse, 0))  # split 0 is never empty, so the max is finite
    parts = tl.load(PartOut + seq * stride_ot + head * stride_oh + offs_s[:, None] * stride_os + offs_d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(Out + seq * stride_yt + head * stride_yh + offs_d, out.to(Out.dtype.element_ty), mask=d_mask)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, num_splits: int, out: torch.Tensor,
                 capability: int | None = None) -> torch.Tensor:
    """Attention of one query per sequence over its cached context, written into ``out``.

    q, out: [num_seqs, heads, head_dim]; k_cache, v_cache: [kv_heads, num_blocks, block_size, head_dim];
    block_tables: int32 [num_seqs, >= max blocks]; seq_lens: int32 [num_seqs], each >= 1.
    """
    num_seqs, num_heads, head_dim = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    if num_seqs == 0:
        return out
    group = num_heads // kv_heads
    block_d = triton.next_power_of_2(head_dim)
    capability = capability_of(q, capability)
    part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(num_seqs, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_out, part_lse,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        scale * 1.4426950408889634,  # log2(e): the kernels use exp2
        GROUP=group, BLOCK_H=max(_MIN_GROUP_ROWS, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_N=block_n(q.dtype, head_dim, capability), NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    _decode_reduce_kernel[(num_seqs, num_heads)](
        part_out, part_lse, out,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
        num_warps=1,
    )
    return out
