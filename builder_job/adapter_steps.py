"""The adapter build's work between reading the base and publishing: fetch, check, convert, gate
(:mod:`kiln.builder.adapter_build` is the command around it). Imports torch; the cache-hit path does not."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from kiln.builder.adapter_check import check_adapter, convert_adapter
from kiln.builder.adapter_fetch import adapter_dir, base_checkpoint, fetch_adapter
from kiln.builder.adapter_gate import gate_adapter

from kiln.artifact_manifest import file_sha256

log = logging.getLogger("kiln.build.adapter")


def provenance(adapter, adapter_dir: Path, cfg: dict[str, Any], base: str) -> dict[str, Any]:
    files = {p.name: file_sha256(p) for p in sorted(adapter_dir.iterdir()) if p.is_file()}
    return {"kind": "lora-adapter", "name": adapter.name, "base_engine_version": base, "source": adapter.source,
            "revision": adapter.revision, "source_files_sha256": files, "rank": cfg.get("r"),
            "lora_alpha": cfg.get("lora_alpha"), "target_modules": cfg.get("target_modules")}


def make_artifact(engine, index: int, adapter, base: str, base_cfg: dict[str, Any], work: Path,
                  prefetched: bool) -> tuple[Path, dict[str, Any]]:
    """The adapter's artifact directory (converted PEFT files) and its report (provenance, gate, timings)."""
    spec, field = engine.spec, f"spec.lora.adapters[{index}].source"
    started = time.monotonic()
    source_dir = adapter_dir(work, adapter) if prefetched else fetch_adapter(engine, index, adapter, work, False)
    cfg = check_adapter(source_dir, base_cfg, spec.lora.max_lora_rank, field)
    out = work / f"adapter-artifact-{adapter.name}"
    conversion = convert_adapter(source_dir, out, spec.dtype)
    checkpoint = base_checkpoint(engine, work, prefetched)
    verdict = gate_adapter(checkpoint.path, source_dir, out, spec, adapter.name)
    log.info("adapter %s: rank %s on %s, KL %.3g, agreement %.4f", adapter.name, cfg.get("r"),
             cfg.get("target_modules"), verdict["kl_divergence"], verdict["token_agreement"])
    report = {**provenance(adapter, source_dir, cfg, base), "conversion": conversion, "quality": verdict,
              "seconds": round(time.monotonic() - started, 3)}
    return out, report
