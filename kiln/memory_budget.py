"""What an engine pool may fill and what each engine counts against it (the pool runtime and the operator alike).

The budget is ``--memory-budget`` (a Kubernetes quantity, ``6Gi``), else the container's cgroup memory limit,
else the host's memory, less a margin for the server itself (:data:`SERVER_MARGIN_BYTES`) and a fraction for
what a load touches beyond its steady state (:data:`MARGIN_FRACTION`).

An engine counts its *measured* memory: the build's ``tune`` stage loads the artifact through the runtime and
measures it (``build_report.memory.stages.tune``: the CUDA allocator's peak on a GPU, the RSS the load added on a
CPU). An artifact without that record counts its KV plan instead (weights + KV pool + activation reserve), and
says so (``source``). Where the plan is the larger it is counted: the tune stage's short runs never touch most
of the KV pool, whose pages a busy engine does fill (SmolLM2 GGUF: 0.64 GiB measured, 1.24 GiB planned, and a
loaded engine added 1.15 GiB to a server's RSS after a one-token request).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

MARGIN_FRACTION = 0.1
# The server, torch and the tokenizers, beside the engines: a pool with no engine loaded was 0.59 GiB resident
# (PyPI's torch 2.13 on a CPU host; kiln bench --pool), above the 512 MiB this was.
SERVER_MARGIN_BYTES = 768 * 2**20

_SUFFIXES = {"": 1, "m": 1e-3, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
# Kubernetes' resource.Quantity (unsigned: a resource or a budget is never negative): a decimal number, then a
# binary-SI suffix (Ki..Ei), a decimal-SI one (m, k..E) or a decimal exponent (e9); ASCII digits only, as Go's
# regexp reads [0-9]. The one rule: the operator checks a pod's resources by it, parse_quantity reads memory by it,
# and a pool's spec.memoryBudget has it as its pattern (QUANTITY_PATTERN: the CRD's and pydantic's, whose regex
# engines end `$` at the end of the text; Python's `$` would also match before a trailing newline, so QUANTITY ends
# at `\Z`).
_QUANTITY = r"\+?([0-9]+\.?[0-9]*|\.[0-9]+)([KMGTPE]i|[mkMGTPE]|[eE][+-]?[0-9]+)?"
QUANTITY_PATTERN = f"^{_QUANTITY}$"
QUANTITY = re.compile(rf"^{_QUANTITY}\Z")


def parse_quantity(text: str, name: str = "--memory-budget") -> int:
    """Bytes of a Kubernetes memory quantity (``6Gi``, ``512Mi``, ``8G``, ``1000000``); ValueError naming ``name``."""
    match = QUANTITY.match(str(text).strip())
    if match is None:
        raise ValueError(f"{name} {text!r} is not a memory quantity; write it as Kubernetes does, e.g. 6Gi, 512Mi "
                         "or 8G")
    digits, suffix = match.group(1), match.group(2) or ""
    exponent = suffix not in _SUFFIXES  # 1e9: the number with its exponent (1e400 is inf, refused below); E is exa
    number = float(digits + suffix) if exponent else float(digits) * _SUFFIXES[suffix]
    if not math.isfinite(number):  # 1e400: no number of bytes (math.ceil would raise OverflowError)
        raise ValueError(f"{name} {text!r} is too large to be a number of bytes; e.g. 6Gi")
    value = math.ceil(number)  # milli-bytes round up, as Kubernetes
    if value <= 0:
        raise ValueError(f"{name} {text!r} must be more than zero bytes; e.g. 6Gi")
    return value


def proc_status_bytes(field: str) -> int | None:
    """A memory field of this process's ``/proc/self/status`` in bytes (``VmRSS``: resident now, ``VmHWM``: its
    peak), None where there is no ``/proc`` or no such field."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    m = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) * 1024 if m else None


def human(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


def budget_of(total: int, source: str) -> tuple[int, str]:
    """(bytes, where from) the engines of a pod with ``total`` bytes may count: ``total`` less the margins."""
    budget = int(total * (1 - MARGIN_FRACTION)) - SERVER_MARGIN_BYTES
    return max(budget, 0), f"{source} ({human(total)}) less {MARGIN_FRACTION:.0%} and {human(SERVER_MARGIN_BYTES)}"


def _object(doc: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    """``doc[path[0]][path[1]]...``, each an object (a missing or null one: empty); ValueError naming the field."""
    node: Any = doc
    for i, key in enumerate(path):
        node = node.get(key)
        if node is None:
            return {}
        if not isinstance(node, dict):
            raise ValueError(f"{'.'.join(path[:i + 1])} is a {type(node).__name__}, not an object; rebuild it with "
                             "this kiln")
    return node


def engine_memory(engine_json: Any) -> tuple[int, str]:
    """(bytes, source) an engine counts against the budget, from its artifact's ``engine.json``; ValueError naming
    the field for one that is not what a build writes."""
    if not isinstance(engine_json, dict):
        raise ValueError(f"it is a {type(engine_json).__name__}, not an object; rebuild it with this kiln")
    tune = _object(engine_json, ("build_report", "memory", "stages", "tune"))
    device = _object(engine_json, ("tuning",)).get("device") or "cpu"
    measured = tune.get("cuda_peak_allocated_bytes") if device == "cuda" else tune.get("host_extra_bytes")
    plan = _object(engine_json, ("kv_plan",))
    parts = [plan.get(k) for k in ("weight_bytes_per_rank", "kv_pool_bytes", "activation_reserve_bytes")]
    planned = sum(p if isinstance(p, int) else 0 for p in parts) if all(isinstance(p, int) for p in parts[:2]) \
        else None
    if isinstance(measured, int) and measured > 0:
        if planned is not None and planned > measured:
            return planned, (f"its kv_plan (weights + KV pool), above the {human(measured)} its build measured "
                             "(build_report.memory.stages.tune) with the KV pool mostly untouched")
        return measured, "measured by the build (build_report.memory.stages.tune)"
    if planned is not None:
        return planned, "not measured by its build: weights + KV pool of its kv_plan"
    raise ValueError(f"engine {engine_json.get('engine_version')!r} records neither a measured memory "
                     "(build_report.memory.stages.tune) nor a kv_plan; rebuild it with this kiln")
