"""What the engine hands back: finished outputs, streamed deltas, and engine statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.engine.sequence import Request


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    queue_time: float | None = None  # seconds from arrival to the first time the request was scheduled


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" (this request failed alone: see error)
    logprobs: list[dict[int, float]] | None
    num_cached_tokens: int
    metrics: RequestMetrics
    error: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # params.prompt_logprobs: one per prompt token
    prompt_ranks: list[int | None] | None = None  # each prompt token's rank (1: the most likely), None first


@dataclass
class StreamDelta:
    request_id: str
    new_token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    queue_time: float | None = None  # on a request's first delta only: arrival to first scheduled, seconds
    prompt_logprobs: list[dict[int, float] | None] | None = None  # on the first delta only (prompt_logprobs.py)
    prompt_ranks: list[int | None] | None = None  # with them


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float            # fraction of blocks held by requests (cached-but-free blocks count as free)
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up at first admission
    prefix_cache_hits: int     # of those, found in the cache
    num_preemptions: int
    num_steps: int             # forward passes run
    num_computed_tokens: int   # tokens run through the model (prefill + decode, recomputation included)
    num_generated_tokens: int
    sum_running: int           # sum over steps of the batch size, for avg_batch_size
    sum_kv_usage: float        # sum over steps of kv_usage, for avg_kv_usage
    batch_size_histogram: dict[int, int] = field(default_factory=dict)  # running batch size -> steps run with it
    block_size: int = 0        # tokens per KV block (the prefix-cache hashing unit)
    # Speculative decoding (spec_decode): None when off, else k and the counters of proposed/accepted drafts.
    num_speculative_tokens: int | None = None
    spec_num_drafts: int = 0           # verified rows (a decode with at least one draft)
    spec_num_draft_tokens: int = 0     # drafts proposed and verified
    spec_num_accepted_tokens: int = 0  # of those, accepted
    spec_accepted_per_position: list[int] = field(default_factory=list)  # accepted drafts at position 0, 1, ...
    spec_steps_off_by_batch: int = 0   # steps not speculating: by_batch or disable_by_batch_size said off

    @property
    def avg_batch_size(self) -> float:
        return self.sum_running / self.num_steps if self.num_steps else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def avg_kv_usage(self) -> float:
        return self.sum_kv_usage / self.num_steps if self.num_steps else 0.0


@dataclass
class StepUpdate:
    """What one step did to one request: the tokens it gained and whether it finished."""

    request: Request
    new_token_ids: list[int]
    text_delta: str
    logprobs: list[dict[int, float]] | None
    finished: bool
    queue_time: float | None = None  # set on the request's first update only (see StreamDelta.queue_time)
    error: str | None = None  # set when this request failed alone (finish reason "error"); the batch went on
