"""Per-request sampling and stopping parameters, shaped like vLLM's ``SamplingParams``.

Every field is checked here, when the object is built, against limits that keep a
request's per-token cost on the engine thread bounded whatever a client sends (the
limits below are the one home of each rule: the HTTP server imports them). Token ids
are checked against the model's vocabulary by ``LLMEngine.make_request``, which knows it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kiln.engine.structured.params import StructuredOutputsParams

# Temperatures below this are greedy, as in vLLM: dividing by them overflows float32.
SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
MAX_STOP_STRINGS = 16  # OpenAI allows 4; vLLM no limit. Each is searched in every new token's text.
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024  # entries; OpenAI documents no count, only the value range
MAX_CACHE_SALT_CHARS = 256
LOGIT_BIAS_RANGE = 100.0  # OpenAI: values in [-100, 100]
# torch.Generator.manual_seed takes exactly this range.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature == 0`` is greedy (below ``SAMPLING_EPS``, as in vLLM). ``top_k == 0``
    and ``top_p == 1`` disable those filters. ``logprobs=None`` returns no logprobs;
    ``logprobs=k`` returns the sampled token's logprob plus the ``k`` most likely
    alternatives (k may be 0). ``seed`` makes a request's sampling reproducible whatever
    else is in the batch. ``logit_bias`` adds a value in [-100, 100] to a token's logit
    (OpenAI's rule); ``allowed_token_ids`` restricts sampling to those ids (vLLM's).
    ``structured_outputs`` constrains the output to a JSON Schema, any JSON object, a regex,
    one of some strings or a grammar (``kiln.engine.structured``; the engine compiles it).
    ``cache_salt`` (vLLM's request field) salts the request's prefix-cache root: only requests with
    the same salt share cached blocks (``prefix_hash.root_key``).
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
    prompt_logprobs: int | None = None  # each prompt token's logprob and the k most likely there (prompt_logprobs.py)
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise ValueError(f"logit_bias must map token ids to biases, got {type(self.logit_bias).__name__}")
            self.logit_bias = dict(self.logit_bias) or None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        for name, rule in self._violations():
            raise ValueError(f"{name} {rule}, got {_shown(getattr(self, name))}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.top_k == -1:
            self.top_k = 0

    def _violations(self) -> list[tuple[str, str]]:
        """(field, rule) for every field that breaks its rule; checked in this order."""
        def ranged(value: object, low: float, high: float) -> bool:
            return _finite(value) and low <= value <= high  # type: ignore[operator]

        bias = self.logit_bias or {}
        checks = [
            ("temperature", _finite(self.temperature) and self.temperature >= 0, "must be a finite number >= 0 "
                                                                                 "(0 means greedy)"),
            ("top_p", _finite(self.top_p) and 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", _is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1),
             "must be an integer >= 0 (0 or -1 disables it)"),
            ("min_p", ranged(self.min_p, 0, 1), "must be in [0, 1]"),
            ("seed", self.seed is None or (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX),
             f"must be an integer in [{SEED_MIN}, {SEED_MAX}]"),
            ("presence_penalty", ranged(self.presence_penalty, -2, 2), "must be in [-2, 2]"),
            ("frequency_penalty", ranged(self.frequency_penalty, -2, 2), "must be in [-2, 2]"),
            ("repetition_penalty", _finite(self.repetition_penalty) and self.repetition_penalty > 0,
             "must be a finite number > 0 (1 disables it)"),
            ("max_tokens", self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
             "must be an integer >= 1"),
            ("min_tokens", _is_int(self.min_tokens) and self.min_tokens >= 0, "must be an integer >= 0"),
            ("logprobs", self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"must be between 0 and {MAX_LOGPROBS}"),
            ("prompt_logprobs", self.prompt_logprobs is None
             or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
             f"must be between 0 and {MAX_LOGPROBS}"),
            ("stop", len(self.stop) <= MAX_STOP_STRINGS, f"may hold at most {MAX_STOP_STRINGS} strings"),
            ("stop", all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
             f"must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters"),
            ("stop_token_ids", len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
             f"may hold at most {MAX_STOP_TOKEN_IDS} ids"),
            ("stop_token_ids", all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
             "must be non-negative integer token ids"),
            ("logit_bias", len(bias) <= MAX_LOGIT_BIAS, f"may hold at most {MAX_LOGIT_BIAS} entries"),
            ("logit_bias", all(_is_int(t) and t >= 0 for t in bias), "keys must be non-negative integer token ids"),
            ("logit_bias", all(ranged(v, -LOGIT_BIAS_RANGE, LOGIT_BIAS_RANGE) for v in bias.values()),
             f"values must be numbers in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]"),
            ("structured_outputs", self.structured_outputs is None
             or isinstance(self.structured_outputs, StructuredOutputsParams),
             "must be a kiln.engine.structured.StructuredOutputsParams"),
            ("cache_salt", self.cache_salt is None or (isinstance(self.cache_salt, str)
                                                        and 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS),
             f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters"),
            ("allowed_token_ids", self.allowed_token_ids is None or (
                len(self.allowed_token_ids) > 0 and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)),
             "must be a non-empty list of non-negative integer token ids"),
        ]
        return [(name, rule) for name, ok, rule in checks if not ok]

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @functools.cached_property
    def allowed_ids_tensor(self) -> Any:
        """``allowed_token_ids`` as a CPU LongTensor, built once per params (not every step)."""
        import torch

        return torch.tensor(self.allowed_token_ids or [], dtype=torch.long)

    @functools.cached_property
    def logit_bias_tensors(self) -> tuple[Any, Any]:
        """``logit_bias`` as (ids LongTensor, float32 values), built once per params."""
        import torch

        bias = self.logit_bias or {}
        return (torch.tensor(list(bias), dtype=torch.long),
                torch.tensor(list(bias.values()), dtype=torch.float32))


def _shown(value: object) -> str:
    """A value for an error message, cut short: clients may send megabytes."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
