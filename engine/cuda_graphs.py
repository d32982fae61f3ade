"""CUDA graphs for decode steps: one captured forward pass per batch-size bucket.

A decode-only step (every row one token, every row sampled) of ``n`` rows replays the graph of the
smallest batch bucket >= n. The graphs read static device buffers; rows past ``n`` are padding
that writes its K/V into a scratch block the block manager never hands out (the pool's last block)
and attends one token of it. Each step's inputs go to the device in one copy (one pinned host
buffer), then land in the static buffers by device-side copies: only the rows and blocks the step
uses are written.

With the Triton backend (``paged_kv_heads`` set) the kernels take each row's sequence length, so
one graph per batch bucket serves every context length (block tables as int32, the full width
allocated once). With the torch backend a graph also fixes how many blocks the gather reads, so
graphs exist per (batch bucket, context bucket >= the step's widest block table): 16, 64, 256, ...
blocks, up to ``max_seq_len``.

Only used when ``device == "cuda"`` and not ``enforce_eager``; prefill and mixed steps run eagerly.
"""

from __future__ import annotations

import torch
from kiln.engine.forward_context import set_forward_context
from kiln.engine.layers.attention import AttentionMetadata
from kiln.engine.layers.paged_metadata import PagedMetadata, num_splits
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
                 batch_sizes: list[int], device: torch.device, paged_kv_heads: int | None = None) -> None:
        self.model = model
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.device = device
        self.batch_sizes = sorted(set(batch_sizes))
        self.paged_kv_heads = paged_kv_heads  # set: the Triton backend (no context buckets)
        self.max_seq_len = max_blocks_per_seq * block_size
        max_bs = self.batch_sizes[-1]
        index = torch.int32 if paged_kv_heads else torch.long
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_bs,), scratch_block * block_size, dtype=torch.long, device=device)
        self.block_tables = torch.full((max_bs, max_blocks_per_seq), scratch_block, dtype=index, device=device)
        self.ctx_lens = torch.ones(max_bs, dtype=index, device=device)
        self.key_index = torch.arange(max_blocks_per_seq * block_size, device=device)
        self.context_buckets = [max_blocks_per_seq] if paged_kv_heads else context_buckets(max_blocks_per_seq)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._capture()

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def attention_metadata(self, bs: int, nblocks: int) -> AttentionMetadata:
        """The metadata a graph of ``bs`` rows and ``nblocks`` blocks captures: views of the static buffers."""
        if self.paged_kv_heads:
            none = torch.zeros(0, dtype=torch.int32, device=self.device)
            paged = PagedMetadata(
                decode_block_tables=self.block_tables[:bs], decode_seq_lens=self.ctx_lens[:bs],
                num_splits=num_splits(bs, self.paged_kv_heads, self.max_seq_len),
                prefill_block_tables=none.view(0, 0), prefill_query_start=none, prefill_seq_lens=none,
                max_prefill_len=0)
            return AttentionMetadata(slot_mapping=self.slot_mapping[:bs], num_decode_tokens=bs, paged=paged)
        keys = self.key_index[: nblocks * self.block_size]
        mask = (keys[None, :] < self.ctx_lens[:bs, None])[:, None, None, :]
        return AttentionMetadata(slot_mapping=self.slot_mapping[:bs], num_decode_tokens=bs,
                                 decode_block_tables=self.block_tables[:bs, :nblocks], decode_mask=mask)

    def _forward(self, bs: int, nblocks: int) -> torch.Tensor:
        with set_forward_context(self.attention_metadata(bs, nblocks)):
            hidden = self.model(self.input_ids[:bs], self.positions[:bs])
            return self.model.compute_logits(hidden)

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

    def bucket(self, num_rows: int, width: int) -> tuple[int, int]:
        """(batch bucket, context bucket) of a step of ``num_rows`` rows whose widest table has ``width`` blocks."""
        return (next(s for s in self.batch_sizes if s >= num_rows),
                next(c for c in self.context_buckets if c >= width))

    def load_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                    block_tables: torch.Tensor, ctx_lens: torch.Tensor, bs: int, nblocks: int) -> None:
        """Write one step's host inputs into the static buffers: one host-to-device copy, then
        device-side copies of only the rows and blocks in use; rows ``n:bs`` become padding."""
        n, width = block_tables.shape
        parts = [input_ids, positions, slot_mapping, ctx_lens, block_tables.flatten()]
        host = torch.cat([p.to(torch.long) for p in parts])
        if self.device.type == "cuda":
            host = host.pin_memory()
        ids, pos, slots, lens, tables = torch.split(host.to(self.device, non_blocking=True), [n, n, n, n, n * width])
        self.input_ids[:n].copy_(ids)
        self.positions[:n].copy_(pos)
        self.slot_mapping[:n].copy_(slots)
        self.ctx_lens[:n].copy_(lens)
        self.block_tables[:n, :width].copy_(tables.view(n, width))
        if not self.paged_kv_heads:  # the gather reads nblocks blocks of every row; the kernels stop at ctx_lens
            self.block_tables[:n, width:nblocks].fill_(self.scratch_block)
        self.slot_mapping[n:bs].fill_(self.scratch_block * self.block_size)
        self.block_tables[n:bs, :nblocks if not self.paged_kv_heads else 1].fill_(self.scratch_block)
        self.ctx_lens[n:bs].fill_(1)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, ctx_lens: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] of a decode-only step of n rows (inputs live on the host)."""
        n = input_ids.shape[0]
        bs, nblocks = self.bucket(n, block_tables.shape[1])
        self.load_inputs(input_ids, positions, slot_mapping, block_tables, ctx_lens, bs, nblocks)
        self.graphs[bs, nblocks].replay()
        return self.outputs[bs, nblocks][:n]
