"""The engine's side of LoRA: loaded adapters (``store``), device-slot policy (``slots``), and what the server
shows of them. ``LLMEngine`` holds one when ``enable_lora`` is set."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kiln.engine.block_manager import BlockManager
from kiln.engine.errors import RequestError
from kiln.engine.lora.adapter import LoRAAdapter
from kiln.engine.lora.config import LoRAConfig
from kiln.engine.lora.request import LoRARequest
from kiln.engine.lora.slots import SlotTable
from kiln.engine.lora.store import AdapterStore
from kiln.engine.scheduler import Scheduler
from kiln.engine.sequence import Request


class LoRAManager:
    def __init__(self, lora: LoRAConfig, hf_config: dict[str, Any], in_use: Callable[[], set[int]]) -> None:
        """``lora``: the engine's LoRA view (``EngineConfig.lora_config``, its defaults resolved there)."""
        self.config = lora
        self.store = AdapterStore(hf_config, lora.max_rank, lora.max_cpu_loras, lora.dtype, in_use)
        self.slots = SlotTable(lora.max_loras)

    def resolve(self, lora: object) -> LoRAAdapter:
        """The loaded adapter a request asks for (read from disk if it is not in host memory)."""
        if not isinstance(lora, LoRARequest):
            raise RequestError("lora_request", f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        return self.store.load(lora)

    def remove(self, name: str, block_manager: BlockManager, held: list[LoRAAdapter]) -> bool:
        """Forget an adapter, resident in host memory or not: new requests cannot name it, the prefix-cache
        blocks of every version loaded under the name are dropped, its idle device slots are emptied;
        requests already under it (``held``: the adapters of waiting and running requests) finish with it
        and publish no more blocks. Call on the thread that steps the engine."""
        adapter, digests = self.store.remove(name)
        versions = [a for a in held if a.name == name] + ([adapter] if adapter is not None else [])
        for version in versions:
            version.removed = True
            digests.add(version.digest)
        for digest in digests:
            block_manager.forget_adapter(digest)
        self.slots.forget({a.int_id for a in versions})
        return bool(versions) or bool(digests)

    def info(self, running: list[Request], waiting: list[Request]) -> dict[str, Any]:
        """vLLM's ``lora_requests_info`` labels plus the adapters loaded in host memory."""
        def names(reqs: list[Request]) -> list[str]:
            return sorted({r.lora.name for r in reqs if r.lora is not None})

        return {"running": names(running), "waiting": names(waiting), "max_lora": self.config.max_loras,
                "loaded": [{"name": a.name, "path": a.path, "rank": a.rank, "target_modules": a.target_modules,
                            "bytes": a.nbytes, "load_seconds": round(a.load_seconds, 4)}
                           for a in self.store.adapters()]}


def lora_disabled() -> RequestError:
    return RequestError("model", "this engine serves no LoRA adapters: start it with enable_lora=True "
                                 "(kiln serve --enable-lora)", code="lora_disabled")


class LoRAEngineMixin:
    """``LLMEngine``'s adapter methods, vLLM's names (``self.lora``: a LoRAManager or None)."""

    lora: LoRAManager | None
    block_manager: BlockManager
    scheduler: Scheduler
    requests: dict[str, Request]

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter into host memory (any thread); raises RequestError naming the field."""
        if self.lora is None:
            raise lora_disabled()
        self.lora.resolve(lora_request)
        return True

    def remove_lora(self, name: str) -> bool:
        """Unload an adapter (call on the thread that steps); requests under it finish with it."""
        if self.lora is None:
            return False
        held = [r.lora for r in list(self.requests.values()) if r.lora is not None]
        return self.lora.remove(name, self.block_manager, held)

    def list_loras(self) -> list[str]:
        return [] if self.lora is None else self.lora.store.names()

    def lora_digest(self, name: str) -> str | None:
        """The content digest of the adapter loaded as ``name`` now (its prefix-cache root), or None."""
        adapter = None if self.lora is None else self.lora.store.get(name)
        return None if adapter is None else adapter.digest

    def lora_info(self) -> dict[str, Any] | None:
        """Running/waiting adapters and those loaded (metrics, /v1/models); None with LoRA off."""
        if self.lora is None:
            return None
        return self.lora.info(list(self.scheduler.running), list(self.scheduler.waiting))

    def _adapters_in_use(self) -> set[int]:
        return {r.lora.int_id for r in list(self.requests.values()) if r.lora is not None}
