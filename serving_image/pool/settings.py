"""``kiln serve``'s pool flags, as the pool reads them (docs/pools.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kiln.engine_list import EngineEntry


@dataclass
class PoolSettings:
    """``kiln serve``'s pool flags (docs/pools.md)."""

    engines: dict[str, EngineEntry] = field(default_factory=dict)  # --engine NAME=URI
    engines_file: Path | None = None  # --engines-file, followed while serving
    max_loaded_engines: int | None = None
    memory_budget: int | None = None  # bytes; None: default_budget()
    idle_unload_after: float | None = None  # seconds; None: never
    queue_size: int = 64
    load_timeout: float = 300.0
    retry_after_s: int = 1
