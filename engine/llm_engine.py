"""LLMEngine: requests in, one step at a time, tokens out. The core both LLM and AsyncLLM drive.

``step()`` is three calls: ``scheduler.schedule()`` -> ``runner.run()`` ->
``_postprocess()``; the last one appends the sampled tokens, detokenizes,
applies the stop rules and returns finished requests' blocks at once.
Requests are validated (``make_request``) before they reach the queue, so a
request that could never run fails its caller and never blocks the queue.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from kiln.engine.between_steps import hooks_for
from kiln.engine.block_manager import BlockManager
from kiln.engine.config import EngineConfig
from kiln.engine.errors import ConfigError, RequestError
from kiln.engine.limits import check_prompt, resolve_max_tokens
from kiln.engine.lora.manager import LoRAEngineMixin, LoRAManager, lora_disabled
from kiln.engine.lora.request import LoRARequest
from kiln.engine.model_runner import ModelRunner
from kiln.engine.outputs import EngineStats, StepUpdate
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.scheduler import Scheduler
from kiln.engine.sequence import Request
from kiln.engine.spec_decode.config import SpeculativeConfig
from kiln.engine.spec_decode.draft_model import DraftModel, DraftModelProposer, draft_block_bytes, tokenizer_mismatch
from kiln.engine.spec_decode.proposer import speculation_stats
from kiln.engine.spec_decode.verify import num_accepted, rewind_generator
from kiln.engine.stopping import make_detokenizer, stop_reason
from kiln.engine.tokenizer import load_tokenizer_beside, shelve

log = logging.getLogger("kiln.engine")


class LLMEngine(LoRAEngineMixin):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        torch.manual_seed(config.seed)  # unseeded sampling draws from the default generator (as vLLM's seed=)
        speculative = SpeculativeConfig.parse(config.speculative_config)
        drafted = speculative is not None and speculative.method == "draft_model"
        # the tokenizer loads while the weights do (a draft model's check needs it first)
        pending, self.tokenizer = load_tokenizer_beside(config.model), None
        if drafted:
            self._take_tokenizer(pending)
            if why := tokenizer_mismatch(self.tokenizer, speculative.model):
                raise ConfigError(f"speculative_config.model {speculative.model}: {why}")
        self.vocab_size = int(config.hf_config["vocab_size"])
        self.group = None  # the other ranks (tensor / pipeline parallel), driven from here
        if config.world_size > 1:
            from kiln.engine.workers import RankGroup

            self.group = RankGroup(config)
        try:
            self.runner = ModelRunner(config, draft_block_bytes(config, speculative.model) if drafted else 0)
            # The draft model runs on this rank alone, over the target's block tables (spec_decode.draft_model).
            self.draft = DraftModel(config, speculative.model, self.runner.num_blocks, self.vocab_size) \
                if drafted else None
            self._take_tokenizer(pending)
        except BaseException:
            if self.group is not None:  # they may wait on a collective rank 0 never joins
                self.group.fail("rank 0 failed to load its shard")
                self.group.stop()
            raise
        if self.group is not None:
            self.group.start_heartbeat()
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.lora = LoRAManager(config.lora_config, config.hf_config, self._adapters_in_use) if config.enable_lora \
            else None
        self.scheduler = Scheduler(self.block_manager, config.max_batch_size, config.max_num_tokens,
                                   lora_slots=self.lora.slots if self.lora is not None else None)
        self.set_speculative(speculative)
        self._ids = itertools.count()
        self.num_steps = self.num_computed_tokens = self.num_generated_tokens = 0
        self.sum_running, self.sum_kv_usage = 0, 0.0
        self.batch_size_histogram: dict[int, int] = {}
        self.between_steps = hooks_for(config, self.runner)  # work between steps: the loop's one place for it

    def _take_tokenizer(self, pending: Future) -> None:
        if self.tokenizer is None:
            self.tokenizer = pending.result()  # its error, if it failed, raised here as load_tokenizer's own
            self.eos_token_ids = self.config.eos_token_ids(self.tokenizer)

    def set_speculative(self, speculative: SpeculativeConfig | dict | None) -> None:
        """Speculate with these settings from now on (None: off), counters fresh; a draft model must be
        the one this engine loaded (the build's tune stage times several ``k`` on one engine)."""
        speculative = SpeculativeConfig.parse(speculative)
        proposer = None
        if speculative is not None and speculative.method == "draft_model":
            if self.draft is None or Path(speculative.model) != Path(self.draft.model_dir):
                loaded = self.draft.model_dir if self.draft is not None else "none"
                raise ConfigError(f"speculative_config.model {speculative.model} is not the draft model this engine "
                                  f"loaded ({loaded}); load the engine with it")
            proposer = DraftModelProposer(speculative, self.draft)
        self.scheduler.set_speculative(speculative, proposer)

    # -- requests -------------------------------------------------------------------------
    def make_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                     request_id: str | None = None, lora_request: LoRARequest | None = None) -> Request:
        """Validate and build a request without queueing it; raises RequestError naming the input.
        ``lora_request``: the adapter it runs under (read from disk now unless already loaded)."""
        cfg = self.config
        if lora_request is not None and self.lora is None:
            raise lora_disabled()
        adapter = self.lora.resolve(lora_request) if lora_request is not None else None
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise RequestError("sampling_params", f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            text = prompt
            ids = self.tokenizer.encode(prompt) if prompt else []
        elif isinstance(prompt, list | tuple) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            text, ids = None, list(prompt)
        else:
            raise RequestError("prompt", "prompt must be a string or a list of token ids")
        # Ids the sampler indexes with: one out of range would fail the whole batch's step.
        self._check_token_ids("stop_token_ids", params.stop_token_ids)
        self._check_token_ids("logit_bias", list(params.logit_bias or ()))
        self._check_token_ids("allowed_token_ids", params.allowed_token_ids or [])
        check_prompt(ids, cfg.max_input_len, self.vocab_size)
        n = len(ids)
        max_tokens = resolve_max_tokens(params.max_tokens, n, cfg.max_seq_len)
        if max_tokens < params.min_tokens:
            raise RequestError("min_tokens", f"min_tokens ({params.min_tokens}) exceeds the {max_tokens} tokens "
                                             f"that fit max_seq_len ({cfg.max_seq_len})")
        # The last sampled token is never fed back, so the cache holds at most n + max_tokens - 1 tokens.
        blocks = self.block_manager.blocks_needed(n + max_tokens - 1)
        if blocks > self.block_manager.num_blocks:
            which = "prompt" if self.block_manager.blocks_needed(n) > self.block_manager.num_blocks else "max_tokens"
            raise RequestError(which, f"prompt ({n} tokens) + max_tokens ({max_tokens}) needs {blocks} KV blocks "
                                      f"but the KV pool has {self.block_manager.num_blocks} blocks of {cfg.block_size} tokens; "
                                      f"lower max_tokens or grow the pool (num_kv_blocks / kv_memory_fraction)")
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif request_id in self.requests:
            raise RequestError("request_id", f"request_id {request_id!r} is already in use")
        req = Request(request_id, text, ids, params, max_tokens, eos_token_ids=self.eos_token_ids, lora=adapter)
        req.detokenizer = make_detokenizer(self.tokenizer, ids, params)
        if params.structured_outputs is not None:  # compiled already when the server did it off this thread
            req.grammar = self.grammar_compiler.compile(params.structured_outputs).new_state()
        return req

    @functools.cached_property
    def grammar_compiler(self) -> Any:
        """Compiles structured-output constraints for this model's tokenizer (kiln.engine.structured)."""
        from kiln.engine.structured.compiler import GrammarCompiler

        return GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids, torch.get_num_threads())

    def _check_token_ids(self, param: str, ids: list[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(param, f"{param} holds token ids outside this model's vocabulary "
                                      f"[0, {self.vocab_size}): {bad[:3]}")

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise RequestError("request_id", f"request_id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    def abort(self, request_id: str) -> Request | None:
        """Finish a request with reason "abort" and free its blocks now; None if unknown/finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.finish(req, "abort")
        req.finished_time = time.time()
        req.abort_text = req.detokenizer.finish()
        return req

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[StepUpdate]:
        """One step, with the between-steps hooks around it (``between_steps``); a loop with nothing to run
        calls ``between_steps.idle()`` instead."""
        return self.between_steps.run(self._step)

    def _step(self) -> list[StepUpdate]:
        timer = self.runner.step_timer  # kiln bench --profile's phase timer (step_timer.py); None: not timed
        if timer is not None:
            timer.start()
        self.check_ranks()
        decision = self.scheduler.schedule()
        if not decision.scheduled:
            return []
        proposer = self.scheduler.proposer
        if proposer is not None and proposer.deferred:  # a draft model's tokens, now that their blocks exist
            proposer.fill([r for r, _ in decision.scheduled if r.spec_token_ids])
        self.num_steps += 1
        self.num_computed_tokens += decision.num_tokens
        batch = len(decision.scheduled)
        self.sum_running += batch
        self.batch_size_histogram[batch] = self.batch_size_histogram.get(batch, 0) + 1
        now = time.time()
        for req, _ in decision.scheduled:
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        if timer is not None:
            timer.lap("schedule")
        if self.group is None:
            sampled, out = self.runner.run(decision.scheduled, decision.lora_loads)
        else:
            with self.group.lock:  # the heartbeat must not interleave its broadcast with a step's
                try:
                    sampled, out = self.runner.run(decision.scheduled, decision.lora_loads)
                except Exception as exc:
                    self.group.fail(str(exc))
                    raise
                self.group.step_done()
        for req, n in decision.scheduled:
            # Drafts' K/V is written but not committed: only the last token counts until verified.
            req.num_computed_tokens += n - len(req.spec_token_ids)
            self.block_manager.cache_full_blocks(req)
        self.sum_kv_usage += self.kv_usage()
        if timer is not None:
            timer.lap("schedule")  # the block manager's bookkeeping
        updates = self._postprocess(sampled, out)
        if timer is not None:
            timer.lap("output")
        return updates

    def _postprocess(self, sampled: list[Request], out) -> list[StepUpdate]:
        if out is None:
            return []
        token_ids = out.token_ids.tolist()
        lp = top_ids = top_lp = None
        if out.logprobs is not None:
            lp, top_ids, top_lp = out.logprobs.tolist(), out.top_ids.tolist(), out.top_logprobs.tolist()
        now = time.time()
        updates = []
        i = 0
        while i < len(sampled):
            req = sampled[i]
            num_rows = 1 + len(req.spec_token_ids)  # a verified row's positions are consecutive
            rows = range(i, i + num_rows)
            i += num_rows
            queue_time = None
            if req.first_token_time is None:
                req.first_token_time = now
                queue_time = req.queue_time
            error = next((out.errors[r] for r in rows if r in out.errors), None)
            if error is None:
                try:
                    if num_rows > 1:
                        rows = self._verify(req, [token_ids[r] for r in rows], rows.start)
                    updates.append(self._advance(req, [token_ids[r] for r in rows], rows.start, lp, top_ids,
                                                 top_lp, now, queue_time))
                    continue
                except Exception as exc:  # this request's text or stop rules failed: it alone ends
                    log.exception("request %s failed after sampling; the rest of the batch goes on",
                                  req.request_id)
                    error = f"the request failed while decoding its output ({type(exc).__name__})"
            self._fail(req, error, now)
            updates.append(StepUpdate(req, [], "", None, True, queue_time, error=error))
        return updates

    def _verify(self, req: Request, targets: list[int], first_row: int) -> range:
        """The rows of a verified row whose tokens are committed: the accepted drafts' targets
        (equal to the drafts) and the one after them (``spec_decode.verify``)."""
        drafts = req.spec_token_ids
        accepted = num_accepted(drafts, targets)
        self.scheduler.proposer.record(req, len(drafts), accepted)
        rewind_generator(req, accepted + 1)
        return range(first_row, first_row + accepted + 1)

    def _advance(self, req: Request, toks: list[int], i: int, lp, top_ids, top_lp, now: float,
                 queue_time: float | None) -> StepUpdate:
        """Append sampled tokens (rows ``i``, ``i + 1``, ...) to ``req`` one at a time: logprobs, text,
        stop rules. Tokens after the first that finishes the request are dropped; a token after the
        first was a verified draft, whose K/V this step computed (it becomes committed here)."""
        text_delta, step_lp, reason, taken = "", [], None, []
        for j, tok in enumerate(toks):
            if j:
                req.num_computed_tokens += 1
            req.token_ids.append(tok)
            taken.append(tok)
            self.num_generated_tokens += 1
            if req.grammar is not None and not req.grammar.accept([tok]):
                raise RuntimeError(f"the grammar refused token {tok}: {req.grammar.error}")
            if req.logprobs is not None and lp is not None:
                k = req.params.logprobs or 0
                entry = dict(zip(top_ids[i + j][:k], top_lp[i + j][:k], strict=True))
                entry[tok] = lp[i + j]
                req.logprobs.append(entry)
                step_lp.append(entry)
            det = req.detokenizer.append([tok])
            text_delta += det.text_delta
            # A complete grammar allows nothing more: the output is done whatever the other rules say.
            grammar_done = req.grammar is not None and req.grammar.is_terminated
            reason = "stop" if grammar_done else stop_reason(req, tok, det.stop_string_hit)
            if reason is not None:
                break
        if req.spec_token_ids:  # the accepted drafts' full blocks are hashable (before a finish frees them)
            self.block_manager.cache_full_blocks(req)
        if reason is not None:
            text_delta += req.detokenizer.finish()  # held-back text: a partial character or stop prefix
            self.scheduler.finish(req, reason)
            self.requests.pop(req.request_id, None)
            req.finished_time = now
        elif req.spec_token_ids:  # the rejected drafts' blocks go back
            self.block_manager.trim(req)
        return StepUpdate(req, taken, text_delta, step_lp or None, reason is not None, queue_time)

    def _fail(self, req: Request, error: str, now: float) -> None:
        """Finish one request with reason "error" and free its blocks; the engine goes on."""
        self.scheduler.finish(req, "error")
        self.requests.pop(req.request_id, None)
        req.finished_time = now
        req.error = error

    def check_ranks(self) -> None:
        """Raise if a rank of a parallel engine is gone (it exited, or missed a heartbeat or a step)."""
        if self.group is not None:
            self.group.check()

    # -- introspection --------------------------------------------------------------------
    def kv_usage(self) -> float:
        bm = self.block_manager  # every block with a reference is off the free queue
        return 1.0 - bm.num_free_blocks / bm.num_blocks

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_usage=self.kv_usage(), num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_blocks,
            prefix_cache_queries=bm.prefix_cache_queries, prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions, num_steps=self.num_steps,
            num_computed_tokens=self.num_computed_tokens, num_generated_tokens=self.num_generated_tokens,
            sum_running=self.sum_running, sum_kv_usage=self.sum_kv_usage,
            batch_size_histogram=dict(self.batch_size_histogram),  # a copy: the step loop keeps counting
            block_size=bm.block_size, **speculation_stats(self.scheduler),
        )

    def shutdown(self) -> None:
        self.runner.let_go()
        if self.group is not None:
            self.group.stop()
            self.group = None
        shelve(self.config.model, self.tokenizer)  # for this model's next engine (a pool's reload)
