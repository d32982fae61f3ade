"""The adapter build's ``fetch`` stage: the PEFT files from ``spec.lora.adapters[i].source`` (already there with
``--prefetched``; :mod:`kiln.builder.adapter.source` has the sources), their provenance into the report."""

from __future__ import annotations

from kiln.builder.adapter.context import AdapterContext
from kiln.builder.adapter.source import adapter_dir, fetch_adapter

from kiln.artifact_manifest import file_sha256


def run(ctx: AdapterContext) -> None:
    adapter = ctx.adapter
    if ctx.prefetched:
        ctx.source_dir = adapter_dir(ctx.work_dir, adapter)
    else:
        ctx.source_dir = fetch_adapter(ctx.engine, ctx.index, adapter, ctx.work_dir, with_base=False)
    files = {p.name: file_sha256(p) for p in sorted(ctx.source_dir.iterdir()) if p.is_file()}
    for key, value in (("kind", "lora-adapter"), ("name", adapter.name), ("source", adapter.source),
                       ("revision", adapter.revision), ("source_files_sha256", files)):
        ctx.report.record(key, value)
