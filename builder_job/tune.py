"""Plan the KV pool for the target device and measure runtime knobs on the build machine.

KV plan. A serving pod preallocates one pool of ``num_kv_blocks`` blocks. The
builder sizes it once, for the target:

    budget      = device memory x kv.memoryFraction
    num_kv_blocks = (budget - weights of the largest rank - activation reserve) // bytes per block

where a block holds ``blockSize`` tokens of K and V for every layer and the KV
heads of one rank. On a GPU the pool takes all of that (spare blocks keep
prefixes cached). For ``gpu: cpu`` the device memory is a documented budget —
:data:`kiln.builder.check.CPU_MEMORY_BUDGET_GIB` GiB, or ``$KILN_CPU_MEMORY_GIB`` — and the pool is
capped at what ``maxBatchSize`` requests of ``maxSeqLen`` can ever hold, because
host RAM is shared with everything else on the machine.

Tuning. Only knobs that do not change the envelope (block size, shapes and
dtypes are in it) are chosen here, by timing the real artifact through the
runtime: on CPU the torch thread count, with prefill and decode-step latency and
tokens/s at a few batch sizes recorded; on GPU the CUDA-graph decode batch
buckets, eager vs graphs, recorded the same way. Every number measured is kept
in ``engine.json`` under ``tuning``. CUDA-graph buckets go into ``engine_config``
(an ``LLM`` argument); the thread count is a hint the runtime uses at load on the same CPU type
(``tuning.cpu`` records the model, flags, CPU count and native bf16/fp16 measurement), see
``kiln.engine.cpu_target``.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

from kiln.builder.check import (
    ModelFacts,
    activation_reserve_bytes,
    device_memory_bytes,
    kv_bytes_per_token,
    kv_dtype_name,
)
from kiln.builder.errors import InvalidSpec

log = logging.getLogger("kiln.build.tune")

PREFILL_TOKENS = 128
DECODE_TOKENS = 8
PROMPT_TOKENS_PER_SEQ = 16


def plan_kv(spec, facts: ModelFacts, weight_bytes_per_rank: int) -> dict[str, Any]:
    """The KV pool for the target; :class:`InvalidSpec` if not even one ``maxSeqLen`` request fits."""
    total = device_memory_bytes(spec)
    budget = int(total * spec.kv.memory_fraction)
    activations = activation_reserve_bytes(facts, spec)
    per_token = kv_bytes_per_token(facts, spec)
    block_bytes = per_token * spec.kv.block_size
    free = budget - weight_bytes_per_rank - activations
    num_blocks = max(0, free // block_bytes)
    blocks_per_seq = math.ceil(spec.max_seq_len / spec.kv.block_size)
    useful = spec.max_batch_size * blocks_per_seq
    capped = False
    if spec.gpu_spec.is_cpu and num_blocks > useful:
        num_blocks, capped = useful, True
    if num_blocks < blocks_per_seq:
        raise InvalidSpec(
            f"spec.gpu: after {weight_bytes_per_rank / 2**30:.2f} GiB of weights per rank the KV pool on {spec.gpu} "
            f"has {num_blocks} blocks, fewer than one maxSeqLen ({spec.max_seq_len}) request needs "
            f"({blocks_per_seq}); lower maxSeqLen, raise kv.memoryFraction or use a larger GPU"
        )
    return {
        "device_memory_bytes": total,
        "memory_fraction": spec.kv.memory_fraction,
        "budget_bytes": budget,
        "weight_bytes_per_rank": weight_bytes_per_rank,
        "activation_reserve_bytes": activations,
        "kv_dtype": kv_dtype_name(spec),
        "kv_bytes_per_token": per_token,
        "block_size": spec.kv.block_size,
        "block_bytes": block_bytes,
        "num_kv_blocks": int(num_blocks),
        "kv_pool_bytes": int(num_blocks * block_bytes),
        "max_tokens_in_pool": int(num_blocks * spec.kv.block_size),
        "full_length_requests": int(num_blocks // blocks_per_seq),
        "capped_at_max_batch": capped,
    }


def kv_plan_summary(plan: dict[str, Any]) -> str:
    return (f"{plan['num_kv_blocks']} blocks x {plan['block_size']} tokens ({plan['kv_pool_bytes'] / 2**20:.1f} MiB "
            f"{plan['kv_dtype']}), {plan['full_length_requests']} full-length requests")



def _time_generate(llm, prompts: list[list[int]], max_tokens: int) -> float:
    from kiln.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - t0


def measure(llm, spec, vocab_size: int) -> dict[str, Any]:
    """Prefill latency and decode step latency / tokens/s at a few batch sizes (greedy, ignore_eos)."""
    import random

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


def _measure_loaded(load_llm, spec, vocab_size: int, **overrides) -> dict[str, Any]:
    llm = load_llm(**overrides)
    try:
        return measure(llm, spec, vocab_size)
    finally:
        llm.shutdown()


def tune(load_llm, spec, vocab_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Measure on this machine; returns (tuning record, engine_config overrides).

    ``load_llm(**overrides)`` loads the staged artifact through the runtime.
    """
    import torch

    tuning: dict[str, Any] = {"device": "cuda" if torch.cuda.is_available() else "cpu",
                              "measured_on": torch.cuda.get_device_name() if torch.cuda.is_available()
                              else f"cpu x{os.cpu_count()}"}
    overrides: dict[str, Any] = {}
    if tuning["device"] == "cuda" and not spec.gpu_spec.is_cpu:
        from kiln.engine.cuda_graphs import default_batch_sizes  # torch: only when tuning a GPU build

        buckets = default_batch_sizes(spec.max_batch_size)
        eager = _measure_loaded(load_llm, spec, vocab_size, enforce_eager=True)
        graphs = _measure_loaded(load_llm, spec, vocab_size, cuda_graph_batch_sizes=buckets)
        def step_ms(m: dict) -> float:  # summed over the measured batch sizes
            return sum(row["decode_step_ms"] for row in m["decode"])

        use_graphs = step_ms(graphs) < step_ms(eager)
        tuning.update(eager=eager, cuda_graphs=graphs, cuda_graph_batch_sizes=buckets, use_cuda_graphs=use_graphs)
        # An empty bucket list means "the runtime's defaults" to LLM(); eager is its own switch.
        overrides.update({"cuda_graph_batch_sizes": buckets} if use_graphs else {"enforce_eager": True})
        return tuning, overrides
    from kiln.engine.cpu_target import available_cpus, describe_host

    # The CPU this was measured on (model, flags, CPUs, quota, native bf16/fp16): a serving host of
    # another type treats torch_num_threads as a hint and measures its own (kiln.engine.cpu_target).
    tuning["cpu"] = describe_host()
    tuning["measured_on"] = f"{tuning['cpu']['model']} x{tuning['cpu']['cpus']}"
    original = torch.get_num_threads()
    cpus = available_cpus()
    # With TP the worker ranks pick their own share of the cores; only rank 0 would see a change here.
    candidates = [original] if spec.tensor_parallel > 1 else sorted({1, max(1, cpus // 2), cpus})
    by_threads = {}
    llm = load_llm()
    try:
        for n in candidates:
            torch.set_num_threads(n)
            by_threads[n] = measure(llm, spec, vocab_size)
            log.info("threads=%d: prefill %.1f tok/s, decode b=1 %.1f tok/s", n,
                     by_threads[n]["prefill_tokens_per_s"], by_threads[n]["decode"][0]["decode_tokens_per_s"])
    finally:
        llm.shutdown()
        torch.set_num_threads(original)

    def score(n: int) -> float:  # decode throughput at the largest measured batch: what serving spends on
        return by_threads[n]["decode"][-1]["decode_tokens_per_s"]

    best = max(candidates, key=score)
    tuning.update(threads={str(n): m for n, m in by_threads.items()}, torch_num_threads=best,
                  measurement=by_threads[best])
    return tuning, overrides
