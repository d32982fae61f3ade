"""A request's state: its tokens, how many of them are in the KV cache, and its blocks.

Progress is two counters, not a phase: ``num_computed_tokens`` (tokens whose
K/V are in the cache, prefix-cache hits included) against ``num_tokens``
(prompt + generated). A prefill chunk, a prefix hit and a preemption are all
just moves of ``num_computed_tokens``; a request whose counters differ by one
is decoding. Speculative drafts (``spec_token_ids``) are never in ``token_ids``:
a step computes them after the last token and commits only those it accepts.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from kiln.engine.prefix_hash import root_key
from kiln.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int                      # resolved: params.max_tokens or what fits max_seq_len
    eos_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)   # prompt + output
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0           # prefix-cache hits at first admission
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0           # leading full blocks registered in the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    detokenizer: Any = None
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # params.prompt_logprobs: one per prompt token
    prompt_ranks: list[int | None] | None = None  # each prompt token's rank at its position (1: the most likely)
    arrival_time: float = field(default_factory=time.time)
    first_scheduled_time: float | None = None  # first step that computed any of its tokens
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    abort_text: str = ""                 # text the detokenizer still held when the request was aborted
    error: str | None = None             # why it finished with reason "error" (it failed alone)
    stop_token_set: frozenset[int] = frozenset()  # params.stop_token_ids, for a per-token lookup
    grammar: Any = None                  # structured.state.GrammarState when params.structured_outputs is set
    spec_token_ids: list[int] = field(default_factory=list)  # this step's draft tokens (spec_decode), not committed
    spec_state: Any = None               # spec_decode.proposer.RequestSpecState: its n-gram index, acceptance
    spec_generator_state: Any = None     # the seeded generator's state before this step's drafts drew
    lora: Any = None                     # lora.adapter.LoRAAdapter it runs under (None: the base model)
    lora_slot: int | None = None         # the device slot its adapter holds while it runs (lora.slots)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.params.seed)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs, self.prompt_ranks = [None], [None]  # the first token has nothing before it
        self.stop_token_set = frozenset(self.params.stop_token_ids)

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival to the first time the request was scheduled (a preemption does not reset it)."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def prefix_root(self) -> bytes:
        """The root of its prefix-cache key chain: its adapter version's own (by content digest) and its
        ``cache_salt``'s, so no prefix is shared across adapters, versions of one, or salts."""
        return root_key(None if self.lora is None else self.lora.digest, self.params.cache_salt)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all made yet (prompt_logprobs.py)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
