"""A pool engine whose load adds more to the server's RSS than it counts is counted by what it added from then on,
measured only while nothing else moves the RSS (kiln.serving.pool: EnginePool._quiet_rss, EngineSlot.learn_memory)."""

from __future__ import annotations

import asyncio

from kiln.serving.pool import pool as pool_mod
from test_pool_unit import MIB, make_pool


class FakeRSS:
    """The server's RSS as the loads move it: each load adds the next of what ``adds`` lists for its engine."""

    def __init__(self, adds: dict[str, list[int]]) -> None:
        self.adds, self.value = adds, 500 * MIB

    def read(self, field: str) -> int:
        assert field == "VmRSS"
        return self.value


def _with_rss(monkeypatch, rss: FakeRSS) -> None:
    load = pool_mod.EngineSlot.load

    async def load_and_grow(slot) -> None:
        await load(slot)
        rss.value += rss.adds[slot.name].pop(0)

    monkeypatch.setattr(pool_mod.EngineSlot, "load", load_and_grow)
    monkeypatch.setattr(pool_mod, "proc_status_bytes", rss.read)


def test_a_load_that_adds_more_than_it_counts_is_counted_by_what_it_added(monkeypatch):
    async def run() -> None:
        pool, rec = make_pool(monkeypatch, {"a": 100 * MIB, "b": 100 * MIB, "c": 100 * MIB},
                              memory_budget=250 * MIB)
        _with_rss(monkeypatch, FakeRSS({"a": [300 * MIB, 100 * MIB], "b": [180 * MIB] * 2, "c": [50 * MIB]}))
        await pool.acquire("a")  # the process's first load: its own first-use costs came with it, nothing learned
        assert pool.slots["a"].memory_bytes == 100 * MIB
        await pool.acquire("b")  # 180 MiB added: counted so from now on, and a (idle) goes at once to keep the budget
        assert pool.slots["b"].memory_bytes == 180 * MIB and "RSS its load added" in pool.slots["b"].memory_source
        await asyncio.sleep(0)
        assert rec.events == [("load", "a"), ("load", "b"), ("unload", "a")] and pool.memory_in_use == 180 * MIB
        await pool.acquire("c")  # less than it counts (memory freed before it reused): never lowered
        assert pool.slots["c"].memory_bytes == 100 * MIB
        assert rec.events[3:] == [("unload", "b"), ("load", "c")]
        await pool.acquire("a")
        assert ("unload", "c") not in rec.events  # a (100) and c (100) fit in 250
        await pool.acquire("b")  # 180 counted: both must go, where 100 would have needed only one
        assert rec.events[-3:] == [("unload", "c"), ("unload", "a"), ("load", "b")]
        assert pool.memory_in_use == 180 * MIB

    asyncio.run(run())


def test_nothing_is_learned_while_another_engine_moves_the_rss(monkeypatch):
    async def run() -> None:
        pool, _ = make_pool(monkeypatch, {"a": 100 * MIB, "b": 100 * MIB}, memory_budget=250 * MIB)
        _with_rss(monkeypatch, FakeRSS({"a": [100 * MIB], "b": [400 * MIB]}))
        await pool.acquire("a")
        held = pool.slots["a"].state.admit(1)  # a request in flight in a: b's load is not all that moves the RSS
        await pool.acquire("b")
        assert pool.slots["b"].memory_bytes == 100 * MIB
        held.release()
        both = await asyncio.gather(pool.acquire("a"), pool.acquire("b"))  # loaded already: nothing measured
        assert [s.name for s in both] == ["a", "b"] and pool.slots["b"].memory_bytes == 100 * MIB

    asyncio.run(run())
