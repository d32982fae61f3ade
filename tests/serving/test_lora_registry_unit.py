"""The server's adapter registry loads an evicted adapter only while it is still the one registered under its
name (issue 38, Med 9): an unload, or an unload and a reload of a new version, between a request's lookup and
its load never brings the old version back into the engine."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from kiln.serving.errors import APIError
from kiln.serving.lora import LoRARegistry


class FakeEngine:
    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}

    def list_loras(self) -> list[str]:
        return list(self.loaded)

    async def add_lora(self, lora) -> bool:
        await asyncio.sleep(0)
        self.loaded[lora.lora_name] = lora.lora_path
        return True

    async def remove_lora(self, name: str) -> bool:
        return self.loaded.pop(name, None) is not None


def test_a_stale_lookup_never_loads_the_old_version():
    async def main() -> None:
        engine = FakeEngine()
        ctx = SimpleNamespace(state=SimpleNamespace(engine=engine), model_names={"base"},
                              metrics=SimpleNamespace(lora_loaded=lambda s: None))
        registry = LoRARegistry(ctx)
        await registry.add("one", "/adapters/v1")
        old = registry.get("one")  # a request looked it up ...
        engine.loaded.clear()  # ... it was evicted from host memory (LRU) ...
        await registry.remove("one")  # ... and the operator's sync replaced it
        await registry.add("one", "/adapters/v2")
        engine.loaded.clear()
        with pytest.raises(APIError, match="'one' was unloaded") as info:
            await registry.ensure_loaded(old)
        assert info.value.status == 404 and engine.loaded == {}
        await registry.ensure_loaded(registry.get("one"))
        assert engine.loaded == {"one": "/adapters/v2"}
    asyncio.run(main())

