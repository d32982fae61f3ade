"""The build's ``compile`` stage: compile the CPU engine for the build host's ISA, and keep it only where it
measures faster.

With ``$KILN_BUILD_COMPILE=inductor`` (opt-in, :data:`COMPILE_ENV`), on a CPU build of one rank, after tuning, the staged artifact is loaded twice more through the
runtime at the tuned thread count: eager, and with ``compile="inductor"`` compiling into the
artifact's :data:`~kiln.engine.compile.CACHE_DIR` (Inductor's cache directory: the FX graphs and
the C++ kernels, a few MB). Both are timed with :func:`kiln.builder.timing.measure`. When the compiled
engine's prefill plus decode steps are at least :data:`COMPILE_MIN_GAIN` faster, the artifact
ships the cache and ``engine_config.compile = "inductor"``; otherwise the cache is deleted and the
engine stays eager. Either way ``tuning.compile`` records both timings, the compile time and what
the compiled kernels need (vector ISA, its CPU flags, torch, threads: ``kiln.engine.compile``), so
a serving host without them runs eager. docs/cpu-compile.md has the measured figures.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from kiln.builder.context import BuildContext
from kiln.builder.errors import InvalidSpec
from kiln.builder.stages.package import write_engine
from kiln.builder.timing import measure, total_ms
from kiln.engine.compile import CACHE_DIR, CACHE_ENV, compile_into, compile_record

log = logging.getLogger("kiln.builder")

COMPILE_MIN_GAIN = 1.05  # compiled must be this much faster than eager to ship (shared build hosts are noisy)
# Opt-in while the measured gain is small next to the stage's cost (two more loads and a 1-2 min compile):
# "inductor" runs this stage; unset or "off" skips it (docs/cpu-compile.md).
COMPILE_ENV = "KILN_BUILD_COMPILE"


def run(ctx: BuildContext) -> None:
    """CPU: Inductor for this host's ISA, shipped when it measures faster (see the module doc)."""
    write_engine(ctx)  # its loads must see the tuned threads, as a serving pod will (not re-measure)
    ctx.config = {**ctx.config, **compile_for_target(ctx.load_llm, ctx.spec, ctx.facts.vocab_size, ctx.out,
                                                     ctx.tuning, ctx.config)}


def compile_for_target(load_llm, spec, vocab_size: int, out: Path, tuning: dict[str, Any],
                       config: dict[str, Any]) -> dict[str, Any]:
    """Compile, measure and decide (see the module doc); returns the engine_config overrides and
    records ``tuning["compile"]``. Skipped (``{}``) for GPU builds and more than one rank."""
    ranks = int(config.get("tensor_parallel_size", 1)) * int(config.get("pipeline_parallel_size", 1))
    wanted = os.environ.get(COMPILE_ENV, "off").strip().lower() or "off"
    if wanted not in ("off", "inductor"):
        raise InvalidSpec(f"${COMPILE_ENV} must be 'inductor' or 'off', got {wanted!r}: unset it or set one of those")
    if wanted == "off" or not spec.gpu_spec.is_cpu or ranks != 1:
        return {}
    cache = out / CACHE_DIR
    shutil.rmtree(cache, ignore_errors=True)
    before_env, before_threads = os.environ.get(CACHE_ENV), torch.get_num_threads()
    torch.set_num_threads(int(tuning.get("torch_num_threads") or before_threads))
    try:
        llm = load_llm(compile="off")
        try:
            eager = measure(llm, spec, vocab_size)
        finally:
            llm.shutdown()
        compile_into(cache)
        start = time.perf_counter()
        llm = load_llm(compile="inductor")
        try:
            compile_s = time.perf_counter() - start
            compiled = measure(llm, spec, vocab_size)
        finally:
            llm.shutdown()
        record = compile_record()
    finally:
        torch.set_num_threads(before_threads)
        if before_env is None:
            os.environ.pop(CACHE_ENV, None)
        else:
            os.environ[CACHE_ENV] = before_env
    gain = total_ms(eager) / max(total_ms(compiled), 1e-9)
    used = gain >= COMPILE_MIN_GAIN
    shutil.rmtree(cache / "locks", ignore_errors=True)
    if not used:
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(out / Path(CACHE_DIR).parent, ignore_errors=True)
    tuning["compile"] = {**record, "used": used, "gain": round(gain, 3), "compile_s": round(compile_s, 1),
                         "eager": eager, "compiled": compiled}
    log.info("compile (inductor, %s): %.2fx eager's speed, compiled in %.0fs: %s", record["vec_isa"], gain,
             compile_s, "shipped" if used else f"not shipped (needs >= {COMPILE_MIN_GAIN}x)")
    return {"compile": "inductor"} if used else {}
