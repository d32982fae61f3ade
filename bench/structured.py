"""``kiln bench --structured``: what constrained decoding costs in throughput.

One engine, one batch of ``batch`` requests arriving at once, run twice per repeat in
alternating order (ABBA, so drift in a shared machine's speed cancels): every request free,
and the same batch with half of its requests constrained to a JSON Schema. Every request
samples (temperature 1, own seed) exactly ``max_tokens`` tokens: free ones ignore EOS, and the
schema (an array of at least 1000 records mixing bounded strings, an email format, numbers,
booleans and enums) cannot complete sooner, so both runs do the same work and differ only by
the grammar masks. Throughput is output tokens per second; the table shows medians.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": {"type": "string", "maxLength": 12},
        "email": {"type": "string", "format": "email"},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "maxItems": 3},
    },
    "required": ["id", "name", "email", "active", "score", "tags"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": RECORD, "minItems": 1000}


def run(model_dir: Path, dtype: str, threads: int, device: str, batch: int = 32, max_tokens: int = 128,
        prompt_len: int = 32, repeats: int = 3, log: Callable[[str], None] = print) -> dict[str, Any]:
    import torch
    from kiln.engine import LLM, SamplingParams
    from kiln.engine.structured.params import StructuredOutputsParams

    torch.set_num_threads(threads)
    llm = LLM(str(model_dir), dtype=dtype, device=device, max_batch_size=batch, max_num_tokens=2048,
              max_seq_len=prompt_len + max_tokens + 8, max_input_len=prompt_len)
    vocab = llm.engine.vocab_size
    special = set(llm.engine.eos_token_ids) | set(getattr(llm.engine.tokenizer, "all_special_ids", []))
    rng = random.Random(0)
    prompts = [[t for t in (rng.randrange(vocab) for _ in range(prompt_len * 2)) if t not in special][:prompt_len]
               for _ in range(batch)]
    constraint = StructuredOutputsParams(json=SCHEMA, param="bench")

    def params(i: int, constrained: bool) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True,
                              structured_outputs=constraint if constrained else None)

    batches = {"free": [params(i, False) for i in range(batch)],
               "half constrained": [params(i, i % 2 == 0) for i in range(batch)]}

    def timed(name: str) -> float:
        started = time.perf_counter()
        outs = llm.generate(prompts, batches[name])
        elapsed = time.perf_counter() - started
        tokens = sum(len(o.token_ids) for o in outs)
        assert tokens == batch * max_tokens, f"{name}: {tokens} tokens, expected {batch * max_tokens}"
        return tokens / elapsed

    log(f"structured: warm-up (compiles the schema, builds the grammar's view of a {vocab}-token vocabulary)")
    timed("half constrained")
    runs: dict[str, list[float]] = {name: [] for name in batches}
    for r in range(repeats):
        for name in (list(batches) if r % 2 == 0 else list(reversed(batches))):
            runs[name].append(timed(name))
            log(f"structured: repeat {r + 1}/{repeats} {name}: {runs[name][-1]:.1f} tok/s")
    llm.shutdown()
    medians = {name: statistics.median(values) for name, values in runs.items()}
    return {"batch": batch, "max_tokens": max_tokens, "prompt_len": prompt_len, "repeats": repeats,
            "threads": threads, "device": device, "dtype": dtype, "model_dir": str(model_dir), "runs": runs,
            "median_tok_s": medians,
            "constrained_cost_pct": 100.0 * (1 - medians["half constrained"] / medians["free"])}


def text(doc: dict[str, Any]) -> str:
    m = doc["median_tok_s"]
    lines = [f"constrained decoding, batch {doc['batch']} x {doc['max_tokens']} tokens ({doc['device']}, "
             f"{doc['dtype']}, {doc['threads']} threads, medians of {doc['repeats']} interleaved runs)",
             f"  {'batch':<22}{'output tok/s':>14}",
             f"  {'all free':<22}{m['free']:>14.1f}",
             f"  {'half JSON-schema':<22}{m['half constrained']:>14.1f}",
             f"  cost of the constraints: {doc['constrained_cost_pct']:.1f}% of throughput"]
    return "\n".join(lines)
