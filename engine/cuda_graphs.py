"""CUDA graphs for decode steps: one captured forward pass per batch-size bucket.

A decode-only step (every row one token, every row sampled) of ``n`` rows
replays the graph of the smallest bucket >= n. The graphs read static input
buffers; rows past ``n`` are padding that writes its K/V into a scratch block
the block manager never hands out (the pool's last block) and attends one
token of it. Block tables are captured at full width (``max_seq_len`` /
``block_size`` blocks) so one graph serves every context length.

Only used when ``device == "cuda"`` and not ``enforce_eager``; prefill and
mixed steps run eagerly.
"""

from __future__ import annotations

import torch
from kiln.engine.layers.attention import AttentionMetadata, set_attention_metadata
from torch import nn


def default_batch_sizes(max_batch_size: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch_size + 1, 16))
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
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture()

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def _forward(self, bs: int) -> torch.Tensor:
        mask = (self.key_index[None, :] < self.ctx_lens[:bs, None])[:, None, None, :]
        set_attention_metadata(AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], num_decode_tokens=bs,
            decode_block_tables=self.block_tables[:bs], decode_mask=mask, prefills=[],
        ))
        try:
            hidden = self.model(self.input_ids[:bs], self.positions[:bs])
            return self.model.compute_logits(hidden)
        finally:
            set_attention_metadata(None)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for bs in reversed(self.batch_sizes):  # largest first: smaller graphs reuse its memory pool
            self._forward(bs)  # warm up kernels and allocator outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
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
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.slot_mapping[n:bs].fill_(self.scratch_block * self.block_size)
        self.block_tables[:n, :width].copy_(block_tables, non_blocking=True)
        self.block_tables[:n, width:].fill_(self.scratch_block)
        self.block_tables[n:bs].fill_(self.scratch_block)
        self.ctx_lens[:n].copy_(ctx_lens, non_blocking=True)
        self.ctx_lens[n:bs].fill_(1)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
