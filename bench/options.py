"""``kiln bench``'s options as one settings object: the click options fill it once, and every mode reads it,
so a mode's function takes the settings and what was resolved from them, not thirty parameters."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class BenchOptions:
    """One field per ``kiln bench`` option, named as click names it (``--json`` is ``json_out``)."""

    num_requests: int | None
    seed: int
    arrival_rate: float | None
    shared_prefix: int
    preset: str | None
    model_dir: Path | None
    dtype: str
    threads: int | None
    device: str
    repeats: int
    systems: str
    baselines: str
    max_batch_size: int
    max_num_tokens: int
    check_requests: int | None
    max_isa: str | None
    json_out: str | None
    quick: bool
    strict: bool
    structured: bool
    lora: int | None
    gguf: Path | None
    server: bool
    concurrency: str
    isl: int
    osl: int
    endpoints: str
    speculative: bool
    draft_model: Path | None
    draft_layers: int | None
    pair_scale: float | None

    @property
    def peer_names(self) -> list[str]:
        return [b.strip() for b in self.baselines.split(",") if b.strip()]

    @property
    def json_file(self) -> Path | None:
        """Where ``--json`` writes a file (None for stdout, ``-``, or no JSON)."""
        return Path(self.json_out) if self.json_out and self.json_out != "-" else None
