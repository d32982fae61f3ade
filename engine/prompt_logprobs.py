"""Prompt logprobs (``SamplingParams.prompt_logprobs``, what `/v1/completions` returns for ``echo`` with
``logprobs``): for each prompt token after the first, its log-probability under the model given the tokens before
it, its rank there (1: the most likely; ``Request.prompt_ranks``), and the ``k`` most likely tokens at that
position.

A prefill chunk computes the hidden state of every position it runs; the runner asks for the logits of the
positions whose next token is a prompt token (:func:`prompt_rows`, after the rows it samples) and :func:`fill`
turns them into one entry per prompt token, in order, on the request (``Request.prompt_logprobs``, the first
entry None: nothing comes before the first token). Entries are kept once made: a preempted request's recomputed
prefill adds none. A request that needs them reads nothing from the prefix cache (a cached block's positions are
not computed, so their logits would be missing); its own blocks are cached as any request's. Its prefill runs
in chunks of :data:`ROWS_AT_ONCE` tokens at most (:func:`chunk_limit`), so its logits rows stay bounded.
Logprobs are those of the model's logits, unmodified by the request's sampling settings (vLLM's default, as for
``logprobs``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from kiln.engine.sequence import Request


@dataclass
class PromptSpan:
    """``num`` consecutive logits rows of a step give ``request`` the entries of its prompt tokens ``first``,
    ``first + 1``, ... (the spans of a micro-batch follow each other, after its sampled rows)."""

    request: Request
    first: int
    num: int


def prompt_rows(reqs: Sequence[Request], starts: Sequence[int], nums: Sequence[int], cu: Sequence[int]
                ) -> tuple[list[int], list[PromptSpan]]:
    """The packed positions whose logits give prompt logprobs, in order, and their spans (``starts``, ``nums``:
    each row's first position and its number of tokens; ``cu``: their running sum, the packed end of each row)."""
    positions: list[int] = []
    spans: list[PromptSpan] = []
    for r, s, n, end in zip(reqs, starts, nums, cu, strict=True):
        if not r.needs_prompt_logprobs:
            continue
        # position j's logits give token j + 1: prompt tokens from the first without an entry to the last
        lo, hi = max(s, len(r.prompt_logprobs) - 1), min(s + n, r.num_prompt_tokens - 1)
        if lo >= hi:
            continue
        spans.append(PromptSpan(r, lo + 1, hi - lo))
        packed = end - n - s  # the packed index of position 0 of this row
        positions.extend(range(packed + lo, packed + hi))
    return positions, spans


ROWS_AT_ONCE = 256  # logits rows a step makes for one request's prompt (so its float32 log-softmax rows too)


def chunk_limit(req: Request) -> int:
    """The most tokens a step computes for ``req``: :data:`ROWS_AT_ONCE` while its prompt logprobs are being made
    (each such position is a logits row: the LM head's output, rows times the vocabulary, is bounded as a sampled
    batch's is, not by ``max_num_tokens``), else no limit of its own."""
    return ROWS_AT_ONCE if req.needs_prompt_logprobs else sys.maxsize


def fill(logits: torch.Tensor, spans: list[PromptSpan]) -> None:
    """Append each span's entries to its request: {token id: logprob} of the prompt token and of the ``k`` most
    likely tokens (``params.prompt_logprobs``), as ``Request.logprobs`` holds the sampled tokens'. A span has at
    most :data:`ROWS_AT_ONCE` rows (:func:`chunk_limit`), so each log-softmax is bounded."""
    row = 0
    for span in spans:
        _append(span.request, logits[row:row + span.num], span.first)
        row += span.num


def _append(req: Request, logits: torch.Tensor, first: int) -> None:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = req.prompt_token_ids[first:first + logprobs.shape[0]]
    chosen_t = logprobs.gather(1, torch.tensor(targets, device=logprobs.device)[:, None])
    chosen = chosen_t[:, 0].tolist()
    req.prompt_ranks += ((logprobs > chosen_t).sum(dim=-1) + 1).tolist()
    k = req.params.prompt_logprobs
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    for tok, lp, tid, tlp in zip(targets, chosen, top_ids.tolist(), top_lp.tolist(), strict=True):
        entry = dict(zip(tid, tlp, strict=True))
        entry[tok] = lp
        req.prompt_logprobs.append(entry)
