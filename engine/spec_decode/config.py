"""``speculative_config``: the engine's speculative-decoding settings, named as vLLM names them."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kiln.engine.errors import ConfigError

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method``: "ngram" (prompt lookup, no draft model) or "draft_model" (a smaller model of the same
    tokenizer proposes its greedy continuation: ``model``, a checkpoint directory, or an artifact's
    ``draft`` folder with its engine weights; ``spec_decode.draft_model``). ``num_speculative_tokens``: the most draft
    tokens per request per step (k). ``prompt_lookup_max``/``prompt_lookup_min``: the longest and
    shortest suffix n-gram looked up. ``disable_by_batch_size``: speculate only while the running
    batch holds at most this many requests (None: always). ``by_batch``: the draft length per running
    batch bucket, ``{1: 4, 2: 4, 4: 2, 8: 0}`` (0: off), as the build's tune stage measured it: a batch of
    ``n`` uses the smallest bucket >= ``n``, a batch above every bucket the largest one (None: k at every
    size). ``min_acceptance_rate``: a request whose drafts are accepted less often than this (over its
    last drafts) proposes fewer tokens, down to 1."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    disable_by_batch_size: int | None = None
    min_acceptance_rate: float = 0.3
    by_batch: dict[int, int] | None = None
    model: str | None = None

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """A ``SpeculativeConfig`` from one, a dict of its fields, or None (off); ConfigError naming the field."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                              f"'num_speculative_tokens': 4}} or None, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative_config.{unknown[0]} is not a setting; use {', '.join(sorted(known))}")
        return cls(**value)

    def __post_init__(self) -> None:
        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        checks = [
            ("method", self.method in METHODS, f"must be one of {', '.join(METHODS)}"),
            ("model", (self.model is not None) == (self.method == "draft_model"),
             "must name the draft model's directory with method 'draft_model', and only then"),
            ("num_speculative_tokens", is_int(self.num_speculative_tokens) and 1 <= self.num_speculative_tokens <= 16,
             "must be an integer in [1, 16]"),
            ("prompt_lookup_min", is_int(self.prompt_lookup_min) and self.prompt_lookup_min >= 1,
             "must be an integer >= 1"),
            ("prompt_lookup_max", is_int(self.prompt_lookup_max) and self.prompt_lookup_min <= self.prompt_lookup_max
             <= 8, f"must be an integer in [prompt_lookup_min ({self.prompt_lookup_min}), 8]"),
            ("disable_by_batch_size", self.disable_by_batch_size is None or
             (is_int(self.disable_by_batch_size) and self.disable_by_batch_size >= 1),
             "must be None (always speculate) or an integer >= 1"),
            ("min_acceptance_rate", isinstance(self.min_acceptance_rate, int | float)
             and 0.0 <= self.min_acceptance_rate <= 1.0, "must be in [0, 1]"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ConfigError(f"speculative_config.{name} {rule}, got {getattr(self, name)!r}")
        if self.model is not None and not (Path(self.model) / "config.json").is_file():
            raise ConfigError(f"speculative_config.model {self.model!r} is not a model directory (no config.json); "
                              f"name a checkpoint directory of the draft model")
        if self.by_batch is not None:
            object.__setattr__(self, "by_batch", self._parse_by_batch(self.by_batch))

    def _parse_by_batch(self, table: Any) -> dict[int, int]:
        """``{"1": 4, "8": 0}`` (JSON keys are strings) -> ``{1: 4, 8: 0}``, sorted; ConfigError naming the entry."""
        rule = (f"must be a map of batch size (>= 1) to draft length (0 = off .. num_speculative_tokens = "
                f"{self.num_speculative_tokens}), e.g. {{'1': 4, '8': 0}}")
        if not isinstance(table, dict) or not table:
            raise ConfigError(f"speculative_config.by_batch {rule}, got {table!r}")
        out = {}
        for key, k in table.items():
            try:
                batch = int(key)
            except (TypeError, ValueError):
                batch = 0
            ok = (batch >= 1 and isinstance(k, int) and not isinstance(k, bool)
                  and 0 <= k <= self.num_speculative_tokens)
            if not ok:
                raise ConfigError(f"speculative_config.by_batch[{key!r}] {rule}, got {k!r}")
            out[batch] = k
        return dict(sorted(out.items()))

    def k_for_batch(self, num_running: int) -> int:
        """The draft length for a step with ``num_running`` running requests (0: no drafts this step)."""
        if self.disable_by_batch_size is not None and num_running > self.disable_by_batch_size:
            return 0
        if self.by_batch is None:
            return self.num_speculative_tokens
        bucket = next((b for b in self.by_batch if b >= num_running), max(self.by_batch))
        return self.by_batch[bucket]
