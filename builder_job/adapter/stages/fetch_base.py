"""The adapter build's ``fetch_base`` stage: the base checkpoint the gate compares with (what ``--fetch-only``
left, or fetched now; a local source is read in place). After ``check``, so a misfit adapter fails before a
download that can take an hour."""

from __future__ import annotations

from kiln.builder.adapter.context import AdapterContext
from kiln.builder.adapter.source import base_checkpoint


def run(ctx: AdapterContext) -> None:
    ctx.checkpoint = base_checkpoint(ctx.engine, ctx.work_dir, ctx.prefetched)
