"""The adapter build's ``gate`` stage: the converted adapter against transformers + PEFT with the original, and
kiln's own engine with it in a LoRA slot (:mod:`kiln.builder.adapter.quality`); a failure publishes nothing."""

from __future__ import annotations

import logging

from kiln.builder.adapter.context import AdapterContext
from kiln.builder.adapter.quality import gate_adapter

log = logging.getLogger("kiln.build.adapter")


def run(ctx: AdapterContext) -> None:
    verdict = gate_adapter(ctx.checkpoint.path, ctx.source_dir, ctx.out, ctx.spec, ctx.adapter.name)
    log.info("adapter %s: rank %s on %s, KL %.3g, agreement %.4f", ctx.adapter.name, ctx.config.get("r"),
             ctx.config.get("target_modules"), verdict["kl_divergence"], verdict["token_agreement"])
    ctx.report.record("quality", verdict)
