"""Per-request sampling and stopping parameters, shaped like vLLM's ``SamplingParams``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature == 0`` is greedy. ``top_k == 0`` and ``top_p == 1`` disable those
    filters. ``logprobs=None`` returns no logprobs; ``logprobs=k`` returns the
    sampled token's logprob plus the ``k`` most likely alternatives (k may be 0).
    ``seed`` makes a request's sampling reproducible whatever else is in the batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        checks = [
            ("temperature", self.temperature >= 0, "must be >= 0 (0 means greedy)"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0 or self.top_k == -1, "must be >= 0 (0 or -1 disables it)"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("repetition_penalty", self.repetition_penalty > 0, "must be > 0 (1 disables it)"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be >= 1"),
            ("min_tokens", self.min_tokens >= 0, "must be >= 0"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be between 0 and 20"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"{name} {rule}, got {getattr(self, name)!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.top_k == -1:
            self.top_k = 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
