"""The build's ``tune`` stage: measure runtime knobs on the build machine, then plan the KV pool again.

Only knobs that do not change the envelope (block size, shapes and dtypes are in it) are chosen here,
by timing the real artifact through the runtime (:func:`kiln.builder.timing.measure`): on CPU the
torch thread count, with prefill and decode-step latency and tokens/s at a few batch sizes recorded;
on GPU the CUDA-graph decode batch buckets, eager vs graphs, recorded the same way. Every number
measured is kept in ``engine.json`` under ``tuning``. CUDA-graph buckets go into ``engine_config``
(an ``LLM`` argument); the thread count is a hint the runtime uses at load on the same CPU type
(``tuning.cpu`` records the model, flags, CPU count and native bf16/fp16 measurement), see
``kiln.engine.cpu_target``.

The graphs' device memory measured here is what the serving KV plan sets aside for them
(:func:`kiln.builder.kv_plan.plan_with_cuda_graphs`), so the stage ends by planning the pool again.
"""

from __future__ import annotations

import gc
import logging
import os
from typing import Any

import torch
from kiln.builder.context import BuildContext
from kiln.builder.kv_plan import kv_plan_summary, plan_with_cuda_graphs
from kiln.builder.timing import measure
from kiln.engine.cpu_target import SERVER_CORES, available_cpus, describe_host
from kiln.engine.cuda_graphs import default_batch_sizes

log = logging.getLogger("kiln.build.tune")


def run(ctx: BuildContext) -> None:
    """Tune on this machine; the serving pool is what is left after the CUDA graphs measured here."""
    ctx.tuning, overrides = tune(ctx.load_llm, ctx.spec, ctx.facts.vocab_size)
    ctx.kv_plan, overrides = plan_with_cuda_graphs(ctx.spec, ctx.facts, ctx.weights_per_rank, ctx.tuning,
                                                   overrides, ctx.draft_kv_bytes_per_token)
    ctx.report.record("kv_plan_summary", kv_plan_summary(ctx.kv_plan))
    ctx.config = {**ctx.config, **overrides, "num_kv_blocks": ctx.kv_plan["num_kv_blocks"]}


def cuda_memory_in_use() -> int:
    """Bytes in use on this process's CUDA device, by anyone: what is left for the pool is the rest.

    Freed tensors go back first (``gc`` + ``empty_cache``); a CUDA graph's private pool stays."""
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
    :func:`kiln.builder.kv_plan.plan_with_cuda_graphs`; on CPU it is ``None``: CPU engines capture no graphs.
    """
    tuning: dict[str, Any] = {"device": "cuda" if torch.cuda.is_available() else "cpu",
                              "measured_on": torch.cuda.get_device_name() if torch.cuda.is_available()
                              else f"cpu x{os.cpu_count()}"}
    if tuning["device"] == "cuda" and not spec.gpu_spec.is_cpu:
        return tuning, _tune_cuda_graphs(load_llm, spec, vocab_size, memory_in_use, tuning)
    _tune_cpu_threads(load_llm, spec, vocab_size, tuning)
    return tuning, {}


def _tune_cuda_graphs(load_llm, spec, vocab_size: int, memory_in_use, tuning: dict[str, Any]
                      ) -> dict[str, Any]:
    """Eager vs CUDA graphs at the default buckets, and the graphs' device memory; returns the overrides."""
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
    return {"cuda_graph_batch_sizes": buckets} if use_graphs else {"enforce_eager": True}


def _tune_cpu_threads(load_llm, spec, vocab_size: int, tuning: dict[str, Any]) -> None:
    """The torch thread count with the best decode throughput, and the host it was measured on."""
    # The CPU this was measured on (model, flags, CPUs, quota, native bf16/fp16): a serving host of
    # another type treats torch_num_threads as a hint and measures its own (kiln.engine.cpu_target).
    tuning["cpu"] = describe_host()
    tuning["measured_on"] = f"{tuning['cpu']['model']} x{tuning['cpu']['cpus']}"
    tuning["cuda_graph_memory_bytes"] = None  # CPU engines run eagerly: no graphs, nothing to reserve
    original = torch.get_num_threads()
    cpus = available_cpus()
    # With TP the worker ranks pick their own share of the cores; only rank 0 would see a change here.
    candidates = [original] if spec.tensor_parallel > 1 else sorted({1, max(1, cpus // 2), max(1, cpus - 1), cpus})
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

    # The model alone is measured here; a server's own threads (HTTP, detokenizer, the engine loop's Python) keep
    # a core busy beside it, so the serving count leaves them one (cpu_target.serving: on a 2-core host two
    # compute threads served slower than one, and collapsed beside busy neighbours; docs/cpu-targets.md).
    serving = [n for n in candidates if n <= max(1, cpus - SERVER_CORES)] or candidates
    best = max(serving, key=score)
    tuning.update(threads={str(n): m for n, m in by_threads.items()}, torch_num_threads=best,
                  model_alone_threads=max(candidates, key=score), server_cores=SERVER_CORES if cpus > 1 else 0,
                  measurement=by_threads[best])
