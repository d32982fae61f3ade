"""``kiln serve`` on a process that is not rank 0: load this process's shard and compute.

A worker serves no HTTP at all (no API, no probes): it joins the leader (waiting up
to ``join_timeout_s`` for it; it proves it holds ``$KILN_GROUP_TOKEN``, the secret every
rank of the group shares, and is refused without it), loads its ranks' weights, and runs the steps the leader
broadcasts until the leader says stop (exit 0) or the group breaks (exit 1): the
leader or another rank is gone, or a collective waited longer than
``distributed_timeout_s``. A LeaderWorkerSet then recreates the whole group; so a
worker needs no liveness probe of its own (it never hangs: every wait is bounded).
"""

from __future__ import annotations

import logging
from typing import Any

from kiln.serving.config import ServeConfig
from kiln.serving.loader import fetch_artifact, placed_engine_kwargs

log = logging.getLogger("kiln.serving")


def run_worker(config: ServeConfig) -> int:
    """Exit code: 0 when the leader stopped the engine, 1 when loading failed or the group broke."""
    try:
        engine_config = _engine_config(config)
    except Exception as exc:  # a bad setting or artifact: one line, no traceback
        log.error("kiln serve (worker %s): could not load the model: %s", config.placement.describe(), exc)
        return 1
    from kiln.engine.workers import run_worker_node

    log.info("worker: ranks %d..%d of %d, joining %s", engine_config.rank_offset,
             engine_config.rank_offset + engine_config.local_ranks - 1, engine_config.world_size,
             engine_config.distributed_address)
    try:
        return run_worker_node(engine_config)
    except ValueError as exc:  # a setting the ranks cannot start with (no $KILN_GROUP_TOKEN): one line
        log.error("kiln serve (worker %s): %s", config.placement.describe(), exc)
        return 1


def _engine_config(config: ServeConfig) -> Any:
    from kiln.engine.config import EngineConfig

    if config.artifact:
        from kiln.engine.artifact import artifact_engine_config

        path = fetch_artifact(config.artifact, config.cache_dir, config.verify_key)
        return artifact_engine_config(path, **placed_engine_kwargs(config, path))
    return EngineConfig(model=str(config.model), **placed_engine_kwargs(config, None))
