"""CUDA graphs for decode steps: one captured forward pass per batch-size bucket.

A decode-only step (every row one token, every row sampled) of ``n`` rows
whose longest block table has ``w`` blocks replays the graph of the smallest
(batch bucket >= n, context bucket >= w). Context buckets (16, 64, 256, ...
blocks, up to ``max_seq_len``) keep a short-context batch from gathering and
attending ``max_seq_len`` keys. The graphs read static input buffers; rows past
``n`` are padding that writes its K/V into a scratch block the block manager
never hands out (the pool's last block) and attends one token of it.

Only used when ``device == "cuda"`` and not ``enforce_eager``; prefill and
mixed steps run eagerly.
"""

from __future__ import annotations

import torch
from kiln.engine.layers.attention import AttentionMetadata, set_attention_metadata
from torch import nn


def context_buckets(max_blocks_per_seq: int) -> list[int]:
    sizes, b = [], 16
    while b < max_blocks_per_seq:
        sizes.append(b)
        b *= 4
    return [*sizes, max_blocks_per_seq]


def default_batch_sizes(max_batch_size: int) -> list[int]:
    """Decode batch sizes to capture: 1, 2, 4, then every 8 up to max_batch_size (vLLM's scheme).

    The one home of this rule: the builder's tuner measures and records these buckets.
    """
    sizes = [1, 2, 4] + list(range(8, max_batch_size + 1, 8))
    return sorted({s for s in sizes if s <= max_batch_size} | {max_batch_size})


class CUDAGraphRunner:
    def __init__(self, model: nn.Module, block_size: int, max_blocks_per_seq: int, scratch_block: int,
                 batch_sizes: list[int], device: torch.device) -> None:
        self.model = model
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.batch_sizes = sorted(set(batch_sizes))
        max_bs = self.batch_sizes[-1]
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_bs,), scratch_block * block_size, dtype=torch.long, device=device)
        self.block_tables = torch.full((max_bs, max_blocks_per_seq), scratch_block, dtype=torch.long, device=device)
        self.ctx_lens = torch.ones(max_bs, dtype=torch.long, device=device)
        self.key_index = torch.arange(max_blocks_per_seq * block_size, device=device)
        self.context_buckets = context_buckets(max_blocks_per_seq)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._capture()

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def _forward(self, bs: int, nblocks: int) -> torch.Tensor:
        keys = self.key_index[: nblocks * self.block_size]
        mask = (keys[None, :] < self.ctx_lens[:bs, None])[:, None, None, :]
        set_attention_metadata(AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], num_decode_tokens=bs,
            decode_block_tables=self.block_tables[:bs, :nblocks], decode_mask=mask, prefills=[],
        ))
        try:
            hidden = self.model(self.input_ids[:bs], self.positions[:bs])
            return self.model.compute_logits(hidden)
        finally:
            set_attention_metadata(None)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        # Largest first: the smaller graphs reuse its memory pool.
        for nblocks in reversed(self.context_buckets):
            for bs in reversed(self.batch_sizes):
                self._forward(bs, nblocks)  # warm up kernels and allocator outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bs, nblocks] = self._forward(bs, nblocks)
                pool = graph.pool()
                self.graphs[bs, nblocks] = graph
        torch.cuda.synchronize()

    def can_run(self, num_rows: int) -> bool:
        return num_rows <= self.max_batch_size

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, ctx_lens: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] of a decode-only step of n rows (inputs may live on the host)."""
        n = input_ids.shape[0]
        bs = next(s for s in self.batch_sizes if s >= n)
        width = block_tables.shape[1]
        nblocks = next(c for c in self.context_buckets if c >= width)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.slot_mapping[n:bs].fill_(self.scratch_block * self.block_size)
        self.block_tables[:n, :width].copy_(block_tables, non_blocking=True)
        self.block_tables[:n, width:nblocks].fill_(self.scratch_block)
        self.block_tables[n:bs, :nblocks].fill_(self.scratch_block)
        self.ctx_lens[:n].copy_(ctx_lens, non_blocking=True)
        self.ctx_lens[n:bs].fill_(1)
        self.graphs[bs, nblocks].replay()
        return self.outputs[bs, nblocks][:n]
