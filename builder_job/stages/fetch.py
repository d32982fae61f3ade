"""The build's ``fetch`` stage: the target's checkpoint from ``spec.model`` (:mod:`kiln.builder.checkpoint` has
the sources, the pinning and the pickle refusal), its provenance into the report."""

from __future__ import annotations

import logging

from kiln.builder.checkpoint import fetch_checkpoint
from kiln.builder.context import BuildContext

log = logging.getLogger("kiln.build.fetch")


def run(ctx: BuildContext) -> None:
    """The target's checkpoint (already there with ``--prefetched``), its provenance into the report."""
    spec = ctx.spec
    if ctx.checkpoint is None:
        ctx.checkpoint = fetch_checkpoint(spec.model.source, spec.model.revision, ctx.work_dir,
                                          file=spec.model.file)
    ckpt = ctx.checkpoint
    ctx.report.record("source", ckpt.provenance())
    if ckpt.resolved_revision and ckpt.resolved_revision != spec.model.revision:
        log.warning("spec.model.revision %s can move; this build used commit %s (recorded in engine.json); "
                    "pin that sha so the version names one set of weights", spec.model.revision or "main",
                    ckpt.resolved_revision)
