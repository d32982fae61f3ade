"""The build's ``plan`` stage: the KV pool for the target (:func:`kiln.builder.kv_plan.plan_kv`) and the
engine's settings (:func:`kiln.builder.engine_settings.engine_config`), staged as a first ``engine.json``
so that the runtime can load the artifact for the stages after it.
"""

from __future__ import annotations

import logging

from kiln.builder.context import BuildContext
from kiln.builder.engine_settings import engine_config
from kiln.builder.kv_plan import kv_plan_summary, plan_kv
from kiln.builder.stages.package import write_engine

log = logging.getLogger("kiln.build")


def run(ctx: BuildContext) -> None:
    """Plan the pool (the draft's K/V beside the target's), set the engine config, stage engine.json."""
    ctx.kv_plan = plan_kv(ctx.spec, ctx.facts, ctx.weights_per_rank,
                          extra_kv_bytes_per_token=ctx.draft_kv_bytes_per_token)
    ctx.report.record("kv_plan_summary", kv_plan_summary(ctx.kv_plan))
    log.info("kv pool: %s", kv_plan_summary(ctx.kv_plan))
    ctx.config = engine_config(ctx.spec, ctx.kv_plan["num_kv_blocks"])
    ctx.plan_build_pool()
    write_engine(ctx)
