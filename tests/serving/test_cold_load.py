"""A pool's engine unload frees the engine then and there (``EngineSlot.unload``), not at some later collection: an
engine is a web of reference cycles (its runner, hooks, model), and its weights are a mapping of the artifact's
file (``kiln.engine.weights``) that lives as long as the last tensor of it, so an engine kept past ``_close``'s
``gc.collect`` kept its memory counted against the pool's budget until the next load."""

from __future__ import annotations

import asyncio
import weakref
from pathlib import Path
from types import SimpleNamespace

from kiln.serving.config import ServeConfig
from kiln.serving.pool.slot import EngineSlot

from kiln.engine_list import EngineEntry


class CyclicEngine:
    """What ``_close`` calls of an engine, inside a reference cycle as a real one is."""

    is_running = True

    class engine_config:  # noqa: N801 - what ServerState reads of an engine
        max_batch_size = 4

    def __init__(self) -> None:
        self.engine = SimpleNamespace(owner=self)  # the cycle: engine -> LLMEngine -> engine

    async def shutdown(self) -> None:
        pass


def test_an_unloaded_engine_is_freed_before_unload_returns(tmp_path: Path):
    slot = EngineSlot(EngineEntry("m", "file:///store/engines/m-1"), ServeConfig(cache_dir=tmp_path),
                      SimpleNamespace(labels={}))
    engine = CyclicEngine()
    gone = weakref.ref(engine)
    slot.state.engine = engine
    del engine

    async def unload_and_look() -> bool:
        await slot.unload()
        return gone() is None  # before anything else runs: no later collection has had its chance

    assert asyncio.run(unload_and_look()), "the engine outlived its unload (kept until a later collection)"
