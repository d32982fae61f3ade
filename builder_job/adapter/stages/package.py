"""The adapter build's ``package`` stage: ``adapter.json`` (provenance, conversion, gate, and the report's stage
timings so far) beside the converted PEFT files, as ``engine.json`` is beside an engine's."""

from __future__ import annotations

import json

from kiln.builder.adapter.context import AdapterContext


def run(ctx: AdapterContext) -> None:
    ctx.document = ctx.report.to_dict()
    (ctx.out / "adapter.json").write_text(json.dumps(ctx.document, indent=2, sort_keys=True, default=str) + "\n")
