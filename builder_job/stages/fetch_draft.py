"""The build's ``fetch_draft`` stage: the draft model of ``spec.speculative.draftModel``, fetched like the target.

Runs only with a draft model; :mod:`kiln.builder.draft_model` has the draft's fetch, check and conversion.
"""

from __future__ import annotations

from kiln.builder.context import BuildContext
from kiln.builder.draft_model import fetch_draft


def run(ctx: BuildContext) -> None:
    """The draft's checkpoint (already there with ``--prefetched``), its provenance into the report."""
    if ctx.draft_checkpoint is None:
        ctx.draft_checkpoint = fetch_draft(ctx.spec, ctx.work_dir)
    ctx.report.record("draft_source", ctx.draft_checkpoint.provenance())
