"""The deterministic benchmark workload: prompts, per-request output lengths, arrival times.

Every system runs exactly this list, so the comparison is on matched work:
each request decodes exactly ``output_len`` tokens (EOS is ignored everywhere),
and only those tokens count as output, whatever padding a baseline adds.
Prompts are random token ids from the model's vocabulary (special ids
excluded), so no tokenizer round trip can change a prompt's length.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate; the same spec and vocabulary always give the same workload."""

    num_requests: int = 64
    seed: int = 0
    prompt_len_min: int = 32
    prompt_len_max: int = 256
    short_output: tuple[int, int] = (16, 64)  # 80% of requests ...
    long_output: tuple[int, int] = (128, 256)  # ... and the long tail: 20%
    long_fraction: float = 0.2
    arrival_rate: float | None = None  # requests/s (Poisson); None = all arrive at t=0
    shared_prefix_len: int = 0  # tokens every prompt starts with (prefix-cache variant)

    def check(self) -> None:
        """Raise ValueError naming the option for a spec that cannot make a workload."""
        if self.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {self.num_requests}")
        if not 1 <= self.prompt_len_min <= self.prompt_len_max:
            raise ValueError(f"prompt lengths must satisfy 1 <= min <= max, got {self.prompt_len_min}..{self.prompt_len_max}")
        for name, (lo, hi) in (("short output", self.short_output), ("long output", self.long_output)):
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} lengths must satisfy 1 <= min <= max, got {lo}..{hi}")
        if self.arrival_rate is not None and self.arrival_rate <= 0:
            raise ValueError(f"--arrival-rate must be > 0 requests/s, got {self.arrival_rate}")
        if self.shared_prefix_len < 0:
            raise ValueError(f"--shared-prefix must be >= 0 tokens, got {self.shared_prefix_len}")


@dataclass
class Request:
    index: int
    prompt_token_ids: list[int]
    output_len: int
    arrival_time: float  # seconds after the start of the run


@dataclass
class Workload:
    spec: WorkloadSpec
    requests: list[Request] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    @property
    def max_seq_len(self) -> int:
        return max(len(r.prompt_token_ids) + r.output_len for r in self.requests)

    def summary(self) -> dict:
        prompt_lens = [len(r.prompt_token_ids) for r in self.requests]
        output_lens = [r.output_len for r in self.requests]
        return {
            "num_requests": len(self.requests),
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "prompt_len_min": min(prompt_lens),
            "prompt_len_max": max(prompt_lens),
            "output_len_min": min(output_lens),
            "output_len_max": max(output_lens),
            "num_long_outputs": sum(n >= self.spec.long_output[0] for n in output_lens),
            "arrival": "t=0" if self.spec.arrival_rate is None else f"poisson {self.spec.arrival_rate}/s",
            "shared_prefix_len": self.spec.shared_prefix_len,
        }

    def to_json(self) -> dict:
        return {"spec": asdict(self.spec), "requests": [asdict(r) for r in self.requests]}

    @classmethod
    def from_json(cls, data: dict) -> Workload:
        spec_fields = dict(data["spec"])
        spec_fields["short_output"] = tuple(spec_fields["short_output"])
        spec_fields["long_output"] = tuple(spec_fields["long_output"])
        return cls(WorkloadSpec(**spec_fields), [Request(**r) for r in data["requests"]])

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: Path) -> Workload:
        return cls.from_json(json.loads(path.read_text()))


def make_workload(spec: WorkloadSpec, vocab_size: int, special_ids: set[int]) -> Workload:
    """Draw prompts, output lengths and arrivals from one seeded RNG.

    With ``shared_prefix_len`` every prompt is that many shared tokens followed
    by its own drawn length of unique tokens, so the prefix-cache variant does
    the same unique work plus the shared prefix.
    """
    spec.check()
    rng = random.Random(spec.seed)
    allowed = [t for t in range(vocab_size) if t not in special_ids]
    if not allowed:
        raise ValueError("the model's vocabulary has no non-special token ids to build prompts from")
    prefix = [rng.choice(allowed) for _ in range(spec.shared_prefix_len)]
    # Exactly round(fraction * n) long requests at random positions: the tail's
    # share must not drift with the seed, or runs with different seeds differ in work.
    long_ids = set(rng.sample(range(spec.num_requests), round(spec.long_fraction * spec.num_requests)))
    clock = 0.0
    requests = []
    for i in range(spec.num_requests):
        prompt_len = rng.randint(spec.prompt_len_min, spec.prompt_len_max)
        lo, hi = spec.long_output if i in long_ids else spec.short_output
        output_len = rng.randint(lo, hi)
        if spec.arrival_rate is not None and i > 0:
            clock += rng.expovariate(spec.arrival_rate)
        prompt = prefix + [rng.choice(allowed) for _ in range(prompt_len)]
        requests.append(Request(i, prompt, output_len, clock))
    return Workload(spec, requests)
