"""What one system run measures, and the figures derived from it.

Each system (kiln or a baseline) fills one ``RunRecord``: per-request
timestamps on ``time.perf_counter`` relative to the run's start, the tokens it
produced, and how many forward steps it took. The figures are then computed
the same way for every system, so a difference in a figure is a difference in
the system, not in the bookkeeping:

- output tokens are each request's own ``output_len`` (padding and the extra
  steps a static batch runs for its longest member never count);
- TTFT = first token time - arrival; E2E = time the caller has the whole
  output - arrival (for a static batch: when ``generate`` returns);
- average batch = output tokens / forward steps, i.e. the mean number of
  requests that got a token per step (a step that only runs a prefill chunk
  counts as a step with none).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field


@dataclass
class RequestRecord:
    index: int
    arrival: float
    first_token: float
    finished: float
    output_token_ids: list[int]


@dataclass
class RunRecord:
    system: str
    duration_s: float  # first arrival to last finish
    num_steps: int  # forward passes in the timed run (0 = not observable)
    requests: list[RequestRecord] = field(default_factory=list)
    peak_rss_bytes: int = 0
    load_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> RunRecord:
        data = dict(data)
        data["requests"] = [RequestRecord(**r) for r in data["requests"]]
        return cls(**data)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), without numpy."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def figures(run: RunRecord, prompt_lens: dict[int, int], output_lens: dict[int, int]) -> dict:
    """The table's figures for one run; ``*_lens`` map request index to the workload's lengths."""
    for r in run.requests:
        if len(r.output_token_ids) != output_lens[r.index]:
            raise RuntimeError(
                f"{run.system}: request {r.index} produced {len(r.output_token_ids)} tokens, "
                f"expected exactly {output_lens[r.index]} (EOS must be ignored)"
            )
    out_tokens = sum(output_lens[r.index] for r in run.requests)
    prompt_tokens = sum(prompt_lens[r.index] for r in run.requests)
    ttft = [r.first_token - r.arrival for r in run.requests]
    e2e = [r.finished - r.arrival for r in run.requests]
    return {
        "duration_s": run.duration_s,
        "output_tok_s": out_tokens / run.duration_s,
        "total_tok_s": (out_tokens + prompt_tokens) / run.duration_s,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p99_s": percentile(e2e, 99),
        "peak_rss_mib": run.peak_rss_bytes / 2**20,
        "avg_batch": out_tokens / run.num_steps if run.num_steps else float("nan"),
        "num_steps": run.num_steps,
        "output_tokens": out_tokens,
        "prompt_tokens": prompt_tokens,
    }


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def median_figures(runs: list[dict]) -> dict:
    """Per-figure median over repeats (each figure separately, as benchmark reports do)."""
    keys = runs[0].keys()
    return {k: statistics.median(run[k] for run in runs) for k in keys}
