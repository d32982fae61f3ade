"""The adapter build's ``convert`` stage: the adapter cast to the engine's dtype into the staged directory, PEFT
layout kept (:func:`kiln.builder.adapter.peft_files.convert_adapter`)."""

from __future__ import annotations

from kiln.builder.adapter.context import AdapterContext
from kiln.builder.adapter.peft_files import convert_adapter


def run(ctx: AdapterContext) -> None:
    ctx.report.record("conversion", convert_adapter(ctx.source_dir, ctx.out, ctx.spec.dtype))
