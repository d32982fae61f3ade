"""What the Triton paged-attention kernels read for one step, built once per step by the runner.

The step's rows are packed decodes first, then prefill chunks (``layers/attention.py``). The kernels
take block tables and lengths as int32 tensors on the model's device: every layer of the step reads
the same ones, so the runner builds them once, in one host buffer and one host-to-device copy. The
CUDA-graph runner builds the same structure over its static device buffers instead.

This module does not import Triton: the engine imports it on every machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Decode split-K: enough (sequence, KV head, split) programs to fill a large GPU (H100: 132 SMs, a few
# programs resident on each), but no split shorter than _MIN_SPLIT_TOKENS keys (its combine would cost
# more than it saves). Not yet measured on a GPU: see docs/gpu.md.
_TARGET_PROGRAMS = 512
_MIN_SPLIT_TOKENS = 256
_MAX_SPLITS = 32


def num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Context splits per decode sequence (a power of two): see ``_TARGET_PROGRAMS``."""
    splits = 1
    while (splits < _MAX_SPLITS and num_seqs * num_kv_heads * splits < _TARGET_PROGRAMS
           and max_seq_len >= 2 * splits * _MIN_SPLIT_TOKENS):
        splits *= 2
    return splits


@dataclass
class PagedMetadata:
    decode_block_tables: torch.Tensor  # int32 [num_decodes, width]
    decode_seq_lens: torch.Tensor      # int32 [num_decodes], context after this step
    num_splits: int                    # decode context splits (a launch constant)
    prefill_block_tables: torch.Tensor  # int32 [num_chunks, width]
    prefill_query_start: torch.Tensor  # int32 [num_chunks + 1], rows in the packed batch
    prefill_seq_lens: torch.Tensor     # int32 [num_chunks], context after this step
    max_prefill_len: int               # longest chunk (0: no prefill)


def build_paged_metadata(decode_block_tables: torch.Tensor, decode_ctx_lens: torch.Tensor,
                         prefills: list[tuple[int, int, int, torch.Tensor]], num_kv_heads: int,
                         device: torch.device) -> PagedMetadata:
    """The step's kernel metadata on ``device`` from the runner's host-side step inputs
    (``prefills``: (q_start, q_len, ctx_len, block_ids) per chunk)."""
    nd = decode_block_tables.shape[0]
    np_ = len(prefills)
    width = max((ids.shape[0] for *_, ids in prefills), default=0)
    prefill_tables = torch.zeros(np_, width, dtype=torch.int32)
    for i, (*_, ids) in enumerate(prefills):
        prefill_tables[i, : ids.shape[0]] = ids
    starts = [q_start for q_start, *_ in prefills] + [prefills[-1][0] + prefills[-1][1] if prefills else 0]
    parts = [decode_block_tables.to(torch.int32).flatten(), decode_ctx_lens.to(torch.int32),
             prefill_tables.flatten(), torch.tensor(starts, dtype=torch.int32),
             torch.tensor([ctx for _, _, ctx, _ in prefills], dtype=torch.int32)]
    host = torch.cat(parts)
    if device.type == "cuda":
        host = host.pin_memory()
    flat = host.to(device, non_blocking=True)
    views = torch.split(flat, [p.numel() for p in parts])
    max_ctx = int(decode_ctx_lens.max()) if nd else 0
    return PagedMetadata(
        decode_block_tables=views[0].view(nd, decode_block_tables.shape[1]), decode_seq_lens=views[1],
        num_splits=num_splits(nd, num_kv_heads, max_ctx), prefill_block_tables=views[2].view(np_, width),
        prefill_query_start=views[3], prefill_seq_lens=views[4],
        max_prefill_len=max((q_len for _, q_len, _, _ in prefills), default=0),
    )


# Consecutive tokens of a prefill chunk attended together by the CPU kernel: each K/V block is read once
# for all of them (and their GQA heads) instead of once per token.
PREFILL_ROWS_PER_GROUP = 8


def token_rows(decode_block_tables: torch.Tensor, decode_ctx_lens: torch.Tensor,
               prefills: list[tuple[int, int, int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every token of the step as one row of the CPU kernel (``kernels/native.py``): int32 block tables
    [num_tokens, width], context lengths [num_tokens] and row groups [num_groups + 1]. A decode row keeps
    its own table and is a group alone; the i-th token of a prefill chunk (q_start, q_len, ctx_len,
    block_ids) attends its chunk's blocks over ``ctx_len - q_len + i + 1`` tokens (causal, after the
    cached prefix), in groups of ``PREFILL_ROWS_PER_GROUP`` consecutive tokens."""
    nd = decode_block_tables.shape[0]
    num_tokens = nd + sum(q_len for _, q_len, _, _ in prefills)
    width = max([decode_block_tables.shape[1], *(ids.shape[0] for *_, ids in prefills)])
    tables = torch.zeros(num_tokens, width, dtype=torch.int32)
    tables[:nd, : decode_block_tables.shape[1]] = decode_block_tables
    lens = torch.empty(num_tokens, dtype=torch.int32)
    lens[:nd] = decode_ctx_lens
    starts = [torch.arange(nd, dtype=torch.int32)]
    for q_start, q_len, ctx_len, ids in prefills:
        tables[q_start:q_start + q_len, : ids.shape[0]] = ids
        torch.arange(ctx_len - q_len + 1, ctx_len + 1, out=lens[q_start:q_start + q_len])
        starts.append(torch.arange(q_start, q_start + q_len, PREFILL_ROWS_PER_GROUP, dtype=torch.int32))
    starts.append(torch.tensor([num_tokens], dtype=torch.int32))
    return tables, lens, torch.cat(starts)
