"""The build report: per-stage timings and what each stage found, plus progress logs.

One :class:`BuildReport` travels through the pipeline. ``with report.stage("fetch"):``
logs the stage's start and end with its duration and records the timing; stages
add their findings with :meth:`BuildReport.record`. The finished report goes into
``engine.json`` as ``build_report``; on failure its one-line summary becomes the
termination message the operator shows.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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


class BuildReport:
    """Timings (seconds) per stage and named findings, serialisable to JSON."""

    def __init__(self, engine_version: str) -> None:
        self.engine_version = engine_version
        self.started_at = time.time()
        self.stages: dict[str, float] = {}
        self.findings: dict[str, Any] = {}
        self.current_stage: str | None = None

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self.current_stage = name
        log.info("[%s] start", name)
        t0 = time.perf_counter()
        try:
            yield
        except BaseException:
            self.stages[name] = round(time.perf_counter() - t0, 3)
            log.info("[%s] failed after %.2fs", name, self.stages[name])
            raise
        self.stages[name] = round(time.perf_counter() - t0, 3)
        log.info("[%s] done in %.2fs", name, self.stages[name])
        self.current_stage = None

    def record(self, key: str, value: Any) -> None:
        self.findings[key] = value

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine_version": self.engine_version,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started_at)),
            "total_seconds": round(time.time() - self.started_at, 3),
            "stage_seconds": dict(self.stages),
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
    kv = build_report.get("kv_plan_summary")
    if kv:
        lines.append(f"  kv pool: {kv}")
    return lines
