"""The pool's default budget on this host: the container's cgroup memory limit, else the host's memory, less the
margins :mod:`kiln.memory_budget` defines (with what an engine counts against it, which the operator shares)."""

from __future__ import annotations

import os
from pathlib import Path

from kiln.memory_budget import budget_of

CGROUP_V2_MEMORY = Path("/sys/fs/cgroup/memory.max")
CGROUP_V1_MEMORY = Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")
_UNLIMITED_V1 = 2**60  # cgroup v1 spells "no limit" as a huge number


def cgroup_memory_limit(v2: Path = CGROUP_V2_MEMORY, v1: Path = CGROUP_V1_MEMORY) -> int | None:
    """The container's memory limit in bytes (cgroup v2 ``memory.max`` or v1), None when unlimited or unknown."""
    for path in (v2, v1):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < _UNLIMITED_V1:
            return int(text)
        return None
    return None


def host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_budget(limit: int | None = None, host: int | None = None) -> tuple[int, str]:
    """(bytes, where from): the cgroup limit, else the host's memory, less the margins."""
    limit = cgroup_memory_limit() if limit is None else limit
    total, source = (limit, "the cgroup memory limit") if limit else (host or host_memory(), "the host's memory")
    return budget_of(total, source)
