"""What this CPU runs fast: native low-precision matmuls, the int8 path, and how many threads to use.

A ``bfloat16`` engine is the fast choice on a host with native bf16 (AVX512-BF16, AMX) and
a ~100x slower one on an AVX2-only host, where torch emulates bf16 matmuls (measured with
torch 2.13 on an AVX2 EPYC: 0.5 GFLOP/s bf16 vs 55 GFLOP/s float32, one thread). So:

- :func:`probe` measures it: the same small matmul in float32 and in the low-precision
  dtype, one thread, median of a few runs; the dtype is *native* when it reaches at least
  :data:`NATIVE_MIN_RATIO` of float32's rate. The CPU flags from ``/proc/cpuinfo`` are
  recorded beside the measurement (flags alone lie: a flag can be present while torch's
  kernels do not use it). ``$KILN_CPU_NATIVE_BF16`` / ``$KILN_CPU_NATIVE_FP16`` (``0``/``1``)
  override the measurement, for tests and for operators who know better.
- :func:`plan_cpu_load` decides, for an artifact about to load on this CPU: the compute
  dtype (a bf16/fp16 artifact on a host without that native matmul computes in float32:
  its weights are upcast once at load), the int8 candidates (kiln's int8 GEMM, and torch's
  int8-weight x bf16 kernel where bf16 is native, else dequantize into float32 per matmul; the
  tactic table picks), and the thread count:
  ``$OMP_NUM_THREADS`` if set; else the cgroup CPU quota (what a container really has);
  else the build's measured best when this is the machine type it was tuned on; else a
  measurement here (a few threads counts timed on a decode-sized matmul).

The result is a plain dict, kept on ``EngineConfig.cpu_target`` and shown by the server's
``/version``; builds record :func:`describe_host` in ``engine.json`` (``tuning.cpu``).
"""

from __future__ import annotations

import logging
import math
import os
import platform
import sys
import threading
import time
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

log = logging.getLogger("kiln.engine.cpu")

NATIVE_MIN_RATIO = 0.5  # a low-precision matmul at >= half float32's rate counts as native
OVERRIDE_ENV = {"bfloat16": "KILN_CPU_NATIVE_BF16", "float16": "KILN_CPU_NATIVE_FP16"}
THREADS_ENV = "KILN_CPU_THREADS"
# Flags that decide which matmul / int8 kernels can be fast; the rest of /proc/cpuinfo is noise here.
RELEVANT_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                  "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16", "asimd", "sve", "bf16", "i8mm")
PROBE_SHAPE = (32, 512, 1024)  # (tokens, in, out): ~34 MFLOP, ~1 ms in float32, ~70 ms when bf16 is emulated
THREADS_SHAPE = (16, 1024, 4096)  # a decode-step-sized linear for the thread measurement
PROBE_REPEATS = 5
THREADS_MARGIN = 1.15  # more threads must be this much faster to be chosen (shared hosts are noisy)
CGROUP_V2 = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1 = (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@lru_cache(maxsize=1)
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "CPU part"):
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def available_cpus() -> int:
    """CPUs this process may run on (affinity), not the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cgroup_cpu_quota(v2: Path = CGROUP_V2, v1: tuple[Path, Path] = CGROUP_V1) -> float | None:
    """The container's CPU limit in cores (cgroup v2 ``cpu.max`` or v1 CFS quota); None when unlimited."""
    try:
        parts = v2.read_text().split()
    except OSError:
        parts = []
    if parts:
        try:
            return None if parts[0] == "max" else int(parts[0]) / int(parts[1] if len(parts) > 1 else 100000)
        except ValueError:
            return None
    try:
        quota, period = (int(p.read_text().strip()) for p in v1)
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def _rate(dtype, shape: tuple[int, int, int], repeats: int = PROBE_REPEATS, threads: int = 1) -> float:
    """GFLOP/s of ``x @ w.T`` in ``dtype`` at ``threads`` torch threads (median of ``repeats``)."""
    import torch

    m, k, n = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.nn.functional.linear(x, w)  # warm-up: oneDNN picks its kernel
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, w)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    times.sort()
    return 2 * m * k * n / max(times[len(times) // 2], 1e-9) / 1e9


@lru_cache(maxsize=4)
def _measured_native(dtype_name: str) -> tuple[bool, float, float]:
    import torch

    fp32 = _rate(torch.float32, PROBE_SHAPE)
    low = _rate(getattr(torch, dtype_name), PROBE_SHAPE)
    return low >= NATIVE_MIN_RATIO * fp32, round(low, 2), round(fp32, 2)


def probe(dtype: str) -> dict[str, Any]:
    """Does this CPU multiply ``dtype`` natively? Measured (or forced by ``$KILN_CPU_NATIVE_*``)."""
    if dtype == "float32":
        return {"dtype": dtype, "native": True, "how": "float32 is always native"}
    env = OVERRIDE_ENV.get(dtype)
    forced = os.environ.get(env, "").strip().lower() if env else ""
    if forced in ("0", "1", "false", "true", "no", "yes"):
        return {"dtype": dtype, "native": forced in ("1", "true", "yes"), "how": f"${env}={forced}"}
    native, low, fp32 = _measured_native(dtype)
    return {"dtype": dtype, "native": native, "how": "measured", "gflops": low, "float32_gflops": fp32,
            "ratio": round(low / fp32, 3) if fp32 else None}


def describe_host() -> dict[str, Any]:
    """The CPU an engine is built / tuned / served on: model, relevant flags, CPUs, quota, native dtypes."""
    flags = cpu_flags()
    quota = cgroup_cpu_quota()
    return {"model": cpu_model(), "machine": platform.machine(),
            "flags": sorted(f for f in RELEVANT_FLAGS if f in flags),
            "cpus": available_cpus(), "cgroup_cpu_quota": quota,
            "native": {d: probe(d) for d in ("bfloat16", "float16")}}


def same_machine_type(built: dict[str, Any] | None) -> bool:
    """Is this the CPU (model, flags, CPU count) a build recorded in ``tuning.cpu``?"""
    if not built:
        return False
    return (built.get("model") == cpu_model() and built.get("cpus") == available_cpus()
            and sorted(built.get("flags") or []) == sorted(f for f in RELEVANT_FLAGS if f in cpu_flags()))


def measure_threads(candidates: list[int] | None = None) -> dict[int, float]:
    """Float32 GFLOP/s of a decode-sized linear at each candidate thread count."""
    import torch

    n = available_cpus()
    candidates = candidates or sorted({1, max(1, n // 2), n})
    return {t: round(_rate(torch.float32, THREADS_SHAPE, threads=t), 2) for t in candidates}


def pinned_threads() -> tuple[int | None, str] | None:
    """The user's thread count, where one is set: ``$OMP_NUM_THREADS`` (None: torch's setting is left alone)
    or ``$KILN_CPU_THREADS`` (capped at the CPUs), with why; None where neither pins it."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None, f"$OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    forced = os.environ.get(THREADS_ENV, "").strip()
    if forced.isdigit() and int(forced) >= 1:
        return min(int(forced), available_cpus()), f"${THREADS_ENV}={forced}"
    return None


def usable_cores() -> int:
    """The cores this process may keep busy: the cgroup CPU quota floored (at least 1), else its CPUs."""
    quota = cgroup_cpu_quota()
    return max(1, min(available_cpus(), math.floor(quota))) if quota is not None else available_cpus()


def choose_threads(hint: int | None = None, built_on: dict[str, Any] | None = None,
                   reserve: int | None = None) -> tuple[int | None, str]:
    """(threads, why); threads None means leave torch's setting alone (``$OMP_NUM_THREADS`` is set).
    ``reserve``: cores left to the process's other threads (a server's HTTP and detokenizer); by default
    the :func:`serving` context's (none outside it)."""
    pin = pinned_threads()
    if pin is not None:
        return pin
    cpus = available_cpus()
    reserve = getattr(_serving, "reserve", 0) if reserve is None else reserve
    left = f", {reserve} core(s) left to the server's own threads" if reserve else ""
    quota = cgroup_cpu_quota()
    if quota is not None:
        return max(1, usable_cores() - reserve), f"cgroup CPU quota {quota:g}{left}"
    if hint and same_machine_type(built_on):
        return max(1, min(int(hint), cpus - reserve)), f"the build's measurement (same CPU type){left}"
    if cpus - reserve <= 1:
        return 1, "one CPU available" if cpus == 1 else f"{cpus} CPUs{left}"
    rates = measure_threads(sorted({1, max(1, (cpus - reserve) // 2), cpus - reserve})) if reserve else measure_threads()
    best = 1
    for t in sorted(rates):
        if rates[t] > THREADS_MARGIN * rates[best]:
            best = t
    detail = ", ".join(f"{t}: {r} GFLOP/s" for t, r in sorted(rates.items()))
    return best, f"measured at load ({detail}){left}" + (f"; build hint {hint} not used (built on another CPU type)"
                                                         if hint else "")


SERVER_CORES = 1  # cores a server's own threads (HTTP, detokenizer, the engine loop's Python) keep busy
_serving = threading.local()


@contextmanager
def serving(reserve: int = SERVER_CORES):
    """Thread choices made on this thread inside it leave ``reserve`` cores to the server (``kiln serve``'s load).

    Measured with ``bench/contention.py`` on a 2-core Zen 4 (docs/cpu-targets.md): two compute threads beside
    the server's own are slower than one when quiet, and collapse when a neighbour takes a core."""
    before = getattr(_serving, "reserve", 0)
    _serving.reserve = reserve
    try:
        yield
    finally:
        _serving.reserve = before


# OpenMP waits passively: a thread at a barrier sleeps instead of spinning, so a peer descheduled by a neighbour
# (or by the server's own threads) does not cost a spinning core too. Read when libgomp / libiomp load.
OPENMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}


def configure_openmp(env=None) -> dict[str, str]:
    """Set :data:`OPENMP_ENV` in ``env`` (``os.environ``) where unset, only before torch (and its OpenMP) loads:
    later it would change nothing here and only leak into child processes. Returns what it set."""
    env = os.environ if env is None else env
    if "torch" in sys.modules:
        return {}
    done = {k: v for k, v in OPENMP_ENV.items() if not env.get(k)}
    env.update(done)
    return done


def plan_cpu_load(dtype: str, quantization: str | None, kv_cache_dtype: str = "auto",
                  threads_hint: int | None = None, built_on: dict[str, Any] | None = None,
                  apply_threads: bool = True) -> dict[str, Any]:
    """How an artifact of ``dtype``/``quantization`` should run on this CPU (see the module doc)."""
    import torch
    from kiln.engine.kernels import formats  # imports torch: kept out of this module's torch-free import

    plan: dict[str, Any] = {"artifact_dtype": dtype, "dtype": dtype, "kv_cache_dtype": kv_cache_dtype,
                            "host": {"model": cpu_model(), "flags": sorted(f for f in RELEVANT_FLAGS
                                                                           if f in cpu_flags()),
                                     "cpus": available_cpus()}}
    if dtype in OVERRIDE_ENV:
        native = probe(dtype)
        plan["native"] = native
        if not native["native"]:
            plan["dtype"] = "float32"
            if kv_cache_dtype in ("auto", dtype):
                plan["kv_cache_dtype"] = "auto"
            log.warning("this CPU has no native %s matmul (%s); computing in float32 instead: weights are upcast "
                        "once at load (twice the memory of the unquantized weights)", dtype,
                        native.get("how") if native["how"] != "measured"
                        else f"{native['gflops']} vs {native['float32_gflops']} GFLOP/s float32, one thread")
    if kv_cache_dtype in OVERRIDE_ENV and kv_cache_dtype != dtype and not probe(kv_cache_dtype)["native"]:
        plan["kv_cache_dtype"] = "float32"
    if formats.storage(quantization) == torch.int8:  # the candidates; the tactic table picks per bucket
        torch_path = ("int8-weight x bf16 kernel (torch._weight_int8pack_mm)"
                      if plan["dtype"] == "bfloat16" and hasattr(torch, "_weight_int8pack_mm")
                      else f"dequantize to {plan['dtype']} per matmul")
        plan["int8_path"] = f"kiln's int8 GEMM ({plan['dtype']} activations) or torch's {torch_path}, as timed"
    threads, why = choose_threads(threads_hint, built_on)
    if threads is not None and apply_threads:
        torch.set_num_threads(threads)
    plan["threads"] = torch.get_num_threads() if threads is None or apply_threads else threads
    plan["threads_from"] = why
    log.info("CPU target: %s compute%s, %d torch thread(s) (%s)", plan["dtype"],
             f" (artifact {dtype})" if plan["dtype"] != dtype else "", plan["threads"], why)
    return plan
