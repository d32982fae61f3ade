"""A pool's edges as a new user meets them: a budget written out of range, an engine removed while a request waits
for it, an engines file that is missing or lists an engine that cannot be read yet, and an engine whose load here
showed it cannot fit the budget on its own (docs/pools.md)."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from kiln.serving.errors import APIError
from kiln.serving.pool import follow as follow_mod
from kiln.serving.pool import pool as pool_mod
from kiln.serving.pool.follow import start_pool
from test_pool_learned_memory import FakeRSS, _with_rss
from test_pool_unit import MIB, make_pool

from kiln.engine_list import EngineEntry, document
from kiln.memory_budget import parse_quantity


@pytest.mark.parametrize("text", ["1e400", "1e309", "9" * 400 + "Ei"])
def test_a_budget_too_large_for_a_number_is_a_value_error_naming_the_flag(text):
    with pytest.raises(ValueError, match="--memory-budget .* too large"):  # was OverflowError: a traceback
        parse_quantity(text)


@pytest.mark.parametrize(("text", "size"), [("1Ei", 2**60), ("2E", 2 * 10**18), ("1e9", 10**9), ("1E3", 1000),
                                            ("1.5Gi", 3 * 2**29), (".5Ki", 512), ("+8G", 8 * 10**9)])
def test_kubernetes_quantities_read_as_kubernetes_reads_them(text, size):
    """E and Ei are exa and exbi, not an exponent; e3 and E3 are."""
    assert parse_quantity(text) == size


def test_a_quantity_with_a_trailing_newline_is_not_one():
    """A YAML block scalar ends in a newline: the operator's check by QUANTITY must refuse it, as Kubernetes does."""
    from kiln.memory_budget import QUANTITY

    assert QUANTITY.match("64Gi") and not QUANTITY.match("64Gi\n")


def test_a_request_queued_for_an_engine_that_is_removed_gets_its_404_at_once(monkeypatch):
    """docs/pools.md: "one removed answers 404 at once". A request queued for it (every loaded engine busy) used to
    wait for some other change (a request finishing elsewhere), up to --load-timeout."""
    async def run() -> None:
        pool, rec = make_pool(monkeypatch, {"a": 100, "b": 100}, memory_budget=100, load_timeout=30)
        held = (await pool.acquire("a")).state.admit(1)  # a stays busy throughout
        waiting = asyncio.create_task(pool.acquire("b"))
        await asyncio.sleep(0.05)
        assert pool.num_queued == 1
        removal = asyncio.create_task(pool.remove("b"))
        with pytest.raises(APIError) as missing:
            await asyncio.wait_for(waiting, 2)
        assert missing.value.status == 404 and "'a'" in missing.value.message
        assert ("load", "b") not in rec.events
        await asyncio.wait_for(removal, 2)
        held.release()

    asyncio.run(run())


def test_an_engine_that_proved_too_big_for_the_budget_is_refused_at_once_naming_both_figures(monkeypatch):
    """A load that added more than the whole budget (learned): the engine can never be placed again. Its requests
    used to queue until --load-timeout (300 s by default) and then get a 503 saying only that it timed out."""
    async def run() -> None:
        pool, _ = make_pool(monkeypatch, {"a": 100 * MIB, "b": 100 * MIB}, memory_budget=250 * MIB,
                            load_timeout=30)
        _with_rss(monkeypatch, FakeRSS({"a": [100 * MIB, 100 * MIB], "b": [400 * MIB]}))
        await pool.acquire("a")
        await pool.acquire("b")  # adds 400 MiB: b counts that from now on, more than the 250 MiB budget
        assert pool.slots["b"].memory_bytes == 400 * MIB
        await pool.acquire("a")  # b goes (idle) to make room
        with pytest.raises(APIError) as refused:
            await asyncio.wait_for(pool.acquire("b"), 2)
        message = refused.value.message
        assert refused.value.status == 503 and refused.value.code == "engine_too_big"
        assert "400.0 MiB" in message and "250.0 MiB" in message and "--memory-budget" in message

    asyncio.run(run())


def _follow(monkeypatch, listed, reads):
    """A pool following ``listed`` whose engine ``b`` cannot be read while ``reads['fail']`` is set."""
    make = pool_mod.EnginePool.make_slot

    def make_slot(pool, entry):
        if entry.name == "b" and reads["fail"]:
            raise ValueError(f"engine 'b' ({entry.artifact_uri}): its manifest cannot be read: connection reset")
        return make(pool, entry)

    pool, rec = make_pool(monkeypatch, {"a": 1, "b": 1}, memory_budget=10, engines_file=listed)
    pool.slots.clear()  # the file's engines only
    monkeypatch.setattr(pool_mod.EnginePool, "make_slot", make_slot)
    monkeypatch.setattr(follow_mod, "RETRY_S", 0.0)
    return pool, rec


def test_an_engine_the_file_lists_that_could_not_be_read_is_tried_again_and_named_in_the_404(monkeypatch, tmp_path):
    """A store error while an engine joins (a network blip) left it out until the file changed again, which in a
    cluster may be never; a request naming it got a 404 saying only that it does not exist."""
    listed = tmp_path / "engines.json"
    listed.write_text(json.dumps(document([EngineEntry(n, f"file:///store/engines/{n}") for n in ("a", "b")])))
    reads = {"fail": True}

    async def run() -> None:
        pool, rec = _follow(monkeypatch, listed, reads)
        follower = await start_pool(pool)
        assert sorted(pool.slots) == ["a"]
        with pytest.raises(APIError) as missing:
            await pool.acquire("b")
        assert missing.value.status == 404 and "connection reset" in missing.value.message
        assert "--engines-file" in missing.value.message
        reads["fail"] = False
        await follower.sync()  # the file has not changed: the refused engine is tried again all the same
        assert sorted(pool.slots) == ["a", "b"]
        assert (await pool.acquire("b")).name == "b" and rec.events == [("load", "b")]

    asyncio.run(run())


def test_a_missing_engines_file_is_logged_naming_the_flag(monkeypatch, tmp_path, caplog):
    """A typo in --engines-file served no engine at all, with nothing in the log but "0 engine(s)"."""
    listed = tmp_path / "no-such-engines.json"

    async def run() -> None:
        pool, _ = make_pool(monkeypatch, {}, memory_budget=10, engines_file=listed)
        with caplog.at_level(logging.WARNING, logger="kiln.serving"):
            follower = await start_pool(pool)
            await follower.sync()
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warned) == 1 and "--engines-file" in warned[0] and str(listed) in warned[0]

    asyncio.run(run())



def test_models_list_an_adapter_name_two_engines_hold_once_as_the_engine_a_request_reaches(monkeypatch):
    """kiln serve --engine a=... --engine b=... where both engines have an adapter 'tone': /v1/models listed 'tone'
    twice (once per engine), though a request naming it reaches one of them, the first loaded engine holding it."""
    from types import SimpleNamespace

    from kiln.serving.pool.slot import LOADED

    pool, _ = make_pool(monkeypatch, {"a": 1, "b": 1}, memory_budget=10)
    for name in ("a", "b"):
        pool.slots[name].loras.adapters["tone"] = SimpleNamespace(lora_path=f"/adapters/{name}", base_model_name=None)
        pool.slots[name].status = LOADED
    cards = [(c["id"], c["parent"]) for c in pool.cards(0)]
    assert cards == [("a", None), ("b", None), ("tone", pool.slot_for("tone").name)]
