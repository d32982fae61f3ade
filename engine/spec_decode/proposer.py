"""Prompt-lookup drafts: the tokens that followed the last earlier occurrence of a request's suffix.

Each request keeps an index of its own n-grams (``NgramIndex``: n-gram -> where its latest
occurrence ended), extended by the tokens committed since the last lookup, so a lookup costs
``O(prompt_lookup_max)`` dict probes plus the new tokens, not a scan of the whole history. The
suffix itself is never indexed, so a hit is always an *earlier* occurrence; the longest n that hits
wins. Committed tokens never change (preemption only recomputes their K/V), so the index stays valid
for the request's whole life.

How many drafts a request proposes adapts to how often its drafts were accepted: an exponential
average of its per-step acceptance (``ACCEPTANCE_DECAY``); below ``min_acceptance_rate`` the draft
length shrinks in proportion, down to one token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.engine.spec_decode.config import SpeculativeConfig

ACCEPTANCE_DECAY = 0.5  # weight of the history in a request's acceptance average


class NgramIndex:
    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.end_of: dict[tuple[int, ...], int] = {}  # n-gram -> index just past its latest indexed occurrence
        self.next_end = 1  # n-grams ending before this index (exclusive end) are indexed

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens following the latest earlier occurrence of the longest matching suffix."""
        num = len(token_ids)
        for end in range(self.next_end, num):  # never the suffix itself (end == num)
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.end_of[tuple(token_ids[end - n:end])] = end
        self.next_end = max(self.next_end, num)
        for n in range(min(self.n_max, num - 1), self.n_min - 1, -1):
            end = self.end_of.get(tuple(token_ids[num - n:]))
            if end is not None:
                return token_ids[end:end + k]
        return []


@dataclass
class SpecDecodeStats:
    """Engine-wide counters: verification rows run, drafts proposed, drafts accepted (per position too)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass
class RequestSpecState:
    index: NgramIndex | None = None  # prompt lookup's n-grams
    acceptance: float = 1.0  # exponential average of accepted / proposed
    draft_computed: int = 0  # a draft model's: leading tokens whose draft K/V is in the blocks
    draft_start: int = 0     # a draft model's: the request's length when its drafts were proposed


class Proposer:
    """What every draft source shares: the per-request draft length (adapted to acceptance) and the
    counters. ``propose`` answers in the scheduler; a source with ``deferred`` set answers with
    placeholders there and runs once the step's blocks are allocated (``fill``)."""

    deferred = False

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.stats = SpecDecodeStats(accepted_per_position=[0] * config.num_speculative_tokens)

    def new_state(self) -> RequestSpecState:
        return RequestSpecState()

    def _state(self, req) -> RequestSpecState:
        if req.spec_state is None:
            req.spec_state = self.new_state()
        return req.spec_state

    def num_drafts(self, req, k: int | None = None) -> int:
        """This request's draft length now: ``k`` (default: num_speculative_tokens; the scheduler passes
        the batch bucket's), scaled down while its acceptance is below the floor."""
        cfg, acceptance = self.config, self._state(req).acceptance
        k = cfg.num_speculative_tokens if k is None else k
        if k == 0 or acceptance >= cfg.min_acceptance_rate:
            return k
        return max(1, int(k * acceptance / cfg.min_acceptance_rate))

    def propose(self, req, max_drafts: int, k: int | None = None) -> list[int]:
        raise NotImplementedError

    def fill(self, reqs: list) -> None:
        """Replace the placeholders ``propose`` left in these requests' ``spec_token_ids`` (deferred sources)."""

    def record(self, req, num_proposed: int, num_accepted: int) -> None:
        """Count one verification of ``num_proposed`` drafts of which the first ``num_accepted`` held."""
        if num_proposed == 0:
            return
        state = self._state(req)
        state.acceptance = ACCEPTANCE_DECAY * state.acceptance + (1 - ACCEPTANCE_DECAY) * num_accepted / num_proposed
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_proposed
        s.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            s.accepted_per_position[i] += 1


class NgramProposer(Proposer):
    def new_state(self) -> RequestSpecState:
        return RequestSpecState(NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max))

    def propose(self, req, max_drafts: int, k: int | None = None) -> list[int]:
        """Draft tokens for ``req`` (at most ``max_drafts``, of a draft length ``k``: see ``num_drafts``);
        [] when its suffix occurred nowhere earlier."""
        k = min(self.num_drafts(req, k), max_drafts)
        state = self._state(req)
        if state.index is None:  # a request that began under another draft source
            state.index = self.new_state().index
        return state.index.propose(req.token_ids, k) if k > 0 else []


def speculation_stats(scheduler: Any) -> dict[str, Any]:
    """What ``LLMEngine.stats()`` reports of speculation ({} when it is off)."""
    proposer = scheduler.proposer
    if proposer is None:
        return {}
    s = proposer.stats
    return dict(num_speculative_tokens=proposer.config.num_speculative_tokens, spec_num_drafts=s.num_drafts,
                spec_num_draft_tokens=s.num_draft_tokens, spec_num_accepted_tokens=s.num_accepted_tokens,
                spec_accepted_per_position=list(s.accepted_per_position),
                spec_steps_off_by_batch=scheduler.num_steps_speculation_off)
