"""The build's ``tactics`` stage: every op with more than one implementation, timed on the target at the
envelope's shapes, the winners shipped in the artifact (``tactics.json``, kiln.engine.tactics).

On CPU, at the thread count the tune stage chose:

1. linears: each linear shape of the model (this rank's shards, the row caps the runtime applies) at
   every row bucket up to ``maxNumTokens`` (the LM head up to ``maxBatchSize``), every candidate this
   host runs (kiln's FMA and AMX kernels, oneDNN on kiln's panels or its own, ATen), interleaved,
   within ``BUDGET_S`` (or ``$KILN_TACTICS_BUDGET_S``); and, for a bf16 cache on an AMX host, a prefill
   group's attention on AMX tiles against vdpbf16ps;
2. model-level, end to end through the runtime on the artifact itself (prefill + decode steps, two
   interleaved rounds, the better of each): the decoder stack as one C call vs module by module,
   kiln's C attention vs torch's, and the MLP's prefill slice (``models/llama.MLP_ROWS_CHOICES``, on a
   ``maxNumTokens`` prefill).

A serving host of the same signature uses the table as is; another kind re-times the linears at load
(``kiln.engine.tactics.resolve``). On a GPU nothing is timed yet: linears run cuBLAS through torch and
attention the Triton kernels, and the record says so.
"""

from __future__ import annotations

import gc
import logging
import random
import time
from pathlib import Path
from typing import Any

import torch
from kiln.builder.context import BuildContext
from kiln.builder.stages.package import write_engine
from kiln.builder.timing import measure as measure_engine
from kiln.builder.timing import total_ms
from kiln.engine import SamplingParams
from kiln.engine.artifact import TACTICS_FILE
from kiln.engine.models.llama import CPU_MLP_ROWS, mlp_rows_choices
from kiln.engine.tactics import report
from kiln.engine.tactics.bind import attention_shape
from kiln.engine.tactics.resolve import budget, measure
from kiln.engine.tactics.table import TacticTable

log = logging.getLogger("kiln.build.tactics")

BUDGET_S = 120.0
GPU_RECORD = {"device": "cuda", "timed": False,
              "why": "GPU tactics are not timed yet: linears run cuBLAS through torch, attention kiln's "
                     "Triton kernels (docs/gpu.md)"}


def run(ctx: BuildContext) -> None:
    """Time the tactics on the artifact as tuned; the winners go into tactics.json and the engine config."""
    write_engine(ctx)  # its loads must see the tuned threads, as a serving pod will
    record, overrides = tune_tactics(ctx.load_llm, ctx.spec, ctx.facts.vocab_size, ctx.out, ctx.tuning)
    ctx.report.record("tactics", record)
    ctx.config = {**ctx.config, **overrides}


def _end_to_end_ms(llm, spec, vocab_size: int) -> float:
    """Prefill plus the measured decode steps, in ms (kiln.builder.timing.measure)."""
    return total_ms(measure_engine(llm, spec, vocab_size))


def _best_of(runs: dict[str, list[float]]) -> dict[str, float]:
    return {name: round(min(times) * 1e3, 1) for name, times in runs.items()}  # ms -> us


def _prefill_ms(llm, tokens: int, vocab_size: int, seed: int) -> float:
    """One prompt of ``tokens`` random tokens (never a prefix-cache hit) through prefill, in ms."""
    rng = random.Random(seed)
    prompt = [rng.randrange(3, vocab_size) for _ in range(tokens)]
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    return (time.perf_counter() - t0) * 1e3


def _mlp_rows(llm, spec, vocab_size: int) -> dict[str, Any] | None:
    """The MLP's prefill slice (``models/llama.mlp_rows_choices``, the rule a load's timing shares) timed on a
    prefill of maxNumTokens tokens, two interleaved rounds; None where the MLP is not sliced (not kiln's kernels,
    short steps). Under tensor parallelism the other ranks' MLPs live in their own processes and each slice
    all-reduces once, so rank 0 alone cannot try a slice (the group's all-reduces would stop matching): the
    record says the default stands, and every rank runs it."""
    tokens = min(spec.max_num_tokens, spec.max_input_len)
    if llm.engine.config.tensor_parallel_size > 1:
        return {"winner": None, "how": f"not timed: tensor parallel ranks slice together; {CPU_MLP_ROWS} rows"}
    mlps = [m for m in llm.engine.runner.model.modules() if hasattr(m, "mlp_rows") and m.rows_per_call]
    choices = mlp_rows_choices(tokens)
    if not mlps or len(choices) < 2:
        return None
    stack = getattr(llm.engine.runner.model.model, "native_stack", None)
    runs: dict[str, list[float]] = {str(r): [] for r in choices}
    _prefill_ms(llm, tokens, vocab_size, 0)  # warm-up
    for round_ in range(2):
        for rows in choices:
            for m in mlps:
                m.mlp_rows = rows
            if stack is not None:
                stack.shape.mlp_rows = rows
            runs[str(rows)].append(_prefill_ms(llm, tokens, vocab_size, 1 + round_ * 10 + rows))
    us = _best_of(runs)
    return {"winner": int(min(us, key=us.get)), "us": us, "prefill_tokens": tokens}


def tune_tactics(load_llm, spec, vocab_size: int, out: Path, tuning: dict[str, Any]
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Measure and write ``out/tactics.json``; returns (the build report's record, engine_config overrides)."""
    if tuning.get("device") == "cuda":
        return dict(GPU_RECORD), {}
    if tuning.get("torch_num_threads"):
        torch.set_num_threads(int(tuning["torch_num_threads"]))
    # One engine loaded at a time, and freed before the next (each holds the weights and a KV pool).
    table, native = _time_linears(load_llm)
    path = table.save(out / TACTICS_FILE)
    native_ms = _time_stack_and_mlp(load_llm, spec, vocab_size, table)
    overrides = _time_attention(load_llm, spec, vocab_size, table, native_ms) if native else {}
    table.save(path)
    for line in report.format_table(table).splitlines():
        log.info("%s", line)
    record = {"device": "cpu", "timed": True, "file": TACTICS_FILE, "host": table.host,
              "seconds": round(table.seconds, 2), "summary": report.summary(table),
              "rows": report.rows(table)}
    return record, overrides


def _time_linears(load_llm) -> tuple[TacticTable, bool]:
    """Every linear shape the runtime will run, timed per candidate; (the table, whether kiln's C kernels
    run)."""
    llm = load_llm(tactics="aten")  # untimed: only to learn the linear shapes the runtime will run
    try:
        runner = llm.engine.runner
        native = runner.native is not None
        attention = attention_shape(runner.model, llm.engine.config) if native else None
        table = measure(runner.tactic_sites, runner.native, budget(BUDGET_S), attention=attention,
                        exclude=llm.engine.config.tactics_exclude or ())
    finally:
        llm.shutdown()
    del llm, runner
    gc.collect()
    log.info("linears: %d shapes timed in %.1fs", len(table.linear), table.seconds)
    return table, native


def _time_stack_and_mlp(load_llm, spec, vocab_size: int, table: TacticTable) -> list[float]:
    """Into ``table.model``: the decoder stack as one C call vs module by module, and the MLP's prefill slice.
    Returns the engine's end-to-end times as loaded (kiln's C attention where it runs), for
    :func:`_time_attention`."""
    stack: dict[str, list[float]] = {"fused": [], "modules": []}
    as_loaded: list[float] = []
    llm = load_llm()  # the table just written: this host matches it, nothing is re-timed
    try:
        model = llm.engine.runner.model.model
        fused = getattr(model, "native_stack", None)
        for _ in range(2):
            as_loaded.append(_end_to_end_ms(llm, spec, vocab_size))
            if fused is not None:
                stack["fused"].append(as_loaded[-1])
                model.native_stack = None
                stack["modules"].append(_end_to_end_ms(llm, spec, vocab_size))
                model.native_stack = fused
        rows = _mlp_rows(llm, spec, vocab_size)  # the MLP's prefill slice, on the same engine
    finally:
        llm.shutdown()
    del llm, model, fused
    gc.collect()
    if rows:
        table.model["mlp_rows"] = rows
    if stack["modules"]:
        us = _best_of(stack)
        table.model["decoder_stack"] = {"winner": min(us, key=us.get), "us": us}
    return as_loaded


def _time_attention(load_llm, spec, vocab_size: int, table: TacticTable, native_ms: list[float]
                    ) -> dict[str, Any]:
    """kiln's C attention (``native_ms``) vs torch's, into ``table.model``; the override where torch wins."""
    llm = load_llm(attention_backend="torch")
    try:
        torch_ms = [_end_to_end_ms(llm, spec, vocab_size) for _ in range(2)]
    finally:
        llm.shutdown()
    del llm
    gc.collect()
    us = _best_of({"native": native_ms, "torch": torch_ms})
    table.model["attention"] = {"winner": min(us, key=us.get), "us": us}
    return {"attention_backend": "torch"} if table.model["attention"]["winner"] == "torch" else {}
