"""One forward pass's packed inputs, from rows of tokens over the paged KV.

A row is a run of consecutive tokens of one request: its ids, the position of the first, and the
request's block table (the blocks its K/V is written to and read from). Single-token rows (decodes)
come first; every longer row (a prefill chunk, a verified row of drafts, a draft model's catch-up)
is attended like a prefill chunk over its cached context. The target's step
(``ModelRunner.prepare``) and the draft model's passes (``spec_decode.draft_model``) pack the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class StepInputs:
    """Everything a rank needs to run one step; CPU tensors, cheap to broadcast."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks]
    decode_ctx_lens: torch.Tensor      # [num_decodes]
    prefills: list[tuple[int, int, int, torch.Tensor]]  # (q_start, q_len, ctx_len, block_ids)
    logits_indices: torch.Tensor       # packed rows whose logits are sampled
    token_lora_slots: torch.Tensor | None = None  # per token, its adapter's device slot (-1: none); None: no adapter


def pack_rows(rows: list[tuple[list[int], int, list[int]]], block_size: int,
              logits_indices: list[int], row_lora_slots: list[int] | None = None) -> StepInputs:
    """``rows``: (token ids, position of the first, block table), single-token rows first; every
    position of a row must lie in its blocks. ``logits_indices``: the packed tokens whose logits
    the pass returns. ``row_lora_slots``: each row's adapter slot (-1: none)."""
    if all(len(row_ids) == 1 for row_ids, _, _ in rows):
        return _pack_decodes(rows, block_size, logits_indices, row_lora_slots)
    return _pack_any(rows, block_size, logits_indices, row_lora_slots)


def _pack_any(rows: list[tuple[list[int], int, list[int]]], block_size: int, logits_indices: list[int],
              row_lora_slots: list[int] | None) -> StepInputs:
    """:func:`pack_rows` of any rows, with tensor ops (a prefill chunk's positions are many)."""
    ids = [t for row_ids, _, _ in rows for t in row_ids]
    nums = [len(row_ids) for row_ids, _, _ in rows]
    starts = [start for _, start, _ in rows]
    num_rows = len(rows)
    nums_t = torch.tensor(nums, dtype=torch.long)
    starts_t = torch.tensor(starts, dtype=torch.long)
    cu = torch.cumsum(nums_t, 0)
    row_of_token = torch.repeat_interleave(torch.arange(num_rows), nums_t)
    positions = torch.arange(len(ids)) - (cu - nums_t)[row_of_token] + starts_t[row_of_token]
    widths = [len(table) for _, _, table in rows]
    max_blocks = max(widths)
    tables = torch.tensor([table + [0] * (max_blocks - len(table)) for _, _, table in rows], dtype=torch.long)
    slot_mapping = tables[row_of_token, positions // block_size] * block_size + positions % block_size
    ctx = starts_t + nums_t
    num_decodes = sum(1 for n in nums if n == 1)
    decode_width = max(widths[:num_decodes], default=0)  # decode rows gather only the blocks they hold
    prefills = [(int(cu[i] - nums[i]), nums[i], starts[i] + nums[i],
                 tables[i, : -(-(starts[i] + nums[i]) // block_size)]) for i in range(num_decodes, num_rows)]
    token_slots = None
    if row_lora_slots is not None and any(s >= 0 for s in row_lora_slots):
        token_slots = torch.tensor(row_lora_slots, dtype=torch.long)[row_of_token]
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.long), positions=positions, slot_mapping=slot_mapping,
        num_decodes=num_decodes, decode_block_tables=tables[:num_decodes, :decode_width],
        decode_ctx_lens=ctx[:num_decodes], prefills=prefills,
        logits_indices=torch.tensor(logits_indices, dtype=torch.long), token_lora_slots=token_slots,
    )


def _pack_decodes(rows: list[tuple[list[int], int, list[int]]], block_size: int, logits_indices: list[int],
                  row_lora_slots: list[int] | None) -> StepInputs:
    """:func:`pack_rows` of single-token rows alone (a decode step), the same tensors built from Python lists: a
    third of the time at batch 1 (76 -> 25 us here), where the tensor ops' own overhead was most of it."""
    positions = [start for _, start, _ in rows]
    width = max(len(table) for _, _, table in rows)
    slots = [table[p // block_size] * block_size + p % block_size for _, p, table in rows]
    token_slots = None
    if row_lora_slots is not None and any(s >= 0 for s in row_lora_slots):
        token_slots = torch.tensor(row_lora_slots, dtype=torch.long)
    return StepInputs(
        input_ids=torch.tensor([row_ids[0] for row_ids, _, _ in rows], dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long), slot_mapping=torch.tensor(slots, dtype=torch.long),
        num_decodes=len(rows),
        decode_block_tables=torch.tensor([table + [0] * (width - len(table)) for _, _, table in rows],
                                         dtype=torch.long),
        decode_ctx_lens=torch.tensor([p + 1 for p in positions], dtype=torch.long), prefills=[],
        logits_indices=torch.tensor(logits_indices, dtype=torch.long), token_lora_slots=token_slots,
    )


# -- on the wire: rank 0 sends a step's micro-batches to the other ranks as one int64 tensor ------------
# [num_batches] then, per batch, the header [tokens, num_decodes, decode_width, num_prefills, logits,
# has_lora_slots] and input_ids, positions, slot_mapping (tokens each), decode_block_tables
# (num_decodes x decode_width), decode_ctx_lens (num_decodes), per prefill [q_start, q_len, ctx_len, blocks] +
# its block ids, logits_indices, the token LoRA slots (tokens, if has_lora_slots). (An adapter's weights
# travel in messages of their own: lora/wire.py.) Every field is an int64 tensor or an int:
# no Python objects cross ranks.
def encode_steps(batches: list[StepInputs]) -> torch.Tensor:
    parts: list[torch.Tensor] = [torch.tensor([len(batches)], dtype=torch.long)]
    for b in batches:
        tokens, dec = b.input_ids.numel(), b.num_decodes
        width = b.decode_block_tables.shape[1] if b.decode_block_tables.dim() == 2 else 0
        heads = [tokens, dec, width, len(b.prefills), b.logits_indices.numel(),
                 int(b.token_lora_slots is not None)]
        for q_start, q_len, ctx_len, blocks in b.prefills:
            heads += [q_start, q_len, ctx_len, blocks.numel()]
        parts += [torch.tensor(heads, dtype=torch.long), b.input_ids, b.positions, b.slot_mapping,
                  b.decode_block_tables.reshape(-1), b.decode_ctx_lens]
        parts += [blocks for *_, blocks in b.prefills]
        parts.append(b.logits_indices)
        if b.token_lora_slots is not None:
            parts.append(b.token_lora_slots)
    return torch.cat([p.reshape(-1).to(torch.long) for p in parts])


class _Reader:
    def __init__(self, words: torch.Tensor) -> None:
        self.words, self.at = words, 0

    def take(self, n: int) -> torch.Tensor:
        if n < 0 or self.at + n > self.words.numel():
            raise ValueError(f"malformed step message: {n} words at {self.at} of {self.words.numel()}")
        self.at += n
        return self.words[self.at - n:self.at]

    def ints(self, n: int) -> list[int]:
        return self.take(n).tolist()


def decode_steps(words: torch.Tensor) -> list[StepInputs]:
    """The inverse of ``encode_steps``; raises ``ValueError`` on a message that does not parse exactly."""
    r = _Reader(words)
    (num_batches,) = r.ints(1)
    batches = []
    for _ in range(num_batches):
        heads = r.ints(6)
        tokens, dec, width, num_prefills, num_logits, has_slots = heads
        meta = [r.ints(4) for _ in range(num_prefills)]
        if min(heads + [v for m in meta for v in m], default=0) < 0:
            raise ValueError("malformed step message: a negative count")
        input_ids, positions, slot_mapping = r.take(tokens), r.take(tokens), r.take(tokens)
        tables = r.take(dec * width).view(dec, width)
        ctx_lens = r.take(dec)
        prefills = [(q_start, q_len, ctx_len, r.take(n)) for q_start, q_len, ctx_len, n in meta]
        logits_indices = r.take(num_logits)
        token_slots = r.take(tokens) if has_slots else None
        batches.append(StepInputs(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
                                  num_decodes=dec, decode_block_tables=tables, decode_ctx_lens=ctx_lens,
                                  prefills=prefills, logits_indices=logits_indices, token_lora_slots=token_slots))
    if r.at != words.numel():
        raise ValueError(f"malformed step message: {words.numel() - r.at} words left over")
    return batches


def split_batch(scheduled: list[tuple[Any, int]], parts: int,
                min_tokens: int = 1) -> list[list[tuple[Any, int]]]:
    """Split one step's (request, tokens) rows into at most ``parts`` micro-batches of about equal
    tokens (and at least ``min_tokens`` each), keeping the order (decodes first); each request lies
    in exactly one. Small steps stay whole: on CPU a linear over half the rows costs nearly what it
    costs over all of them, so splitting a small decode batch only adds work."""
    total = sum(n for _, n in scheduled)
    parts = max(1, min(parts, len(scheduled), total // min_tokens))
    if parts == 1:
        return [scheduled]
    out: list[list[tuple[Any, int]]] = []
    cur: list[tuple[Any, int]] = []
    acc = 0
    for i, (req, n) in enumerate(scheduled):
        cur.append((req, n))
        acc += n
        left_rows, left_parts = len(scheduled) - i - 1, parts - len(out) - 1
        if left_parts and (acc * parts >= total * (len(out) + 1) or left_rows == left_parts):
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out
