"""Turn one step's logits into next tokens, each row under its own ``SamplingParams``.

Order, as in vLLM and Hugging Face: min_tokens masking of EOS/stop ids -> repetition
penalty (HF style, over prompt and output) -> presence/frequency penalties (OpenAI style,
over output) -> greedy rows take the argmax here -> temperature -> top-k -> top-p -> min-p
-> draw. A batch that is all plain greedy is one ``argmax`` and nothing else.

Rows are grouped by the features they use and each feature is one vectorized op over its
group, so Python work is per row and scalar, never per vocabulary entry.

Drawing is by inverse CDF: one uniform number per row, looked up in the row's cumulative
distribution taken in token-id order (see ``_inverse_cdf``). A
seeded row draws its uniform from its own ``torch.Generator``, and every op before the
draw is row-wise and independent of tie order (each filter keeps the tokens at or above a
threshold value), so a seeded request samples the same tokens whatever else is in the
batch and wherever it sits. Unseeded rows share torch's default generator.

Top-p finds its threshold among each row's most likely ``_TOP_P_TIERS[0]`` tokens, then
``_TOP_P_TIERS[1]``: once their mass reaches ``top_p`` the nucleus lies inside them (exact,
not an approximation). Only rows flatter than that pay a full sort of the vocabulary.
Tokens tied with the last one of the nucleus are all kept (HF keeps an arbitrary subset).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from kiln.engine.sampling_params import SamplingParams

# Temperatures below this are greedy, as in vLLM: dividing by them overflows float32.
_SAMPLING_EPS = 1e-5
_TOP_P_TIERS = (128, 1024)
_DRAW_BLOCK = 256


@dataclass
class SamplingRow:
    """What the sampler needs to know about one request for one step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None  # the request's own, when params.seed is set
    eos_token_ids: Sequence[int] = ()  # masked, with params.stop_token_ids, below min_tokens


@dataclass
class SamplerOutput:
    """Per row: the sampled token and, when any row asked for logprobs, logprobs.

    Logprobs come from the log-softmax of the unmodified logits (vLLM's default), for
    every row once any row asked. ``top_ids``/``top_logprobs`` hold the ``k`` most
    likely tokens, sorted, with ``k`` the largest ``params.logprobs`` in the batch (it
    may be 0); a row that asked for fewer uses its first ``params.logprobs`` columns.
    """

    token_ids: torch.Tensor  # long [num_rows]
    logprobs: torch.Tensor | None = None  # float [num_rows]
    top_ids: torch.Tensor | None = None  # long [num_rows, k]
    top_logprobs: torch.Tensor | None = None  # float [num_rows, k]


def _is_greedy(params: SamplingParams) -> bool:
    return params.temperature < _SAMPLING_EPS


def _needs_min_tokens_mask(row: SamplingRow) -> bool:
    return len(row.output_token_ids) < row.params.min_tokens and bool(
        row.eos_token_ids or row.params.stop_token_ids
    )


def _has_penalty(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
    )


def _is_plain_greedy(row: SamplingRow) -> bool:
    p = row.params
    return _is_greedy(p) and p.logprobs is None and not _has_penalty(p) and not _needs_min_tokens_mask(row)


class Sampler:
    """Stateless; one instance serves every step. See the module docstring for the order."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits of shape {tuple(logits.shape)} do not match {len(rows)} sampling rows")
        if all(_is_plain_greedy(r) for r in rows):
            return SamplerOutput(token_ids=logits.argmax(dim=-1))

        processed = apply_penalties(logits, rows)
        greedy = [i for i, r in enumerate(rows) if _is_greedy(r.params)]
        if len(greedy) == len(rows):
            token_ids = processed.argmax(dim=-1)
        else:
            token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
            random = [i for i, r in enumerate(rows) if not _is_greedy(r.params)]
            if greedy:
                greedy_idx = _index(greedy, logits.device)
                token_ids[greedy_idx] = processed[greedy_idx].argmax(dim=-1)
            sub = processed if not greedy else processed[_index(random, logits.device)]
            drawn = _sample(sub, [rows[i] for i in random])
            if greedy:
                token_ids[_index(random, logits.device)] = drawn
            else:
                token_ids = drawn
        return _with_logprobs(logits, rows, token_ids)


def _index(positions: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(positions, dtype=torch.long, device=device)


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def _flat_ids(
    token_lists: list[Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs for a ragged batch of token lists, as two tensors."""
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.long)
    row_idx = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    flat: list[int] = list(itertools.chain.from_iterable(token_lists))
    ids = torch.tensor(flat, dtype=torch.long)
    return row_idx.to(device), ids.to(device)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """min_tokens masking and the three penalties; returns ``logits`` itself when none apply."""
    device = logits.device
    num_rows, vocab = logits.shape
    out = logits

    masked = [i for i, r in enumerate(rows) if _needs_min_tokens_mask(r)]
    if masked:
        out = out.clone()
        ids = [[*rows[i].eos_token_ids, *rows[i].params.stop_token_ids] for i in masked]
        local_rows, cols = _flat_ids(ids, device)
        out[_index(masked, device)[local_rows], cols] = float("-inf")

    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        out = out.clone() if out is logits else out
        idx = _index(rep, device)
        local_rows, ids = _flat_ids(
            [list(itertools.chain(rows[i].prompt_token_ids, rows[i].output_token_ids)) for i in rep], device
        )
        seen = torch.zeros(len(rep), vocab, dtype=torch.bool, device=device)
        seen[local_rows, ids] = True
        penalty = _column([rows[i].params.repetition_penalty for i in rep], logits)
        sub = out[idx]
        penalized = torch.where(sub > 0, sub / penalty, sub * penalty)
        out[idx] = torch.where(seen, penalized, sub)

    counted = [i for i, r in enumerate(rows) if r.params.presence_penalty or r.params.frequency_penalty]
    if counted:
        out = out.clone() if out is logits else out
        idx = _index(counted, device)
        local_rows, ids = _flat_ids([rows[i].output_token_ids for i in counted], device)
        counts = torch.zeros(len(counted), vocab, dtype=logits.dtype, device=device)
        counts.index_put_((local_rows, ids), torch.ones_like(ids, dtype=logits.dtype), accumulate=True)
        frequency = _column([rows[i].params.frequency_penalty for i in counted], logits)
        presence = _column([rows[i].params.presence_penalty for i in counted], logits)
        out[idx] = out[idx] - frequency * counts - presence * (counts > 0).to(logits.dtype)
    return out


def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    return _draw(sampling_probs(logits, rows), rows)


def sampling_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution each non-greedy row draws from: temperature, top-k, top-p, min-p
    applied to (already penalized) ``logits``; filtered tokens get probability 0 and the
    rest are not renormalized after top-p/min-p (the draw scales by the row's total)."""
    device = logits.device
    vocab = logits.shape[1]
    temps = [r.params.temperature for r in rows]
    if any(t != 1.0 for t in temps):
        logits = logits / _column(temps, logits)

    top_k = [i for i, r in enumerate(rows) if 0 < r.params.top_k < vocab]
    if top_k:
        idx = _index(top_k, device)
        ks = torch.tensor([rows[i].params.top_k for i in top_k], dtype=torch.long, device=device)
        sub = logits[idx]
        kth = sub.topk(int(ks.max()), dim=-1).values.gather(1, (ks - 1).unsqueeze(1))
        filtered = sub.masked_fill(sub < kth, float("-inf"))
        if len(top_k) == len(rows):
            logits = filtered
        else:
            logits = logits.clone()  # may be the caller's tensor
            logits[idx] = filtered

    probs = logits.softmax(dim=-1)

    top_p = [i for i, r in enumerate(rows) if r.params.top_p < 1.0]
    if top_p:
        idx = _index(top_p, device)
        probs[idx] = _top_p_filter(probs[idx], _column([rows[i].params.top_p for i in top_p], probs))

    min_p = [i for i, r in enumerate(rows) if r.params.min_p > 0.0]
    if min_p:
        idx = _index(min_p, device)
        sub = probs[idx]
        threshold = sub.max(dim=-1, keepdim=True).values * _column([rows[i].params.min_p for i in min_p], sub)
        probs[idx] = sub.masked_fill(sub < threshold, 0.0)
    return probs


def _top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero the tokens outside each row's nucleus: taking tokens from the most likely down,
    a token stays while the mass before it is below ``top_p`` (the most likely always stays)."""
    num_rows, vocab = probs.shape
    threshold = torch.empty_like(top_p)
    todo = torch.arange(num_rows, device=probs.device)
    for tier in (*_TOP_P_TIERS, vocab):
        sub = probs[todo] if len(todo) < num_rows else probs
        if tier >= vocab:
            values = sub.sort(dim=-1, descending=True).values
        else:
            values = sub.topk(tier, dim=-1).values
        cumulative = values.cumsum(dim=-1)
        wanted = top_p[todo]
        num_kept = ((cumulative - values) < wanted).sum(dim=-1, keepdim=True).clamp_(min=1)
        row_threshold = values.gather(1, num_kept - 1)
        covered = (cumulative[:, -1:] >= wanted).squeeze(1) if tier < vocab else torch.ones_like(todo, dtype=bool)
        threshold[todo[covered]] = row_threshold[covered]
        todo = todo[~covered]
        if len(todo) == 0:
            break
    return probs.masked_fill(probs < threshold, 0.0)


def _draw(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """One token per row by inverse CDF; seeded rows use their own generator."""
    device = probs.device
    uniforms = torch.empty(len(rows), dtype=torch.float64, device=device)
    seeded = [i for i, r in enumerate(rows) if r.generator is not None]
    if len(seeded) < len(rows):
        shared = [i for i, r in enumerate(rows) if r.generator is None]
        uniforms[_index(shared, device)] = torch.rand(len(shared), dtype=torch.float64, device=device)
    if seeded:
        own = [torch.rand(1, dtype=torch.float64, generator=g, device=g.device).item()
               for g in (rows[i].generator for i in seeded)]
        uniforms[_index(seeded, device)] = torch.tensor(own, dtype=torch.float64, device=device)
    return _inverse_cdf(probs, uniforms)


def _below(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x, torch.zeros_like(x))


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token where each row's cumulative weight (token-id order) first exceeds u * total.

    Two levels instead of a cumsum over the vocabulary: per-block sums pick a block of
    ``_DRAW_BLOCK`` tokens, then a cumsum inside that block picks the token. Both cumsums
    are in float64 and short, so this is cheaper than one long one and keeps rare tokens'
    mass. The target is kept strictly below each total, so the chosen token has weight > 0.
    """
    num_rows, vocab = weights.shape
    pad = -vocab % _DRAW_BLOCK
    blocks = (torch.nn.functional.pad(weights, (0, pad)) if pad else weights).view(num_rows, -1, _DRAW_BLOCK)
    num_blocks = blocks.shape[1]
    block_cdf = blocks.sum(dim=-1).to(torch.float64).cumsum_(dim=-1)
    target = torch.minimum(uniforms.unsqueeze(1) * block_cdf[:, -1:], _below(block_cdf[:, -1:]))
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=num_blocks - 1)
    before = block_cdf.gather(1, (block - 1).clamp(min=0)).masked_fill_(block == 0, 0.0)
    inside = blocks.gather(1, block.unsqueeze(2).expand(-1, -1, _DRAW_BLOCK)).squeeze(1)
    inside_cdf = inside.to(torch.float64).cumsum_(dim=-1)
    rest = torch.minimum(target - before, _below(inside_cdf[:, -1:]))
    offset = torch.searchsorted(inside_cdf, rest, right=True).clamp_(max=_DRAW_BLOCK - 1)
    # The clamp only matters for rows with no mass at all (NaN or all -inf logits).
    return (block * _DRAW_BLOCK + offset).squeeze(1).clamp_(max=vocab - 1)


def _with_logprobs(logits: torch.Tensor, rows: list[SamplingRow], token_ids: torch.Tensor) -> SamplerOutput:
    wanted = [r.params.logprobs for r in rows if r.params.logprobs is not None]
    if not wanted:
        return SamplerOutput(token_ids=token_ids)
    logprobs = logits.log_softmax(dim=-1)
    sampled = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    top_logprobs, top_ids = logprobs.topk(max(wanted), dim=-1)
    return SamplerOutput(token_ids=token_ids, logprobs=sampled, top_ids=top_ids, top_logprobs=top_logprobs)
