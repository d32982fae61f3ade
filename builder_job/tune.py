"""Plan the KV pool for the target device and measure runtime knobs on the build machine.

KV plan. A serving pod preallocates one pool of ``num_kv_blocks`` blocks. The
builder sizes it once, for the target:

    budget      = device memory x kv.memoryFraction
    num_kv_blocks = (budget - weights of the largest rank - activation reserve
                     - CUDA-graph reserve) // bytes per block
    CUDA-graph reserve = measured graph memory x (1 + CUDA_GRAPH_MEMORY_MARGIN), 0 without graphs

where a block holds ``blockSize`` tokens of K and V for every layer and the KV
heads of one rank. On a GPU the pool takes all of that (spare blocks keep
prefixes cached). The graphs' memory is what loading the artifact with the
chosen CUDA graphs takes on the build GPU beyond loading it eagerly (device
memory in use, ``mem_get_info``, right after each load; :func:`tune`), so the
plan is made twice: before tuning without it (the build's own loads use a small
pool), and after, with it, for serving. Where no graphs run (CPU engines, or the
tuner chose eager) the measurement is ``None`` and the reserve 0; a pool that
cannot hold one ``maxSeqLen`` request next to the graphs falls back to eager.
For ``gpu: cpu`` the device memory is a documented budget —
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
# Graphs captured on a serving GPU of the same SKU may take a little more than on the build GPU
# (allocator segment rounding, driver versions): the plan keeps this fraction above the measurement.
CUDA_GRAPH_MEMORY_MARGIN = 0.2
DECODE_TOKENS = 8
PROMPT_TOKENS_PER_SEQ = 16


def cuda_graph_reserve_bytes(cuda_graph_bytes: int | None) -> int:
    """What the plan sets aside for measured CUDA graphs (0 where none run)."""
    return 0 if cuda_graph_bytes is None else math.ceil(cuda_graph_bytes * (1 + CUDA_GRAPH_MEMORY_MARGIN))


def plan_kv(spec, facts: ModelFacts, weight_bytes_per_rank: int, cuda_graph_bytes: int | None = None,
            extra_kv_bytes_per_token: int = 0) -> dict[str, Any]:
    """The KV pool for the target; :class:`InvalidSpec` if not even one ``maxSeqLen`` request fits.

    ``cuda_graph_bytes``: the graphs' memory measured by :func:`tune`; ``None`` where no graphs run.
    ``extra_kv_bytes_per_token``: a draft model's K/V (its pool has as many blocks: ``draft_stage``),
    whose weights the caller counts in ``weight_bytes_per_rank``.
    """
    total = device_memory_bytes(spec)
    budget = int(total * spec.kv.memory_fraction)
    activations = activation_reserve_bytes(facts, spec)
    graphs = cuda_graph_reserve_bytes(cuda_graph_bytes)
    per_token = kv_bytes_per_token(facts, spec) + extra_kv_bytes_per_token
    block_bytes = per_token * spec.kv.block_size
    free = budget - weight_bytes_per_rank - activations - graphs
    num_blocks = max(0, free // block_bytes)
    blocks_per_seq = math.ceil(spec.max_seq_len / spec.kv.block_size)
    useful = spec.max_batch_size * blocks_per_seq
    capped = False
    if spec.gpu_spec.is_cpu and num_blocks > useful:
        num_blocks, capped = useful, True
    if num_blocks < blocks_per_seq:
        raise InvalidSpec(
            f"spec.gpu: after {weight_bytes_per_rank / 2**30:.2f} GiB of weights per rank"
            + (f" and {graphs / 2**30:.2f} GiB for CUDA graphs" if graphs else "") + f" the KV pool on {spec.gpu} "
            f"has {num_blocks} blocks, fewer than one maxSeqLen ({spec.max_seq_len}) request needs "
            f"({blocks_per_seq}); lower maxSeqLen, raise kv.memoryFraction or use a larger GPU"
        )
    return {
        "device_memory_bytes": total,
        "memory_fraction": spec.kv.memory_fraction,
        "budget_bytes": budget,
        "weight_bytes_per_rank": weight_bytes_per_rank,
        "activation_reserve_bytes": activations,
        "cuda_graph_memory_bytes": cuda_graph_bytes,
        "cuda_graph_reserve_bytes": graphs,
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
    graphs = plan.get("cuda_graph_reserve_bytes")
    return (f"{plan['num_kv_blocks']} blocks x {plan['block_size']} tokens ({plan['kv_pool_bytes'] / 2**20:.1f} MiB "
            f"{plan['kv_dtype']}), {plan['full_length_requests']} full-length requests"
            + (f", {graphs / 2**20:.1f} MiB kept for CUDA graphs" if graphs else ""))


def plan_with_cuda_graphs(spec, facts: ModelFacts, weight_bytes_per_rank: int, tuning: dict[str, Any],
                          overrides: dict[str, Any], extra_kv_bytes_per_token: int = 0
                          ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The serving KV plan after :func:`tune`: less the graphs' measured memory when graphs were chosen.

    Returns (plan, overrides). A pool too small for one ``maxSeqLen`` request next to the graphs
    drops the graphs (``enforce_eager``; ``tuning["cuda_graphs_dropped"]`` says why) rather than fail.
    """
    graph_bytes = tuning.get("cuda_graph_memory_bytes") if tuning.get("use_cuda_graphs") else None
    extra = extra_kv_bytes_per_token
    if graph_bytes is None:
        return plan_kv(spec, facts, weight_bytes_per_rank, extra_kv_bytes_per_token=extra), overrides
    try:
        return plan_kv(spec, facts, weight_bytes_per_rank, graph_bytes, extra), overrides
    except InvalidSpec as exc:
        log.warning("CUDA graphs dropped: %s", exc)
        tuning.update(use_cuda_graphs=False, cuda_graphs_dropped=str(exc))
        rest = {k: v for k, v in overrides.items() if k != "cuda_graph_batch_sizes"}
        return plan_kv(spec, facts, weight_bytes_per_rank, extra_kv_bytes_per_token=extra), {**rest, "enforce_eager": True}



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


def cuda_memory_in_use() -> int:
    """Bytes in use on this process's CUDA device, by anyone: what is left for the pool is the rest.

    Freed tensors go back first (``gc`` + ``empty_cache``); a CUDA graph's private pool stays."""
    import gc

    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return total - free


def _measure_loaded(load_llm, spec, vocab_size: int, memory_in_use, **overrides) -> dict[str, Any]:
    """Timings of one load, and ``load_device_bytes``: the device memory the load itself took."""
    before = memory_in_use()
    llm = load_llm(**overrides)
    try:
        loaded = memory_in_use() - before
        return {**measure(llm, spec, vocab_size), "load_device_bytes": loaded}
    finally:
        llm.shutdown()


def tune(load_llm, spec, vocab_size: int, memory_in_use=cuda_memory_in_use
         ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Measure on this machine; returns (tuning record, engine_config overrides).

    ``load_llm(**overrides)`` loads the staged artifact through the runtime; ``memory_in_use()``
    (CUDA only) the device's bytes in use. On CUDA the record has ``cuda_graph_memory_bytes``: what
    the load with graphs took beyond the eager load (same artifact, same build-time pool), for
    :func:`plan_with_cuda_graphs`; on CPU it is ``None``: CPU engines capture no graphs.
    """
    import torch

    tuning: dict[str, Any] = {"device": "cuda" if torch.cuda.is_available() else "cpu",
                              "measured_on": torch.cuda.get_device_name() if torch.cuda.is_available()
                              else f"cpu x{os.cpu_count()}"}
    overrides: dict[str, Any] = {}
    if tuning["device"] == "cuda" and not spec.gpu_spec.is_cpu:
        from kiln.engine.cuda_graphs import default_batch_sizes  # torch: only when tuning a GPU build

        buckets = default_batch_sizes(spec.max_batch_size)
        eager = _measure_loaded(load_llm, spec, vocab_size, memory_in_use, enforce_eager=True)
        graphs = _measure_loaded(load_llm, spec, vocab_size, memory_in_use, cuda_graph_batch_sizes=buckets)
        graph_bytes = max(0, graphs["load_device_bytes"] - eager["load_device_bytes"])
        log.info("CUDA graphs for batch sizes %s: %.1f MiB of device memory", buckets, graph_bytes / 2**20)
        def step_ms(m: dict) -> float:  # summed over the measured batch sizes
            return sum(row["decode_step_ms"] for row in m["decode"])

        use_graphs = step_ms(graphs) < step_ms(eager)
        tuning.update(eager=eager, cuda_graphs=graphs, cuda_graph_batch_sizes=buckets, use_cuda_graphs=use_graphs,
                      cuda_graph_memory_bytes=graph_bytes)
        # An empty bucket list means "the runtime's defaults" to LLM(); eager is its own switch.
        overrides.update({"cuda_graph_batch_sizes": buckets} if use_graphs else {"enforce_eager": True})
        return tuning, overrides
    from kiln.engine.cpu_target import available_cpus, describe_host

    # The CPU this was measured on (model, flags, CPUs, quota, native bf16/fp16): a serving host of
    # another type treats torch_num_threads as a hint and measures its own (kiln.engine.cpu_target).
    tuning["cpu"] = describe_host()
    tuning["measured_on"] = f"{tuning['cpu']['model']} x{tuning['cpu']['cpus']}"
    tuning["cuda_graph_memory_bytes"] = None  # CPU engines run eagerly: no graphs, nothing to reserve
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
