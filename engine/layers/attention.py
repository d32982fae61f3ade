"""Attention over the paged KV cache, for a packed batch of decodes and prefill chunks.

The model runner packs each step's tokens with single-token rows ("decodes",
which includes the last token of a chunked prefill) first, then multi-token
prefill chunks, and publishes an ``AttentionMetadata`` for the step. Every
layer first writes its new K/V into the cache slots of ``slot_mapping``, then
reads each sequence's whole context back from its blocks:

- on CPU with ``attention_backend="native"`` (the CPU default where kiln's C kernels compile or an
  artifact ships them: ``kernels/csrc``), every token of the step, decode or prefill, is one
  row of one kernel call that reads K/V straight from the blocks (``paged_metadata.token_rows``);
  that backend writes the cache in its own layout (``kernels.native.Kernels.read_cache``), so nothing below runs;
- otherwise single-token rows run as batched matmuls over ``k_cache[block_tables]``
  (CPU: in groups of rows of similar context length, each gathering only the
  blocks its longest row holds; GPU: one SDPA), with padding masks built once
  per step;
- each prefill chunk runs its own SDPA over its gathered blocks, with the
  causal mask offset by the tokens already in the cache (prefix hits and
  earlier chunks), or plain ``is_causal`` when the chunk is the whole context.

With ``attention_backend="triton"`` the metadata carries ``paged`` instead, and each layer is one
Triton decode launch (+ its split combine) and one prefill launch over the pool, no gather
(``kernels/paged_attention_*.py``, docs/gpu.md).
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F
from kiln.engine.forward_context import get_forward_context
from kiln.engine.layers.attention_metadata import AttentionMetadata, DecodeGroup, PrefillChunk
from kiln.engine.layers.building import build_dtype
from kiln.engine.layers.paged_metadata import PagedMetadata
from torch import nn

# Cost model for grouping: one more group costs about as much as this many (row x context token)
# pairs of attention (measured on CPU: ~55 us per group call against ~0.5 us per row-token).
_GROUP_COST_ROW_TOKENS = 512
_MAX_GROUPS = 8


def decode_groups(block_tables: torch.Tensor, pad: torch.Tensor, block_size: int) -> list[DecodeGroup]:
    """Split the decode rows into groups of similar context length.

    Padding every row to the longest context wastes the attention work of the gap:
    with contexts spread over 40-480 tokens, 40 % of it. Rows are sorted by context and
    cut into the number of equal-size groups that minimizes (padded row-tokens + a
    per-group cost); each group gathers only its own longest context's blocks.
    """
    rows, width = block_tables.shape
    lens = (~pad.view(rows, -1)).sum(dim=-1)
    order = torch.argsort(lens, descending=True, stable=True)
    sorted_lens = lens[order].tolist()
    best_cost, best = None, 1
    for count in range(1, min(_MAX_GROUPS, rows) + 1):
        starts = [i * rows // count for i in range(count)]
        cost = sum((min(rows, (i + 1) * rows // count) - start) * sorted_lens[start] for i, start in enumerate(starts))
        cost += count * _GROUP_COST_ROW_TOKENS
        if best_cost is None or cost < best_cost:
            best_cost, best = cost, count
    groups = []
    for i in range(best):
        start, end = i * rows // best, (i + 1) * rows // best
        idx = order[start:end]
        blocks = max(1, -(-sorted_lens[start] // block_size))
        groups.append(DecodeGroup(idx, block_tables.index_select(0, idx)[:, :blocks],
                                  pad.view(rows, -1).index_select(0, idx)[:, : blocks * block_size]
                                  .view(1, end - start, 1, -1)))
    return groups


# CPU decode attention gathers at most about this many bytes of K+V at a time (see Attention._decode_cpu).
_CHUNK_BYTES = 4 << 20

__all__ = ["Attention", "AttentionMetadata", "DecodeGroup", "PrefillChunk", "decode_groups"]


class Attention(nn.Module):
    """Paged attention for one layer. The cache is head-major, [kv_heads, blocks, block_size, d], so a
    gather of whole blocks comes out as [kv_heads, rows, context, d]: batched matmuls take it as is."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.k_cache = torch.empty(0, dtype=build_dtype())  # [kv_heads, num_blocks, block_size, head_dim], bound later
        self.v_cache = torch.empty(0, dtype=build_dtype())
        self.layer_index = -1  # this layer's place in a compiled model's layer table (bind_layers)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, heads, d]; k, v: [T, kv_heads, d] -> [T, heads * d]."""
        if torch.compiler.is_compiling():  # an opaque op to the compiler (engine/compile.py)
            return torch.ops.kiln.paged_attention(q, k, v, self.layer_index)
        return self.attend(q, k, v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        md = get_forward_context().attention
        kvh, num_blocks, block_size, d = self.k_cache.shape
        if md.native is not None:  # its own layout (K blocks transposed): always written by its kernel
            k = k if k.stride()[1:] == (d, 1) else k.contiguous()
            v = v if v.stride()[1:] == (d, 1) else v.contiguous()
            md.native.cache_write(k, v, self.k_cache, self.v_cache, md.slot_mapping)
        else:
            k_slots = self.k_cache.view(kvh, num_blocks * block_size, d)
            v_slots = self.v_cache.view(kvh, num_blocks * block_size, d)
            k_slots.index_copy_(1, md.slot_mapping, k.transpose(0, 1).to(k_slots.dtype))
            v_slots.index_copy_(1, md.slot_mapping, v.transpose(0, 1).to(v_slots.dtype))
        if md.paged is not None:
            return self._forward_paged(q, md.num_decode_tokens, md.paged)
        out = torch.empty_like(q)
        gqa = self.num_heads != self.num_kv_heads
        nd = md.num_decode_tokens
        if nd and md.native is not None:
            md.native.paged_attention(q[:nd], self.k_cache, self.v_cache, md.decode_block_tables, md.decode_ctx_lens,
                                      self.scale, out[:nd], md.native_row_starts)
        elif nd and not q.is_cuda:
            if md.decode_groups is None:  # once per step: every layer has the same rows
                pad = md.decode_pad_mask
                if pad is None:
                    pad = ~md.decode_mask.view(1, nd, 1, -1)
                md.decode_groups = decode_groups(md.decode_block_tables, pad, block_size)
            for g in md.decode_groups:  # decode rows are the first nd rows of the batch
                out.index_copy_(0, g.rows, self._decode_cpu(q.index_select(0, g.rows), g.block_tables, g.pad,
                                                            md.workspace))
        elif nd:
            keys, vals = self._gather(md.decode_block_tables, q.dtype, md.workspace)  # [kvh, D, ctx, d]
            o = F.scaled_dot_product_attention(q[:nd].unsqueeze(2), keys.transpose(0, 1), vals.transpose(0, 1),
                                               attn_mask=md.decode_mask, scale=self.scale, enable_gqa=gqa)
            out[:nd] = o.squeeze(2)
        for p in md.prefills:
            end = p.q_start + p.q_len
            qs = q[None, p.q_start:end].transpose(1, 2)  # 4-D: the CPU flash kernel does not take 3-D
            if p.mask is None:  # the chunk is the whole context: its own k/v, no gather
                keys, vals = k[None, p.q_start:end].transpose(1, 2), v[None, p.q_start:end].transpose(1, 2)
            else:
                keys, vals = self._gather(p.block_ids[None], q.dtype, md.workspace)
                keys, vals = keys[:, 0, : p.ctx_len][None], vals[:, 0, : p.ctx_len][None]
            o = F.scaled_dot_product_attention(qs, keys, vals, attn_mask=p.mask, is_causal=p.mask is None,
                                               scale=self.scale, enable_gqa=gqa)
            out[p.q_start:end] = o[0].transpose(0, 1)
        return out.flatten(1)

    def _forward_paged(self, q: torch.Tensor, num_decodes: int, paged: PagedMetadata) -> torch.Tensor:
        """The Triton kernels: decodes (rows ``:num_decodes``), then the prefill chunks."""
        from kiln.engine.kernels.paged_attention_decode import paged_decode  # deferred: imports triton
        from kiln.engine.kernels.paged_attention_prefill import paged_prefill  # deferred: imports triton

        out = torch.empty_like(q)
        if num_decodes:
            paged_decode(q[:num_decodes], self.k_cache, self.v_cache, paged.decode_block_tables,
                         paged.decode_seq_lens, self.scale, paged.num_splits, out[:num_decodes])
        if paged.max_prefill_len:
            paged_prefill(q, self.k_cache, self.v_cache, paged.prefill_block_tables, paged.prefill_query_start,
                          paged.prefill_seq_lens, paged.max_prefill_len, self.scale, out)
        return out.flatten(1)

    def _decode_cpu(self, q: torch.Tensor, block_tables: torch.Tensor, pad: torch.Tensor,
                    workspace: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """One query per row, as two batched matmuls with the query heads grouped by KV head.

        On CPU this beats SDPA for single-token queries (several times in bf16): no
        K/V repeat for GQA, no flash tiling over a one-row query, no copy of the
        gathered K/V. Scores and softmax are float32. ``pad`` [1, D, 1, ctx] is True past
        each row's context. When the gathered K/V of all heads would outgrow the cache
        (``_CHUNK_BYTES``), KV heads are gathered and attended a few at a time, so the
        matmuls read K/V while it is still in cache (measured 30 % faster at 48 rows x 400
        tokens, slower below ~3 MB where the extra ops dominate). Same values either way.
        """
        rows, nblocks = block_tables.shape
        kvh, _, block_size, d = self.k_cache.shape
        qg = q.view(rows, kvh, self.num_heads // kvh, d).transpose(0, 1)  # [kvh, D, group, d]
        step = heads_per_chunk(kvh, 2 * kvh * rows * nblocks * block_size * d * self.k_cache.element_size())
        outs = []
        for h in range(0, kvh, step):
            heads = slice(h, min(h + step, kvh))
            keys, vals = self._gather(block_tables, q.dtype, workspace, heads)  # [step, D, ctx, d]
            scores = torch.matmul(qg[heads], keys.transpose(-1, -2)).float().mul_(self.scale)  # [step, D, group, ctx]
            scores.masked_fill_(pad, float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(vals.dtype)
            outs.append(torch.matmul(probs, vals))
        o = outs[0] if len(outs) == 1 else torch.cat(outs)
        return o.transpose(0, 1).reshape(rows, self.num_heads, d)

    def _gather(self, block_tables: torch.Tensor, dtype: torch.dtype, workspace: dict[str, torch.Tensor] | None = None,
                heads: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks, [kv_heads, rows, blocks * block_size, d], one index_select each
        (only the KV heads in ``heads``).

        With a ``workspace`` the result is a view of a reused buffer (valid until the next
        gather): no fresh multi-megabyte tensor per layer, whose pages the allocator would
        hand back to the OS and fault in again every time.
        """
        rows, nblocks = block_tables.shape
        flat = block_tables.reshape(-1)
        k_cache, v_cache = self.k_cache[heads], self.v_cache[heads]
        kvh, _, block_size, d = k_cache.shape
        shape = (kvh, rows, nblocks * block_size, d)
        if workspace is None:
            keys = k_cache.index_select(1, flat).view(shape)
            vals = v_cache.index_select(1, flat).view(shape)
        else:
            gathered = (kvh, rows * nblocks, block_size, d)
            keys = torch.index_select(k_cache, 1, flat, out=_buffer(workspace, "k", k_cache, gathered))
            vals = torch.index_select(v_cache, 1, flat, out=_buffer(workspace, "v", v_cache, gathered))
            keys, vals = keys.view(shape), vals.view(shape)
        return keys.to(dtype), vals.to(dtype)


# The compiled model's attention layers, by layer_index, for the thread that runs it: a pool's engines step on
# threads of their own, and one module-wide list would hand one engine's graph another's KV cache.
_bound = threading.local()


def bind_layers(layers: list[Attention]) -> None:
    """Number ``layers`` and make them the ones ``kiln::paged_attention`` runs in this thread (set before each
    call of a compiled model: compiled graphs hold the index, never the module or its KV cache)."""
    for i, layer in enumerate(layers):
        layer.layer_index = i
    _bound.layers = layers


@torch.library.custom_op("kiln::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """Layer ``layer``'s paged attention (it writes k/v into that layer's cache), kept whole and
    opaque inside compiled graphs, as vLLM's piecewise compile keeps its attention."""
    return _bound.layers[layer].attend(q, k, v)


@paged_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


def heads_per_chunk(num_kv_heads: int, kv_bytes: int) -> int:
    """How many KV heads CPU decode attention gathers at once, for ``kv_bytes`` of K+V over all heads."""
    return num_kv_heads if kv_bytes <= _CHUNK_BYTES else max(1, num_kv_heads * _CHUNK_BYTES // kv_bytes)


def _buffer(workspace: dict[str, torch.Tensor], name: str, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A ``shape`` view of ``workspace[name]`` (``like``'s dtype and device), grown when too small."""
    numel = math.prod(shape)
    buf = workspace.get(name)
    if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
        buf = workspace[name] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel].view(shape)
