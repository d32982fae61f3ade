"""Scheduling policy: which requests run this step and how many tokens each computes.

No tensors here. Each step:

1. running requests with one token left to compute (decodes) get it, then
   running requests still prefilling get a chunk of what's left, all within
   ``max_num_tokens``; with speculative decoding on, a decode also gets up to
   the draft length the running batch's bucket allows (``by_batch``, the
   build's measured table; ``spec_decode``). Drafts are budgeted (tokens)
   before the prefill chunks, but get KV blocks only after every running
   request's committed tokens have theirs: they shrink to the slots left
   (possibly none) and never preempt anyone;
2. when a running request needs a block for its committed tokens and none is
   free, the newest running request is preempted (its blocks freed, its
   progress reset to zero, it goes back to the front of the queue to be
   recomputed later) — possibly itself;
3. if nothing was preempted, waiting requests are admitted in arrival order
   (prefix-cache hits first, then a prefill chunk) while blocks, tokens and
   ``max_batch_size`` allow. Admission stops at the first request that does not
   fit, so a big request is never starved by smaller ones behind it.

Requests under a LoRA adapter also need a device slot for it (``lora.slots``): one that cannot get a
slot stays waiting while the requests behind it are admitted. Draft-model speculation is off for
adapter rows (the draft model has no adapter); prompt-lookup speculation works for them.

Requests that could never fit the pool are refused before they are queued
(``LLMEngine.add_request``), so one request alone always makes progress.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kiln.engine.block_manager import BlockManager
from kiln.engine.lora.slots import SlotTable
from kiln.engine.prompt_logprobs import chunk_limit
from kiln.engine.sequence import Request, RequestStatus
from kiln.engine.spec_decode.config import SpeculativeConfig
from kiln.engine.spec_decode.proposer import NgramProposer, Proposer


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens to compute)
    num_preempted: int = 0
    lora_loads: list = field(default_factory=list)  # (slot, adapter) to put on the device before the step

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_batch_size: int, max_num_tokens: int,
                 speculative: SpeculativeConfig | None = None, proposer: Proposer | None = None,
                 lora_slots: SlotTable | None = None) -> None:
        self.block_manager = block_manager
        self.lora_slots = lora_slots  # None: LoRA off
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.set_speculative(speculative, proposer)

    def set_speculative(self, speculative: SpeculativeConfig | None, proposer: Proposer | None = None) -> None:
        """Speculation from now on (None: off), with fresh counters; the build's tune stage times
        several settings on one loaded engine this way (``LLMEngine.set_speculative``). ``proposer``:
        the draft source (default: prompt lookup)."""
        self.speculative = speculative
        if speculative is not None and proposer is None:
            proposer = NgramProposer(speculative)
        self.proposer = proposer if speculative is not None else None
        self.num_steps_speculation_off = 0  # steps with speculation on but the batch's bucket at 0 drafts

    def _draft_length(self) -> int:
        """The load rule: this step's draft length for the running batch (0: no drafts)."""
        if self.proposer is None:
            return 0
        k = self.speculative.k_for_batch(len(self.running))
        if k == 0:
            self.num_steps_speculation_off += 1
        return k

    def _drafts(self, req: Request, budget: int, k: int) -> list[int]:
        """Draft tokens for a decode: within the step's budget and the tokens the request may still
        produce (the last committed token is always sampled, so at most ``left - 1`` drafts)."""
        if req.grammar is not None:  # a grammar's state advances one committed token at a time
            return []
        if req.lora is not None and self.speculative.method == "draft_model":  # the draft has no adapter
            return []
        left = req.max_tokens - req.num_output_tokens
        return self.proposer.propose(req, min(budget - 1, left - 1), k)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        scheduled: dict[str, int] = {}  # request id -> committed tokens (drafts are added last)
        drafts: dict[str, list[int]] = {}  # request id -> drafts budgeted, not yet given blocks
        draft_length = self._draft_length()
        for req in self.running:
            req.spec_token_ids = []
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        budget = self._schedule_committed(decodes, self.max_num_tokens, scheduled, drafts, out)
        for req in decodes if draft_length else ():
            if budget > 0 and req.request_id in scheduled and (proposed := self._drafts(req, budget + 1, draft_length)):
                drafts[req.request_id] = proposed
                budget -= len(proposed)
        budget = self._schedule_committed(prefills, budget, scheduled, drafts, out)
        budget += self._give_draft_blocks(drafts, scheduled)
        if not out.num_preempted:
            self._admit(budget, scheduled)
        by_id = {r.request_id: r for r in self.running}
        out.scheduled = [(by_id[rid], n) for rid, n in scheduled.items()]
        if self.lora_slots is not None and out.scheduled:  # else they wait for a step that runs
            out.lora_loads = self.lora_slots.take_loads()
        return out

    def _admit(self, budget: int, scheduled: dict[str, int]) -> None:
        """Admit waiting requests in arrival order while blocks, tokens and ``max_batch_size`` allow; stop at
        the first that does not fit, passing over those whose adapter can get no device slot now."""
        slots = self.lora_slots
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_batch_size:
                break
            if req.lora is not None and not slots.can_acquire(req.lora):
                continue
            # prompt logprobs need every prompt position computed (prompt_logprobs.py)
            cached = [] if req.needs_prompt_logprobs else self.block_manager.find_cached_blocks(req)
            num_new = min(req.num_tokens - len(cached) * self.block_manager.block_size, budget, chunk_limit(req))
            if not self.block_manager.can_allocate(req, cached, num_new):
                break
            self.waiting.remove(req)
            self.block_manager.allocate(req, cached, num_new)
            if req.lora is not None:
                req.lora_slot = slots.acquire(req.lora)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = num_new
            budget -= num_new

    def _release_slot(self, req: Request) -> None:
        if req.lora_slot is not None:
            self.lora_slots.release(req.lora_slot)
            req.lora_slot = None

    def _schedule_committed(self, reqs: list[Request], budget: int, scheduled: dict[str, int],
                            drafts: dict[str, list[int]], out: SchedulerOutput) -> int:
        """Blocks and budget for each of ``reqs``' committed tokens (a decode's one, a prefill's chunk), in
        order, preempting the newest running request while one does not fit; returns the budget left."""
        for req in reqs:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            num_new = min(req.num_tokens - req.num_computed_tokens, budget, chunk_limit(req))
            while not self.block_manager.can_append(req, num_new):
                victim = self.running[-1]
                budget += scheduled.pop(victim.request_id, 0) + len(drafts.pop(victim.request_id, ()))
                self._preempt(victim)
                out.num_preempted += 1
                if victim is req:
                    break
            else:
                self.block_manager.append_slots(req, num_new)
                scheduled[req.request_id] = num_new
                budget -= num_new
        return budget

    def _give_draft_blocks(self, drafts: dict[str, list[int]], scheduled: dict[str, int]) -> int:
        """Give the budgeted drafts the slots left once every committed token has one, in decode order,
        each cut to what fits (possibly nothing); returns the budget the cuts gave back."""
        bm, returned = self.block_manager, 0
        for req in self.running:
            proposed = drafts.get(req.request_id)
            if not proposed:
                continue
            room = (len(req.block_table) + bm.num_free_blocks) * bm.block_size - req.num_computed_tokens - 1
            kept = proposed[:max(0, room)]
            returned += len(proposed) - len(kept)
            if kept:
                bm.append_slots(req, 1 + len(kept))
                req.spec_token_ids = kept
                scheduled[req.request_id] += len(kept)
        return returned

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.block_manager.free(req)
        self._release_slot(req)
        req.spec_token_ids = []
        req.num_computed_tokens = 0
        if req.spec_state is not None:  # its blocks are gone: a draft model starts over with them
            req.spec_state.draft_computed = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        """Mark ``req`` finished and return its blocks at once (also used for aborts)."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self.block_manager.free(req)
            self._release_slot(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
