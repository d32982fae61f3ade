"""Turn one step's logits into next tokens, each row under its own ``SamplingParams``.

Order, as in vLLM: the grammar's mask (structured outputs) -> allowed_token_ids mask ->
min_tokens masking of EOS/stop ids -> logit_bias -> repetition penalty (HF style, over prompt
and output) -> presence/frequency penalties (OpenAI style, over output) -> greedy rows take
the argmax here -> temperature -> top-k -> top-p -> min-p -> draw. A batch that is all plain greedy is one argmax and
nothing else.

Rows are grouped by the features they use and each feature is one vectorized op over its
group: Python work is per row and scalar, never per vocabulary entry. The masks, bias and
penalties are ``penalties.py``; the exact CPU-fast argmax, top-k and inverse-CDF draw are
``sampling_kernels.py``; this module is the policy.

Every filter becomes one threshold per row on the softmax probabilities (top-k: the k-th
largest; top-p: the smallest probability in the nucleus; min-p: ``min_p`` times the
largest), and a token stays when it is at or above its row's threshold. Thresholds do not
depend on the order of tied values, so ties at the boundary all stay (HF keeps an
arbitrary subset). They come from each row's most likely tokens (``torch.topk``, cheap on
few columns), in growing tiers: a tier settles a row once it provably holds the whole
top-k set / nucleus; only rows flatter than ``_TIERS[-1]`` tokens pay a full sort.

Drawing is by inverse CDF in token-id order (``sampling_kernels.inverse_cdf``): one uniform number per
row. A seeded row draws it from its own ``torch.Generator``; since every op before is
row-wise and order-independent, a seeded request samples the same tokens whatever else is
in the batch and wherever it sits. Unseeded rows share torch's default generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from kiln.engine.penalties import apply_penalties, needs_min_tokens_mask
from kiln.engine.sampling_kernels import argmax as _argmax
from kiln.engine.sampling_kernels import index as _index
from kiln.engine.sampling_kernels import inverse_cdf as _inverse_cdf
from kiln.engine.sampling_kernels import topk as _topk
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.structured.state import apply_bitmask, fill_bitmasks

_TIERS = (32, 128, 1024)


@dataclass
class SamplingRow:
    """What the sampler needs to know about one request for one step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None  # the request's own, when params.seed is set
    eos_token_ids: Sequence[int] = ()  # masked (unless ignore_eos), with stop_token_ids, below min_tokens
    grammar: Any = None  # structured.state.GrammarState: its mask applies before everything else


@dataclass
class SamplerOutput:
    """Per row: the sampled token and, when any row asked for logprobs, logprobs.

    Logprobs come from the log-softmax of the unmodified logits (vLLM's default).
    ``top_ids``/``top_logprobs`` hold the ``k`` most likely tokens, sorted, with ``k`` the
    largest ``params.logprobs`` in the batch (it may be 0); a row that asked for fewer uses
    its first ``params.logprobs`` columns. Rows that did not ask hold NaN and id -1.
    """

    token_ids: torch.Tensor  # long [num_rows]
    logprobs: torch.Tensor | None = None  # float [num_rows]
    top_ids: torch.Tensor | None = None  # long [num_rows, k]
    top_logprobs: torch.Tensor | None = None  # float [num_rows, k]
    errors: dict[int, str] = field(default_factory=dict)  # row -> why sampling failed for it (token id -1)


def _is_greedy(params: SamplingParams) -> bool:
    return params.is_greedy


def _is_plain_greedy(row: SamplingRow) -> bool:
    p = row.params
    return (
        p.is_greedy and p.logprobs is None and p.repetition_penalty == 1.0
        and not p.presence_penalty and not p.frequency_penalty and not needs_min_tokens_mask(row)
        and not p.logit_bias and p.allowed_token_ids is None
    )


class Sampler:
    """Stateless; one instance serves every step. See the module docstring for the order."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits of shape {tuple(logits.shape)} do not match {len(rows)} sampling rows")
        if any(r.grammar is not None for r in rows):
            _apply_grammars(logits, rows)
        if all(_is_plain_greedy(r) for r in rows):
            return SamplerOutput(token_ids=_argmax(logits))
        processed = apply_penalties(logits, rows)
        greedy = [i for i, r in enumerate(rows) if _is_greedy(r.params)]
        random = [i for i, r in enumerate(rows) if not _is_greedy(r.params)]
        if not random:
            token_ids = _argmax(processed)
        elif not greedy:
            token_ids = _sample(processed, rows)
        else:
            token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
            greedy_idx, random_idx = _index(greedy, logits.device), _index(random, logits.device)
            token_ids[greedy_idx] = _argmax(processed.index_select(0, greedy_idx))
            token_ids[random_idx] = _sample(processed.index_select(0, random_idx), [rows[i] for i in random])
        return _with_logprobs(logits, rows, token_ids)


def _apply_grammars(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Set the logits of the tokens each constrained row's grammar refuses to -inf, in place. Logprobs
    are then those of the constrained distribution (vLLM's too). A row left with no token at all (its
    grammar and allowed_token_ids disagree) samples one its grammar refuses, and fails alone there."""
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    apply_bitmask(logits, constrained, fill_bitmasks([rows[i].grammar for i in constrained], logits.shape[1]))


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    return _draw(sampling_probs(logits, rows), rows)


def sampling_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The weights each non-greedy row draws from: the tempered softmax of the (already
    penalized) ``logits`` with filtered tokens set to 0, not renormalized."""
    temperatures = [r.params.temperature for r in rows]
    if any(t != 1.0 for t in temperatures):
        logits = logits / _column(temperatures, logits)
    probs = logits.softmax(dim=-1)
    threshold = _thresholds(probs, rows)
    if threshold is not None:
        probs.mul_(probs >= threshold)
    return probs


def _thresholds(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor | None:
    """Per row, the smallest probability that survives top-k, top-p and min-p (0: all do)."""
    device, vocab = probs.device, probs.shape[1]
    # Rows with top-k start from k + 1 candidates, rows with top-p only from _TIERS[0].
    with_k = [i for i, r in enumerate(rows) if 0 < r.params.top_k < vocab]
    top_p_only = [i for i, r in enumerate(rows) if r.params.top_p < 1.0 and not 0 < r.params.top_k < vocab]
    min_p = [i for i, r in enumerate(rows) if r.params.min_p > 0.0]
    if not (with_k or top_p_only or min_p):
        return None
    threshold = torch.zeros(len(rows), 1, dtype=probs.dtype, device=device)
    if min_p:
        idx = _index(min_p, device)
        largest = probs.amax(dim=-1, keepdim=True)[idx]
        threshold[idx] = largest * _column([rows[i].params.min_p for i in min_p], probs)
    for ranked in (with_k, top_p_only):
        if ranked:
            idx = _index(ranked, device)
            sub = probs if len(ranked) == len(rows) else probs.index_select(0, idx)
            threshold[idx] = torch.maximum(threshold[idx], _ranked_thresholds(sub, [rows[i] for i in ranked]))
    return threshold


def _ranked_thresholds(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Top-k then top-p thresholds, from the rows' most likely tokens in growing tiers.

    A row is settled by a tier of ``size`` sorted values when the tier provably holds all
    of its top-k set (the last value is below the k-th: no tie reaches past the tier) and,
    without top-k, its nucleus (the tier's mass reaches ``top_p``). Settled thresholds are
    the same whichever tier settles them: the sorted values, and their sums, are.
    """
    num_rows, vocab = probs.shape
    top_k = torch.tensor([r.params.top_k if 0 < r.params.top_k < vocab else 0 for r in rows],
                         device=probs.device).unsqueeze(1)
    top_p = _column([r.params.top_p for r in rows], probs)
    threshold = torch.empty(num_rows, 1, dtype=probs.dtype, device=probs.device)
    todo = torch.arange(num_rows, device=probs.device)
    size = int(top_k.max()) + 1 if bool((top_k > 0).all()) else max(int(top_k.max()) + 1, _TIERS[0])
    while len(todo):
        size = min(size, vocab)
        sub = probs if len(todo) == num_rows else probs.index_select(0, todo)
        values = sub.sort(dim=-1, descending=True).values if size == vocab else _topk(sub, size)[0]
        k, p = top_k[todo], top_p[todo]
        has_k = k > 0
        kth = torch.where(has_k, values.gather(1, (k - 1).clamp(min=0)), torch.zeros_like(p))
        kept = values * (values >= kth)
        cumulative = kept.cumsum(dim=-1)
        mass = torch.where(has_k, cumulative[:, -1:], torch.ones_like(p))  # top-p renormalizes after top-k
        num_in_nucleus = ((cumulative - kept) < p * mass).sum(dim=-1, keepdim=True).clamp(min=1)
        row_threshold = torch.where(p < 1, torch.maximum(kth, values.gather(1, num_in_nucleus - 1)), kth)
        settled = torch.where(has_k, values[:, -1:] < kth, cumulative[:, -1:] >= p).squeeze(1) | (size == vocab)
        threshold[todo[settled]] = row_threshold[settled]
        todo = todo[~settled]
        size = next((t for t in _TIERS if t > size), vocab) if size < vocab else vocab
    return threshold


def _draw(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """One token per row by inverse CDF; seeded rows use their own generator."""
    device = probs.device
    uniforms = torch.empty(len(rows), dtype=torch.float64, device=device)
    seeded = [i for i, r in enumerate(rows) if r.generator is not None]
    if len(seeded) < len(rows):
        shared = [i for i, r in enumerate(rows) if r.generator is None]
        uniforms[_index(shared, device)] = torch.rand(len(shared), dtype=torch.float64, device=device)
    if seeded:
        own = [torch.rand(1, dtype=torch.float64, generator=g, device=g.device).to(device)
               for g in (rows[i].generator for i in seeded)]
        uniforms[_index(seeded, device)] = torch.cat(own)
    return _inverse_cdf(probs, uniforms)


def _with_logprobs(logits: torch.Tensor, rows: list[SamplingRow], token_ids: torch.Tensor) -> SamplerOutput:
    asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not asked:
        return SamplerOutput(token_ids=token_ids)
    k = max(rows[i].params.logprobs or 0 for i in asked)
    if len(asked) == len(rows):
        logprobs = logits.log_softmax(dim=-1)
        top_logprobs, top_ids = _topk(logprobs, k)
        return SamplerOutput(token_ids, logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1), top_ids, top_logprobs)
    idx = _index(asked, logits.device)
    logprobs = logits.index_select(0, idx).log_softmax(dim=-1)
    sampled = torch.full((len(rows),), float("nan"), dtype=logits.dtype, device=logits.device)
    sampled[idx] = logprobs.gather(1, token_ids[idx].unsqueeze(1)).squeeze(1)
    top_logprobs = torch.full((len(rows), k), float("nan"), dtype=logits.dtype, device=logits.device)
    top_ids = torch.full((len(rows), k), -1, dtype=torch.long, device=logits.device)
    top_logprobs[idx], top_ids[idx] = _topk(logprobs, k)
    return SamplerOutput(token_ids, sampled, top_ids, top_logprobs)


def merge_rows(outs: dict[int, SamplerOutput], errors: dict[int, str], num_rows: int,
               device: torch.device) -> SamplerOutput:
    """One SamplerOutput from rows sampled one at a time (rows in ``errors`` get id -1)."""
    token_ids = torch.full((num_rows,), -1, dtype=torch.long, device=device)
    for i, out in outs.items():
        token_ids[i] = out.token_ids[0]
    with_lp = {i: out for i, out in outs.items() if out.logprobs is not None}
    if not with_lp:
        return SamplerOutput(token_ids, errors=errors)
    k = max(out.top_ids.shape[1] for out in with_lp.values())
    logprobs = torch.full((num_rows,), float("nan"), device=device)
    top_ids = torch.full((num_rows, k), -1, dtype=torch.long, device=device)
    top_logprobs = torch.full((num_rows, k), float("nan"), device=device)
    for i, out in with_lp.items():
        width = out.top_ids.shape[1]
        logprobs[i] = out.logprobs[0]
        top_ids[i, :width], top_logprobs[i, :width] = out.top_ids[0], out.top_logprobs[0]
    return SamplerOutput(token_ids, logprobs, top_ids, top_logprobs, errors)
