"""Several engines behind one server: each loaded on the first request that names it, evicted least recently
used when another needs its room, unloaded when idle (docs/pools.md).

Placement, in one place (:meth:`EnginePool._room_for`): the engines loaded, loading or unloading count their
memory against the budget (``--memory-budget``) and their number against ``--max-loaded-engines``; a request
for an engine that is not loaded evicts the least recently used idle engines until the new one fits. An engine
with requests in flight, or waiting for it, is never evicted: when nothing can make room the request waits in a
bounded queue (``--pool-queue-size``) for a change (a request finishing, a load or unload ending) until
``--load-timeout``; past either it gets 503 with Retry-After. Loads and unloads run as tasks that every request
waiting on the engine shares; the decisions are made on the event loop, so no two of them race.

A request's engine is returned loaded and the request path admits the request (``ServerState.admit``) before it
next yields to the loop: from then on its admission is what keeps the engine from being evicted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

from kiln.serving.config import ServeConfig
from kiln.serving.errors import APIError
from kiln.serving.lora_sync import RETRY_S, adapters_file
from kiln.serving.pool.budget import default_budget
from kiln.serving.pool.counts import PoolCounts
from kiln.serving.pool.metrics import PoolMetrics
from kiln.serving.pool.settings import PoolSettings
from kiln.serving.pool.slot import LOADED, UNLOADED, UNLOADING, EngineSlot
from kiln.serving.server_state import LOADING

from kiln.adapter_list import wanted
from kiln.engine_list import EngineEntry
from kiln.memory_budget import human, proc_status_bytes

log = logging.getLogger("kiln.serving")


class EnginePool(PoolCounts):
    def __init__(self, settings: PoolSettings, base: ServeConfig, metrics: Any) -> None:
        self.settings, self.base, self.metrics = settings, base, metrics
        self.slots: dict[str, EngineSlot] = {}
        if settings.memory_budget is not None:
            self.budget, self.budget_source = settings.memory_budget, "--memory-budget"
        else:
            self.budget, self.budget_source = default_budget()
        self.num_queued = 0
        self.leaving: list[EngineSlot] = []  # removed from the list, not yet unloaded: their memory still counts
        self._changed = asyncio.Event()
        self._changes, self._loaded_once = 0, False  # loads and unloads started; any load done (_quiet_rss)
        self.pool_metrics = PoolMetrics(metrics.registry, self)
        self.follower: Any = None  # follow.EngineFileFollower where --engines-file is given

    # -- the engines ---------------------------------------------------------------------------------------
    def make_slot(self, entry: EngineEntry) -> EngineSlot:
        """A slot for ``entry`` with its memory read; ValueError when it cannot fit the budget on its own."""
        slot = EngineSlot(entry, self.base, self.metrics)
        slot.state.on_idle = lambda: self._released(slot)
        slot.read_memory()
        if slot.memory_bytes > self.budget:
            raise ValueError(self.too_big(slot))
        log.info("pool: engine %r (%s) counts %s, %s", entry.name, entry.artifact_uri, human(slot.memory_bytes),
                 slot.memory_source)
        return slot

    def add(self, slot: EngineSlot) -> None:
        self.slots[slot.name] = slot
        self.notify()

    def slot_for(self, model: str) -> EngineSlot | None:
        """The engine ``model`` names, or the engine that serves the LoRA adapter of that name: a loaded one that
        holds it, else the one the adapter list names as its base (loaded, it loads the adapter)."""
        slot = self.slots.get(model)
        if slot is None:
            slot = next((s for s in self.slots.values() if s.status == LOADED and s.loras.get(model)), None)
        return slot or self._adapter_base(model)

    def _adapter_base(self, model: str) -> EngineSlot | None:
        path = adapters_file()
        try:
            doc = json.loads(path.read_bytes()) if path is not None else None
        except (OSError, ValueError):
            return None
        return next((s for s in self.slots.values() if model in wanted(doc, s.version)), None)

    # -- placing a request ---------------------------------------------------------------------------------
    async def acquire(self, model: str) -> EngineSlot:
        """The loaded engine for ``model``: 404 for a name the pool does not serve, 503 when it cannot be placed. A
        request whose engine left the list while it waited looks its name up once more: an adapter of that name,
        left out while the engine had it, is served again (docs/pools.md)."""
        for _ in range(2):
            slot = self.slot_for(model)
            if slot is None and self.follower is not None:  # an engine the file lists since the follower's last pass
                await self.follower.sync()
                slot = self.slot_for(model)
            if slot is None:
                break
            if await self._placed(slot) and await self._knows(slot, model):
                return slot
        raise self.not_found(model)

    async def _knows(self, slot: EngineSlot, model: str) -> bool:
        """Whether ``slot``, loaded, may answer ``model``: its own name, or an adapter its registry holds, or one the
        adapter list names for it since its last adapter pass (read in by one pass now, the engine kept from eviction
        meanwhile: an adapter named as an engine that just left). False: the engine was removed meanwhile."""
        if model == slot.name or slot.loras.get(model) is not None or slot.adapter_sync is None:
            return True
        slot.num_waiting += 1
        try:
            await slot.adapter_sync.sync((slot.state.engine_info or {}).get("engine_version"))
        finally:
            slot.num_waiting -= 1
            self.notify()
        return slot.status == LOADED and self.slots.get(slot.name) is slot

    async def _placed(self, slot: EngineSlot) -> bool:
        """``slot`` loaded, within ``--load-timeout``; False when it was removed from the list meanwhile."""
        slot.last_used = time.monotonic()
        if slot.status == LOADED and not getattr(slot.state.engine, "is_running", True):
            log.error("pool: engine %r: its step loop failed; unloading it to load it anew", slot.name)
            self.start_unload(slot, "failed")
        if slot.status == LOADED:
            return True
        slot.num_waiting += 1
        try:
            async with asyncio.timeout(self.settings.load_timeout):
                await self._place(slot)
        except _Removed:
            return False
        except TimeoutError:
            raise self._busy(f"the engine {slot.name!r} could not be loaded within --load-timeout "
                             f"{self.settings.load_timeout:g}s", "load_timeout") from None
        finally:
            slot.num_waiting -= 1
            if slot.num_waiting == 0:
                self.notify()  # a removal (or a drain) may be waiting for the engine's last waiter
        slot.last_used = time.monotonic()
        return self.slots.get(slot.name) is slot

    async def _place(self, slot: EngineSlot) -> None:
        while slot.status != LOADED:
            if self.slots.get(slot.name) is not slot:  # removed while this request waited: never load it again
                raise _Removed
            if slot.task is not None:  # a load or unload under way: wait for it with the others
                loading = slot.status == LOADING  # an unload that failed is no load failure, whatever came before
                try:
                    await asyncio.shield(slot.task)
                except asyncio.CancelledError:
                    if asyncio.current_task().cancelling():  # this request itself (or its --load-timeout)
                        raise
                    raise self._busy(f"the server is shutting down while the engine {slot.name!r} was loading; "
                                     "retry on another replica", "draining") from None
                except Exception:
                    if loading and slot.status == UNLOADED and slot.load_error is not None:
                        raise self._load_failed(slot) from None
                continue
            if slot.load_error is not None and time.monotonic() - slot.failed_at < RETRY_S:
                raise self._load_failed(slot)  # not tried again for every request: once per RETRY_S
            if slot.memory_bytes > self.budget:  # its load here added more than the budget: it can never be placed
                raise self._refused(slot)
            victims = self._room_for(slot)
            if victims is not None:
                self._start_load(slot, victims)
                continue
            if self.num_queued >= self.settings.queue_size:
                raise self._busy(f"the engine {slot.name!r} is not loaded, every loaded engine is busy and the pool's "
                                 f"queue is full ({self.num_queued} waiting, --pool-queue-size)", "queue_full")
            self.num_queued += 1
            try:
                await self._changed.wait()
            finally:
                self.num_queued -= 1

    def _load_failed(self, slot: EngineSlot) -> APIError:
        retry = max(1, int(RETRY_S - (time.monotonic() - slot.failed_at)))
        return APIError(503, f"The engine {slot.name!r} could not be loaded: {slot.load_error}; the server log has "
                        f"the details, and the load is tried again after {retry}s", code="engine_load_failed",
                        headers={"Retry-After": str(retry)})

    def _busy(self, why: str, code: str) -> APIError:
        self.metrics.rejected(code)
        return APIError(503, f"{why}; retry after {self.settings.retry_after_s}s", code=code,
                        headers={"Retry-After": str(self.settings.retry_after_s)})

    def _refused(self, slot: EngineSlot) -> APIError:
        self.metrics.rejected("engine_too_big")
        return APIError(503, f"The engine {slot.name!r} cannot be loaded: {self.too_big(slot)}",
                        code="engine_too_big")

    def _fits(self, used: int, count: int, slot: EngineSlot) -> bool:
        cap = self.settings.max_loaded_engines
        return used + slot.memory_bytes <= self.budget and (cap is None or count + 1 <= cap)

    def _room_for(self, slot: EngineSlot) -> list[EngineSlot] | None:
        """The engines to evict (least recently used first, idle ones only) so ``slot`` fits; None: it cannot now."""
        resident = [s for s in self.slots.values() if s.status != UNLOADED and s is not slot]
        resident += [s for s in self.leaving if s.status != UNLOADED]
        used, count = sum(s.memory_bytes for s in resident), len(resident)
        victims: list[EngineSlot] = []
        for s in self._evictable(keep=slot):
            if self._fits(used, count, slot):
                break
            victims.append(s)
            used, count = used - s.memory_bytes, count - 1
        return victims if self._fits(used, count, slot) else None

    def _start_load(self, slot: EngineSlot, victims: list[EngineSlot]) -> None:
        unloads = [self.start_unload(v, "lru") for v in victims]
        self._changes += 1  # loads and unloads started: a load's RSS is its own only while this stays put
        slot.status = LOADING
        slot.task = _task(self._load(slot, unloads), f"kiln-pool-load-{slot.name}")

    def _evictable(self, keep: EngineSlot) -> list[EngineSlot]:
        """Loaded engines with nothing in flight or waiting, least recently used first (``keep`` left out)."""
        return sorted((s for s in self._members() if s is not keep and s.status == LOADED and not s.is_busy),
                      key=lambda s: s.last_used)

    def _shed(self, keep: EngineSlot) -> None:
        """Back within the budget after ``keep``'s count rose (learn_memory): idle engines unloaded, LRU first."""
        used = self.memory_in_use
        for s in self._evictable(keep):
            if used <= self.budget:
                break
            self.start_unload(s, "lru")
            used -= s.memory_bytes

    def _quiet_rss(self, slot: EngineSlot) -> int | None:
        """The server's RSS where nothing but ``slot``'s load moves it (no other load or unload under way, no
        request in any other engine), else None: what a load added is then measured, not guessed."""
        others = [s for s in self._members() if s is not slot]
        if any(s.task is not None or s.state.num_in_flight for s in others):
            return None
        return proc_status_bytes("VmRSS")

    def start_unload(self, slot: EngineSlot, reason: str) -> asyncio.Task[None]:
        self._changes += 1
        slot.status = UNLOADING
        slot.task = _task(self._unload(slot, reason), f"kiln-pool-unload-{slot.name}")
        return slot.task

    async def _load(self, slot: EngineSlot, unloads: list[asyncio.Task[None]]) -> None:
        await asyncio.gather(*unloads, return_exceptions=True)
        started, before, changes = time.monotonic(), self._quiet_rss(slot), self._changes
        try:
            await slot.load()
        except BaseException as exc:
            slot.status, slot.load_error = UNLOADED, str(exc) or type(exc).__name__
            slot.failed_at = time.monotonic()
            log.error("pool: engine %r could not be loaded: %s", slot.name, slot.load_error)
            raise
        else:
            slot.status, slot.load_error = LOADED, None
            seconds = time.monotonic() - started
            self.pool_metrics.loaded(slot.name, seconds)
            after = self._quiet_rss(slot) if changes == self._changes and self._loaded_once else None
            if before is not None and after is not None and slot.learn_memory(after - before):
                self._shed(keep=slot)
            self._loaded_once = True  # the process's own first-use costs (libraries, threads) came with it
            log.info("pool: engine %r loaded in %.2fs (%d loaded, %s of %s)", slot.name, seconds, self.num_loaded,
                     human(self.memory_in_use), human(self.budget))
        finally:
            slot.task = None
            self.notify()

    async def _unload(self, slot: EngineSlot, reason: str) -> None:
        try:
            await slot.unload()
        finally:
            slot.status, slot.task = UNLOADED, None
            if slot in self.leaving:
                self.leaving.remove(slot)
            self.pool_metrics.evicted(slot.name, reason)
            log.info("pool: engine %r unloaded (%s)", slot.name, reason)
            self.notify()

    # -- changes -------------------------------------------------------------------------------------------
    def notify(self) -> None:
        """Wake every queued request to try again."""
        self._changed.set()
        self._changed = asyncio.Event()

    def _released(self, slot: EngineSlot) -> None:
        slot.last_used = time.monotonic()
        self.notify()

    async def run_idle_unloads(self) -> None:
        """Unload every engine idle for ``--idle-unload-after`` seconds."""
        idle = self.settings.idle_unload_after
        if idle is None:
            return
        while True:
            await asyncio.sleep(min(1.0, max(idle / 4, 0.05)))
            now = time.monotonic()
            for slot in list(self.slots.values()):
                if slot.status == LOADED and not slot.is_busy and now - slot.last_used >= idle:
                    self.start_unload(slot, "idle")

    async def remove(self, name: str) -> None:
        """Stop serving ``name``: new requests get 404 at once; it is unloaded once its requests finish."""
        slot = self.slots.pop(name, None)
        if slot is None:
            return
        self.leaving.append(slot)
        self.notify()  # a request queued for it looks again now: its 404 at once, not at the next change
        while slot.is_busy or slot.task is not None:
            await self._changed.wait()
        if slot.status == LOADED:
            await self.start_unload(slot, "removed")
        elif slot in self.leaving:
            self.leaving.remove(slot)

    # -- what the server waits for ------------------------------------------------------------------------
    async def wait_idle(self, timeout: float) -> bool:
        """Nothing in flight and no request waiting for an engine within ``timeout``; False if it passed first."""
        try:
            async with asyncio.timeout(timeout):
                while self.num_in_flight:
                    await self._changed.wait()  # a request ending, its last waiter leaving, a load ending
        except TimeoutError:
            return False
        return True

    async def shutdown(self) -> None:
        for slot in self._members():
            if slot.task is not None:
                slot.task.cancel()
                with contextlib.suppress(BaseException):
                    await slot.task
            if slot.state.engine is not None:
                with contextlib.suppress(Exception):
                    await slot.unload()


class _Removed(Exception):
    """The engine a request waited for was removed from the list meanwhile."""


def _task(coro: Any, name: str) -> asyncio.Task[Any]:
    task = asyncio.get_running_loop().create_task(coro, name=name)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # waiters see it; never "not retrieved"
    return task
