"""Time the staged engine through the runtime: prefill latency, decode step latency and tokens/s.

The ``tune``, ``tactics`` and ``compile`` stages compare settings with :func:`measure` (greedy,
``ignore_eos``, random prompts from a fixed seed) and :func:`total_ms`, its one number.
"""

from __future__ import annotations

import random
import time
from typing import Any

from kiln.engine import SamplingParams

PREFILL_TOKENS = 128
DECODE_TOKENS = 8
PROMPT_TOKENS_PER_SEQ = 16


def _time_generate(llm, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - t0


def measure(llm, spec, vocab_size: int) -> dict[str, Any]:
    """Prefill latency and decode step latency / tokens/s at a few batch sizes (greedy, ignore_eos)."""
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(n)]

    prefill_len = min(PREFILL_TOKENS, spec.max_input_len, spec.max_num_tokens)
    prompt_len = max(1, min(PROMPT_TOKENS_PER_SEQ, spec.max_input_len, spec.max_seq_len - DECODE_TOKENS - 1))
    _time_generate(llm, [prompt(prompt_len)], 2)  # warm-up
    prefill = _time_generate(llm, [prompt(prefill_len)], 1)
    rows = []
    batch_sizes = sorted({1, min(4, spec.max_batch_size), min(8, spec.max_batch_size)})
    for b in batch_sizes:
        prompts = [prompt(prompt_len) for _ in range(b)]
        first = _time_generate(llm, prompts, 1)
        total = _time_generate(llm, [prompt(prompt_len) for _ in range(b)], DECODE_TOKENS + 1)
        step = max(total - first, 1e-6) / DECODE_TOKENS
        rows.append({"batch_size": b, "decode_step_ms": round(step * 1e3, 3),
                     "decode_tokens_per_s": round(b / step, 1)})
    return {"prefill_tokens": prefill_len, "prefill_ms": round(prefill * 1e3, 3),
            "prefill_tokens_per_s": round(prefill_len / prefill, 1), "decode": rows}


def total_ms(m: dict[str, Any]) -> float:
    """One number of a :func:`measure`: prefill plus the measured decode steps, in ms."""
    return m["prefill_ms"] + sum(row["decode_step_ms"] for row in m["decode"])
