"""The adapter build's ``check`` stage: the adapter against the base's ``config.json`` and ``maxLoraRank``
(:func:`kiln.builder.adapter.peft_files.check_adapter`: every problem names ``spec.lora.adapters[i].source``)."""

from __future__ import annotations

from kiln.builder.adapter.context import AdapterContext
from kiln.builder.adapter.peft_files import check_adapter


def run(ctx: AdapterContext) -> None:
    ctx.config = cfg = check_adapter(ctx.source_dir, ctx.base_config, ctx.spec.lora.max_lora_rank, ctx.source_field)
    for key in ("rank", "lora_alpha", "target_modules"):
        ctx.report.record(key, cfg.get("r" if key == "rank" else key))
