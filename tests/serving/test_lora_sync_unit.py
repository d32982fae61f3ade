"""The adapter follower (serving_image/lora_sync.py) against the operator's file changing between and during its
passes (issue 38, the update race): whatever order the passes run in and however long an engine's removal stays
queued, the server ends holding exactly what the file lists last, and the follower waits for the engine's version
before its first tick."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from kiln.serving import lora_sync
from kiln.serving.lora import LoRARegistry
from kiln.serving.lora_sync import AdapterSync

BASE = "base-v1"


class QueuedRemovalEngine:
    """An engine whose removals run later, on its step thread (AsyncLLM queues them): ``release`` lets them."""

    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}
        self.release = asyncio.Event()

    def list_loras(self) -> list[str]:
        return list(self.loaded)

    async def add_lora(self, lora) -> bool:
        await asyncio.sleep(0)
        self.loaded[lora.lora_name] = lora.lora_path
        return True

    async def remove_lora(self, name: str) -> bool:
        await self.release.wait()
        return self.loaded.pop(name, None) is not None


def _write(path, *adapters):
    entries = [{"name": name, "artifactURI": uri, "version": uri, "baseEngineVersion": BASE}
               for name, uri in adapters]
    path.write_text(json.dumps({"format": 1, "adapters": entries}))


@pytest.fixture
def follower(tmp_path, monkeypatch):
    async def fetched(fn):  # the store: an artifact URI is its own folder
        return fn()

    monkeypatch.setattr("kiln.serving.loader.in_daemon_thread", fetched)
    monkeypatch.setattr("kiln.serving.loader.fetch_artifact", lambda uri, *a, **k: uri)

    def make(engine):
        ctx = SimpleNamespace(state=SimpleNamespace(engine=engine, engine_info={}), model_names={"base"},
                              metrics=SimpleNamespace(lora_loaded=lambda s: None),
                              config=SimpleNamespace(cache_dir=tmp_path / "cache", verify_key=None))
        ctx.loras = LoRARegistry(ctx)
        return ctx, AdapterSync(ctx, tmp_path / "adapters.json")
    return make


def test_a_replacement_whose_removal_is_queued_ends_at_the_file_listed_last(tmp_path, follower):
    async def main() -> None:
        engine = QueuedRemovalEngine()
        ctx, sync = follower(engine)
        path = tmp_path / "adapters.json"
        _write(path, ("sql", "store/sql-a"))
        engine.release.set()
        await sync.sync(BASE)
        assert engine.loaded == {"sql": "store/sql-a"}
        engine.release.clear()
        _write(path, ("sql", "store/sql-b"))  # replaced under the same name: the removal of a waits in the engine
        first = asyncio.create_task(sync.sync(BASE))
        await asyncio.sleep(0.01)
        path.write_text(json.dumps({"format": 1, "adapters": []}))  # ... and removed before the next pass
        second = asyncio.create_task(sync.sync(BASE))
        await asyncio.sleep(0.01)
        engine.release.set()
        await asyncio.gather(first, second)
        assert engine.loaded == {} and ctx.loras.adapters == {} and sync.held == {}
        _write(path, ("sql", "store/sql-c"))  # re-added: the new version is served
        await sync.sync(BASE)
        assert engine.loaded == {"sql": "store/sql-c"} and sync.held == {"sql": "store/sql-c"}
    asyncio.run(main())


def test_the_follower_ticks_only_once_the_engine_version_is_known(tmp_path, follower, monkeypatch):
    async def main() -> None:
        engine = QueuedRemovalEngine()
        engine.release.set()
        ctx, sync = follower(engine)
        _write(tmp_path / "adapters.json", ("sql", "store/sql-a"))
        seen: list[str | None] = []

        async def record(version):
            seen.append(version)

        monkeypatch.setattr(lora_sync, "POLL_S", 0.001)
        monkeypatch.setattr(sync, "sync", record)
        task = asyncio.create_task(sync.run())
        await asyncio.sleep(0.05)  # loading: ServerState.engine_info is {} until the load finishes
        assert seen == []
        ctx.state.engine_info = {"engine_version": BASE}
        await asyncio.sleep(0.05)
        task.cancel()
        assert seen and set(seen) == {BASE}
    asyncio.run(main())
