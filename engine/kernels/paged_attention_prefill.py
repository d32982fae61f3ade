"""Paged prefill attention for packed varlen chunks, whose context may include cached blocks.

A step packs several sequences' prefill chunks back to back (``query_start`` is the offset of each
chunk's first token in the packed batch, plus one past the last). A chunk of ``q_len`` tokens of a
sequence that holds ``seq_len`` tokens after this step attends its whole context: the prefix
already cached (prefix-cache hits, earlier chunks) and the chunk itself, causally, query ``i``
seeing keys ``0 .. seq_len - q_len + i``. The layer has already written the chunk's K/V into the
pool, so every key is read through the block table from the head-major pool; nothing is gathered.

One program handles one (chunk, query head, tile of ``BLOCK_M`` queries) with an online softmax
over key tiles, float32 scores and accumulation; a tile's loop stops at the last key its last query
can see. One launch covers every chunk of the step (the grid's third axis is the longest chunk's
tile count; shorter chunks' surplus programs exit at once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kiln.engine.kernels.paged_tile import attend_kv_tile, capability_of


def tile_sizes(max_query_len: int, dtype: torch.dtype = torch.bfloat16, capability: int | None = None,
               head_dim: int = 128) -> tuple[int, int]:
    """(queries, keys) per tile: 16 x 32 for short chunks; for long ones the largest tile that compiles within
    the capability's shared memory and without register spills (the ahead-of-time check holds each one:
    tests/engine/test_aot_compile.py). float32 64 x 64 needed 115 KB at head size 128 (sm_86/89 allow 99 KB)
    and spilled 2-30 KB per thread everywhere; bf16/fp16 64 x 64 at head size 128 spilled 36-48 B on sm_80/89.
    ``capability`` (10 x major + minor) None: the most conservative tile of the table."""
    if max_query_len < 64:
        return (16, 32)
    cap = capability or 0
    if dtype == torch.float32:
        return (16, 32) if head_dim > 64 and cap < 89 else (32, 32)
    return (64, 32) if head_dim > 64 and cap < 90 else (64, 64)


@triton.jit
def _prefill_kernel(
    Q, K, V, Out, BlockTables, QueryStart, SeqLens,
    stride_qt, stride_qh,
    stride_kh, stride_kb, stride_kt,
    stride_vh, stride_vb, stride_vt,
    stride_yt, stride_yh,
    stride_bt,
    scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(QueryStart + seq)
    q_len = tl.load(QueryStart + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(SeqLens + seq)
    offset = seq_len - q_len  # tokens cached before this chunk

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = offset + offs_m  # each query's position in its sequence

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_head = head // GROUP
    k_base = K + kv_head.to(tl.int64) * stride_kh  # 64-bit offsets: a pool can exceed 2**31 elements
    v_base = V + kv_head.to(tl.int64) * stride_vh
    end = tl.minimum(seq_len, offset + (tile + 1) * BLOCK_M)  # one past the last key this tile sees
    for n0 in range(0, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        visible = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])  # key 0 is visible to every query
        m_i, l_i, acc = attend_kv_tile(q, m_i, l_i, acc, k_base, v_base, BlockTables + seq * stride_bt, offs_n,
                                       n_mask, visible, offs_d, d_mask, stride_kb, stride_kt, stride_vb,
                                       stride_vt, scale_log2, BLOCK_SIZE, DOT_PRECISION)

    out = acc / l_i[:, None]
    tl.store(Out + (q_start + offs_m)[:, None] * stride_yt + head * stride_yh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  query_start: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int, scale: float,
                  out: torch.Tensor, capability: int | None = None) -> torch.Tensor:
    """Causal attention of packed prefill chunks over their cached context, written into ``out``.

    q, out: [tokens, heads, head_dim] (the chunks' rows, at ``query_start``); k_cache, v_cache:
    [kv_heads, num_blocks, block_size, head_dim]; block_tables: int32 [num_chunks, >= max blocks];
    query_start: int32 [num_chunks + 1]; seq_lens: int32 [num_chunks], context after the chunk;
    max_query_len: the longest chunk (host int: it sizes the grid).
    """
    num_chunks = seq_lens.shape[0]
    if num_chunks == 0:
        return out
    _, num_heads, head_dim = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    capability = capability_of(q, capability)
    block_m, block_n = tile_sizes(max_query_len, q.dtype, capability, head_dim)
    grid = (num_chunks, num_heads, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start, seq_lens,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        GROUP=num_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    return out
