"""The build report: per-stage timings, peak memory and what each stage found, plus progress logs.

One :class:`BuildReport` travels through the pipeline. ``with report.stage("fetch"):``
logs the stage's start and end with its duration and peak memory and records both;
stages add their findings with :meth:`BuildReport.record`. The finished report goes
into ``engine.json`` as ``build_report``; on failure its one-line summary becomes the
termination message the operator shows.

Peak memory per stage (``memory``): the host's is the process's peak resident set
(``VmHWM``), reset at each stage start through ``/proc/self/clear_refs`` so that it is
the stage's own peak (``host_peak_scope: "stage"``); where that reset is not possible
(not Linux) it is the peak since the process started (``"process"``). ``host_extra_bytes``
is that peak minus the RSS at the stage's start: what the stage itself added. On CUDA,
``torch.cuda.max_memory_allocated`` (reset per stage) of this process's device. Worker
processes (tensor-parallel ranks) are not in these figures; the finished report adds
``children_peak_rss_bytes``, the largest of them that has exited.
"""

from __future__ import annotations

import logging
import os
import platform
import resource
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kiln.memory_budget import proc_status_bytes

log = logging.getLogger("kiln.build")

# Kubernetes reads a container's termination message from this path by default.
TERMINATION_LOG_ENV = "KILN_TERMINATION_LOG"
DEFAULT_TERMINATION_LOG = "/dev/termination-log"
TERMINATION_MESSAGE_LIMIT = 4096


def setup_logging(verbose: bool = False) -> None:
    """Timestamped progress lines on stderr (a Job's log)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger("kiln")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.propagate = False


def _reset_host_peak() -> bool:
    """Start a new peak-RSS window (Linux >= 4.0); False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _maxrss_bytes(who: int) -> int:
    kib_or_bytes = resource.getrusage(who).ru_maxrss
    return kib_or_bytes if sys.platform == "darwin" else kib_or_bytes * 1024


def _cuda_in_use():
    """torch, if this process has already initialised CUDA (the report never imports torch itself)."""
    torch = sys.modules.get("torch")
    return torch if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized() else None


class StageMemory:
    """Peak memory of one stage: host RSS (see the module doc) and, on CUDA, the allocator's peak."""

    def __init__(self) -> None:
        self.is_stage_scoped = _reset_host_peak()
        self.host_start = proc_status_bytes("VmRSS") or 0
        torch = _cuda_in_use()
        if torch is not None:
            torch.cuda.reset_peak_memory_stats()

    def finish(self) -> dict[str, Any]:
        peak = proc_status_bytes("VmHWM") if self.is_stage_scoped else _maxrss_bytes(resource.RUSAGE_SELF)
        out = {"host_peak_rss_bytes": peak, "host_start_rss_bytes": self.host_start,
               "host_extra_bytes": max(0, peak - self.host_start),
               "host_peak_scope": "stage" if self.is_stage_scoped else "process"}
        torch = _cuda_in_use()
        if torch is not None:
            out["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        return out


class BuildReport:
    """Timings (seconds) and peak memory per stage and named findings, serialisable to JSON."""

    def __init__(self, engine_version: str) -> None:
        self.engine_version = engine_version
        self.started_at = time.time()
        self.stages: dict[str, float] = {}
        self.memory: dict[str, dict[str, Any]] = {}
        self.findings: dict[str, Any] = {}
        self.current_stage: str | None = None

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self.current_stage = name
        log.info("[%s] start", name)
        memory = StageMemory()
        t0 = time.perf_counter()
        try:
            yield
        except BaseException:
            self.stages[name] = round(time.perf_counter() - t0, 3)
            self.memory[name] = memory.finish()
            log.info("[%s] failed after %.2fs", name, self.stages[name])
            raise
        self.stages[name] = round(time.perf_counter() - t0, 3)
        self.memory[name] = mem = memory.finish()
        cuda = mem.get("cuda_peak_allocated_bytes")
        log.info("[%s] done in %.2fs, peak RSS %s (+%s)%s", name, self.stages[name],
                 human_bytes(mem["host_peak_rss_bytes"]), human_bytes(mem["host_extra_bytes"]),
                 "" if cuda is None else f", CUDA peak {human_bytes(cuda)}")
        self.current_stage = None

    def record(self, key: str, value: Any) -> None:
        self.findings[key] = value

    def memory_summary(self) -> dict[str, Any]:
        """Per-stage peaks, the build's largest, and the largest exited worker process's."""
        out: dict[str, Any] = {"stages": {k: dict(v) for k, v in self.memory.items()}}
        if self.memory:
            top = max(self.memory, key=lambda k: self.memory[k]["host_peak_rss_bytes"])
            out.update(peak_host_rss_bytes=self.memory[top]["host_peak_rss_bytes"], peak_host_rss_stage=top)
            cuda = {k: v["cuda_peak_allocated_bytes"] for k, v in self.memory.items()
                    if "cuda_peak_allocated_bytes" in v}
            if cuda:
                top = max(cuda, key=cuda.__getitem__)
                out.update(peak_cuda_allocated_bytes=cuda[top], peak_cuda_allocated_stage=top)
        out["children_peak_rss_bytes"] = _maxrss_bytes(resource.RUSAGE_CHILDREN)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine_version": self.engine_version,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started_at)),
            "total_seconds": round(time.time() - self.started_at, 3),
            "stage_seconds": dict(self.stages),
            "memory": self.memory_summary(),
            "build_host": {"platform": platform.platform(), "python": platform.python_version(),
                           "cpu_count": os.cpu_count()},
            **self.findings,
        }


def write_termination_message(message: str) -> Path | None:
    """Write ``message`` where Kubernetes looks for it; silently skip if not writable.

    The path is ``$KILN_TERMINATION_LOG`` or ``/dev/termination-log``; outside a
    pod the default usually does not exist, and that is fine.
    """
    path = Path(os.environ.get(TERMINATION_LOG_ENV, DEFAULT_TERMINATION_LOG))
    data = message.encode("utf-8")[:TERMINATION_MESSAGE_LIMIT].decode("utf-8", "ignore")
    try:
        if not path.parent.is_dir():
            return None
        path.write_text(data)
    except OSError:
        return None
    return path


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def summary_lines(build_report: dict[str, Any]) -> list[str]:
    """A few human lines for `kiln up`/`make demo` from an ``engine.json`` build report."""
    lines = [f"engine {build_report.get('engine_version')}: built in {build_report.get('total_seconds', 0):.1f}s"]
    stages = build_report.get("stage_seconds", {})
    if stages:
        lines.append("  stages: " + ", ".join(f"{k} {v:.2f}s" for k, v in stages.items()))
    q = build_report.get("quality")
    if q:
        lines.append(
            f"  quality gate: KL {q['kl_divergence']:.2e} (max {q['max_kl_divergence']}), "
            f"greedy agreement {q['token_agreement']:.3f} (min {q['min_token_agreement']}), "
            f"{'passed' if q['passed'] else 'FAILED'}"
        )
    sizes = build_report.get("sizes")
    if sizes:
        lines.append(f"  weights: {human_bytes(sizes['source_weight_bytes'])} source -> "
                     f"{human_bytes(sizes['artifact_weight_bytes'])} artifact")
    memory = build_report.get("memory") or {}
    if "peak_host_rss_bytes" in memory:
        line = (f"  peak memory: host RSS {human_bytes(memory['peak_host_rss_bytes'])} "
                f"({memory['peak_host_rss_stage']})")
        if "peak_cuda_allocated_bytes" in memory:
            line += (f", CUDA allocated {human_bytes(memory['peak_cuda_allocated_bytes'])} "
                     f"({memory['peak_cuda_allocated_stage']})")
        lines.append(line)
    kv = build_report.get("kv_plan_summary")
    if kv:
        lines.append(f"  kv pool: {kv}")
    tactics = build_report.get("tactics") or {}
    if tactics.get("timed"):
        lines.append(f"  tactics ({tactics['seconds']:.1f}s of linear timings; tactics.json has every time):")
        lines += [f"    {line}" for line in tactics.get("summary", [])]
    elif tactics:
        lines.append(f"  tactics: {tactics.get('why')}")
    speculative = build_report.get("speculative")
    if speculative:
        table = ", ".join(f"{b}: {f'k={k}' if k else 'off'}" for b, k in speculative["by_batch"].items())
        lines.append(f"  speculative ({speculative['method']}, {speculative['seconds']:.1f}s), by running batch: "
                     + table + ("" if speculative.get("greedy_equal", True) else f" ({speculative['mismatch']})"))
        lines += [f"    {line}" for line in speculative.get("summary", [])]
    return lines
