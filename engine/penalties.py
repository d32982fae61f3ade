"""What the sampler does to logits before it samples: masks, bias and penalties.

Order, as in vLLM: allowed_token_ids mask -> min_tokens masking of EOS/stop ids ->
logit_bias -> repetition penalty (HF style, over prompt and output) -> presence/frequency
penalties (OpenAI style, over output). Penalties touch only the (row, token) pairs that
occurred, so they cost O(tokens), not O(vocabulary); the allowed-ids mask and the bias are
tensors built once per request (``SamplingParams``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol

import torch
from kiln.engine.sampling_kernels import index as _index
from kiln.engine.sampling_params import SamplingParams


class PenaltyRow(Protocol):
    """What the penalties read of a row: ``sampler.SamplingRow`` (the sampler imports this module, not the
    other way round)."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: Sequence[int]


def _min_tokens_masked_ids(row: PenaltyRow) -> list[int]:
    """The ids that would stop the request, which it may not sample below min_tokens (vLLM's
    rule: EOS only counts when it stops the request, i.e. without ignore_eos)."""
    if len(row.output_token_ids) >= row.params.min_tokens:
        return []
    return [*(() if row.params.ignore_eos else row.eos_token_ids), *row.params.stop_token_ids]


def needs_min_tokens_mask(row: PenaltyRow) -> bool:
    return bool(_min_tokens_masked_ids(row))


def _pairs(token_lists: list[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(local row, token id) pairs of a ragged batch of token lists, as two tensors."""
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.long)
    local_rows = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    ids = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long)
    return local_rows.to(device), ids.to(device)


def apply_penalties(logits: torch.Tensor, rows: list[PenaltyRow]) -> torch.Tensor:
    """allowed_token_ids, min_tokens masking, logit_bias and the three penalties; ``logits``
    itself when none apply."""
    device, vocab = logits.device, logits.shape[1]
    allowed = [i for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
    masked = [i for i, r in enumerate(rows) if needs_min_tokens_mask(r)]
    biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    counted = [i for i, r in enumerate(rows) if r.params.presence_penalty or r.params.frequency_penalty]
    if not (allowed or masked or biased or rep or counted):
        return logits
    out = logits.clone()
    for i in allowed:
        keep = torch.full((vocab,), float("-inf"), dtype=out.dtype, device=device)
        keep[rows[i].params.allowed_ids_tensor.to(device)] = 0.0
        out[i] += keep
    if masked:
        local, ids = _pairs([_min_tokens_masked_ids(rows[i]) for i in masked], device)
        out[_index(masked, device)[local], ids] = float("-inf")
    for i in biased:
        ids, values = rows[i].params.logit_bias_tensors
        out[i].index_add_(0, ids.to(device), values.to(device=device, dtype=out.dtype))
    if rep:
        local, ids = _pairs([[*rows[i].prompt_token_ids, *rows[i].output_token_ids] for i in rep], device)
        where = (_index(rep, device)[local], ids)
        penalty = torch.tensor([rows[i].params.repetition_penalty for i in rep], dtype=out.dtype, device=device)
        penalty = penalty[local]
        seen = out[where]  # duplicates read and write the same value
        out[where] = torch.where(seen > 0, seen / penalty, seen * penalty)
    if counted:
        local, ids = _pairs([rows[i].output_token_ids for i in counted], device)
        keys, counts = torch.unique(local * vocab + ids, return_counts=True)
        local, ids = keys // vocab, keys % vocab
        frequency = torch.tensor([rows[i].params.frequency_penalty for i in counted], dtype=out.dtype, device=device)
        presence = torch.tensor([rows[i].params.presence_penalty for i in counted], dtype=out.dtype, device=device)
        frequency, presence = frequency[local], presence[local]
        out[_index(counted, device)[local], ids] -= frequency * counts.to(out.dtype) + presence
    return out
