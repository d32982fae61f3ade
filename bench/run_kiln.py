"""kiln on the bench workload: ``LLM.generate`` with every request submitted at once,
or the engine's step loop with each request added at its arrival time.

Every request is greedy with ``ignore_eos`` and ``max_tokens = output_len``, so
kiln does exactly the work the baselines do. Steps and batch sizes come from
the engine's own counters (``EngineStats``), taken as a difference around the
timed run so the warm-up does not count.
"""

from __future__ import annotations

import time
from pathlib import Path

from kiln_bench.records import RequestRecord, RunRecord
from kiln_bench.workload import Workload


def engine_kwargs(job: dict) -> dict:
    """The LLM() configuration every kiln run of one bench uses (also recorded in the JSON)."""
    return {
        "dtype": job["dtype"],
        "max_batch_size": job["max_batch_size"],
        "max_num_tokens": job["max_num_tokens"],
        "max_seq_len": job["max_seq_len"],
        "num_kv_blocks": job.get("num_kv_blocks"),
        "enable_prefix_caching": job.get("enable_prefix_caching", True),
        "device": job.get("device", "cpu"),
        **job.get("engine_extra", {}),  # the kiln-pp2* systems' parallel sizes, kiln-batch-invariant's setting
    }


def load(model_dir: Path, job: dict):
    from kiln.engine import LLM

    return LLM(str(model_dir), **engine_kwargs(job))


def warm(llm) -> None:
    """A short request; on CUDA also every shape a build compiles into the artifact's kernel cache
    (``kiln.engine.kernels.cache.warm_up``), so that a served artifact's kernels are not compiled on the clock
    here either. The first GPU run (H200, 2026-11-30) warmed with the short request alone, so the long-chunk
    prefill tiles could compile on the clock; its median time to first token was 0.9-1.0 s (how much of it was
    compiling is not yet measured)."""
    from kiln.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([[5, 6, 7, 8, 9, 10, 11, 12]] * 2, params)
    if llm.engine_config.device == "cuda":
        from kiln.engine.kernels.cache import warm_up

        warm_up(llm)


def _params(output_len: int):
    from kiln.engine import SamplingParams

    return SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)


def run(llm, workload: Workload, job: dict) -> RunRecord:
    before = llm.stats()
    if all(r.arrival_time == 0 for r in workload.requests):
        records = _run_offline(llm, workload)
    else:
        records = _run_arrivals(llm, workload)
    after = llm.stats()
    steps = after.num_steps - before.num_steps
    run = RunRecord(system="kiln", duration_s=max(r.finished for r in records), num_steps=steps, requests=records)
    run.extra = {
        "engine_avg_running": (after.sum_running - before.sum_running) / steps if steps else 0.0,
        "engine_avg_kv_usage": (after.sum_kv_usage - before.sum_kv_usage) / steps if steps else 0.0,
        "num_preemptions": after.num_preemptions - before.num_preemptions,
        "num_computed_tokens": after.num_computed_tokens - before.num_computed_tokens,
        "prefix_cache_hits": after.prefix_cache_hits - before.prefix_cache_hits,
        "num_total_blocks": after.num_total_blocks,
        "engine_kwargs": {k: v for k, v in engine_kwargs(job).items()},
        "attention_backend": llm.engine.runner.attention_backend,  # "native" = kiln's CPU kernels ran
        # the ISA level of kiln's CPU kernels (x86-64-v4, x86-64-v3, ...) when they run, else None
        "cpu_kernels_level": llm.engine.runner.native.level if llm.engine.runner.native is not None else None,
    }
    return run


def _run_offline(llm, workload: Workload) -> list[RequestRecord]:
    prompts = [r.prompt_token_ids for r in workload.requests]
    params = [_params(r.output_len) for r in workload.requests]
    # RequestMetrics are wall-clock (time.time); convert to seconds after the submission.
    t0 = time.time()
    outs = llm.generate(prompts, params)
    records = []
    for r, out in zip(workload.requests, outs, strict=True):
        m = out.metrics
        records.append(RequestRecord(
            index=r.index, arrival=0.0, first_token=m.first_token_time - t0, finished=m.finished_time - t0,
            output_token_ids=list(out.token_ids),
        ))
    return records


def _run_arrivals(llm, workload: Workload) -> list[RequestRecord]:
    """Poisson arrivals: the bench drives the engine's step loop itself and adds each request
    once its arrival time has passed (what AsyncLLM's loop does, minus the thread hand-off)."""
    engine = llm.engine
    pending = sorted(workload.requests, key=lambda r: r.arrival_time)
    live = {}
    t0 = time.time()
    while pending or engine.has_unfinished():
        now = time.time() - t0
        while pending and pending[0].arrival_time <= now:
            r = pending.pop(0)
            req = engine.make_request(r.prompt_token_ids, _params(r.output_len), request_id=f"bench-{r.index}")
            req.arrival_time = t0 + r.arrival_time  # scheduled arrival, so queueing delay counts in TTFT
            engine.add(req)
            live[r.index] = (r, req)
        if engine.has_unfinished():
            engine.step()
        elif pending:
            time.sleep(max(0.0, pending[0].arrival_time - (time.time() - t0)))
    return [
        RequestRecord(index=r.index, arrival=r.arrival_time, first_token=req.first_token_time - t0,
                      finished=req.finished_time - t0, output_token_ids=list(req.output_token_ids))
        for r, req in (live[i] for i in sorted(live))
    ]
