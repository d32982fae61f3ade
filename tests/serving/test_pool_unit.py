"""The pool's placement without engines: budgets, the engine list, LRU eviction, the queue, idle unloads.

Each slot's load and unload are replaced by fakes that record the order; everything else (the budget, the
LRU choice, admissions as what keeps an engine in place, the queue and its 503) is the pool's own code.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from conftest import engine_stats
from kiln.serving.config import ServeConfig
from kiln.serving.errors import APIError
from kiln.serving.metrics import ServingMetrics
from kiln.serving.pool import budget as budget_mod
from kiln.serving.pool.budget import default_budget
from kiln.serving.pool.pool import EnginePool
from kiln.serving.pool.settings import PoolSettings
from kiln.serving.pool.slot import LOADED, UNLOADED, EngineSlot
from kiln.serving.server_state import READY

from kiln.engine_list import EngineEntry, parse_document, parse_engine_flag, read_file
from kiln.memory_budget import SERVER_MARGIN_BYTES, engine_memory, parse_quantity

MIB = 2**20


def test_memory_quantities_as_kubernetes_writes_them():
    assert parse_quantity("6Gi") == 6 * 2**30
    assert parse_quantity("512Mi") == 512 * MIB
    assert parse_quantity("8G") == 8 * 10**9
    assert parse_quantity("1.5Gi") == int(1.5 * 2**30)
    assert parse_quantity("1000") == 1000
    assert parse_quantity("1e9") == 10**9 and parse_quantity("1.5e3") == 1500  # exponents, as Kubernetes reads
    assert parse_quantity("1500m") == 2  # milli-bytes round up
    for bad in ("6GB", "lots", "-1Gi", "0", "6 gi"):
        with pytest.raises(ValueError, match=r"--memory-budget .*6Gi"):
            parse_quantity(bad)


def test_default_budget_is_the_cgroup_limit_else_host_memory_less_margins(tmp_path):
    limited = tmp_path / "memory.max"
    limited.write_text(str(8 * 2**30))
    unlimited = tmp_path / "unlimited"
    unlimited.write_text("max\n")
    assert budget_mod.cgroup_memory_limit(limited, tmp_path / "none") == 8 * 2**30
    assert budget_mod.cgroup_memory_limit(unlimited, tmp_path / "none") is None
    got, why = default_budget(limit=8 * 2**30)
    assert got == int(8 * 2**30 * 0.9) - SERVER_MARGIN_BYTES and "cgroup" in why
    got, why = default_budget(limit=0, host=4 * 2**30)
    assert got == int(4 * 2**30 * 0.9) - SERVER_MARGIN_BYTES and "host" in why


def test_an_engine_counts_its_measured_memory_else_its_kv_plan_and_says_which():
    measured = {"build_report": {"memory": {"stages": {"tune": {"host_extra_bytes": 300 * MIB}}}},
                "kv_plan": {"weight_bytes_per_rank": 1, "kv_pool_bytes": 2}}
    assert engine_memory(measured) == (300 * MIB, "measured by the build (build_report.memory.stages.tune)")
    cuda = {"tuning": {"device": "cuda"}, "build_report": {"memory": {"stages": {"tune": {
        "host_extra_bytes": 1, "cuda_peak_allocated_bytes": 5 * 2**30}}}}}
    assert engine_memory(cuda)[0] == 5 * 2**30
    planned = {"kv_plan": {"weight_bytes_per_rank": 100, "kv_pool_bytes": 20, "activation_reserve_bytes": 3}}
    got, why = engine_memory(planned)
    assert got == 123 and "not measured" in why and "kv_plan" in why
    untouched = {**measured, "kv_plan": {"weight_bytes_per_rank": 200 * MIB, "kv_pool_bytes": 300 * MIB}}
    got, why = engine_memory(untouched)  # the plan is the larger: the measurement left the KV pool untouched
    assert got == 500 * MIB and "above the 300.0 MiB its build measured" in why
    with pytest.raises(ValueError, match="rebuild"):
        engine_memory({"engine_version": "v1"})


def test_the_engine_list_from_flags_and_file(tmp_path):
    assert parse_engine_flag("chat=file:///s/engines/v1") == EngineEntry("chat", "file:///s/engines/v1")
    for bad in ("chat", "=file:///x", "chat=", "bad name=file:///x"):
        with pytest.raises(ValueError, match="--engine"):
            parse_engine_flag(bad)
    path = tmp_path / "engines.json"
    assert read_file(path) == {}  # not created yet: none
    path.write_text(json.dumps({"format": 1, "engines": [{"name": "a", "artifactURI": "file:///s/engines/a",
                                                          "contentDigest": "d"}]}))
    assert read_file(path) == {"a": EngineEntry("a", "file:///s/engines/a", "d")}
    with pytest.raises(ValueError, match=r"engines\[0\].*artifactURI"):
        parse_document({"format": 1, "engines": [{"name": "a"}]}, "f")
    with pytest.raises(ValueError, match="given twice"):
        parse_document({"format": 1, "engines": [{"name": "a", "artifactURI": "x"}] * 2}, "f")
    with pytest.raises(ValueError, match="format"):
        parse_document({"engines": []}, "f")


class FakeEngine:
    is_running = True

    class engine_config:  # noqa: N801 - what ServerState reads of an engine
        max_batch_size = 4

    def stats(self) -> object:  # what the pool's /metrics reads of a loaded engine (EnginesCollector)
        return engine_stats(num_total_blocks=8, block_size=16)


class Recorder:
    """Fake loads and unloads: each marks the engine ready (or not) and records what happened, in order."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.sizes, self.events = sizes, []
        self.gate: asyncio.Event | None = None  # set: loads wait for it

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        recorder = self

        def read_memory(slot: EngineSlot) -> None:
            slot.memory_bytes, slot.memory_source = recorder.sizes[slot.name], "test"

        async def load(slot: EngineSlot) -> None:
            if recorder.gate is not None:
                await recorder.gate.wait()
            recorder.events.append(("load", slot.name))
            slot.state.engine, slot.state.phase = FakeEngine(), READY

        async def unload(slot: EngineSlot) -> None:
            recorder.events.append(("unload", slot.name))
            slot.state.engine = None

        monkeypatch.setattr(EngineSlot, "read_memory", read_memory)
        monkeypatch.setattr(EngineSlot, "load", load)
        monkeypatch.setattr(EngineSlot, "unload", unload)


def make_pool(monkeypatch, sizes: dict[str, int], **settings) -> tuple[EnginePool, Recorder]:
    recorder = Recorder(sizes)
    recorder.install(monkeypatch)
    config = ServeConfig(served_model_name="pool")
    pool = EnginePool(PoolSettings(**settings), config, ServingMetrics("pool", lambda: None))
    for name in sizes:
        pool.add(pool.make_slot(EngineEntry(name, f"file:///store/engines/{name}")))
    return pool, recorder


def samples(pool: EnginePool) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(pool.metrics.render().decode()) for s in family.samples}


def test_lru_eviction_keeps_the_budget_and_evicts_the_least_recently_used(monkeypatch):
    async def run() -> None:
        pool, rec = make_pool(monkeypatch, {"a": 100 * MIB, "b": 100 * MIB, "c": 100 * MIB, "d": 200 * MIB},
                              memory_budget=250 * MIB)
        for name in ("a", "b", "a", "c"):  # a used after b: b is the least recently used when c comes
            await pool.acquire(name)
        assert rec.events == [("load", "a"), ("load", "b"), ("unload", "b"), ("load", "c")]
        await pool.acquire("d")  # 200 MiB: both a and c must go, a first (older)
        assert rec.events[4:] == [("unload", "a"), ("unload", "c"), ("load", "d")]
        assert pool.memory_in_use == 200 * MIB <= pool.budget
        metrics = samples(pool)
        assert metrics[("kiln:pool_engine_evictions_total", (("engine", "b"), ("reason", "lru")))] == 1
        assert metrics[("kiln:pool_engine_loads_total", (("engine", "a"),))] == 1
        assert metrics[("kiln:pool_engines_loaded", ())] == 1
        assert metrics[("kiln:pool_memory_in_use_bytes", ())] == 200 * MIB

    asyncio.run(run())


def test_max_loaded_engines_counts_engines(monkeypatch):
    async def run() -> None:
        pool, rec = make_pool(monkeypatch, {"a": 1, "b": 1, "c": 1}, memory_budget=2**30, max_loaded_engines=2)
        for name in ("a", "b", "c"):
            await pool.acquire(name)
        assert rec.events[-2:] == [("unload", "a"), ("load", "c")] and pool.num_loaded == 2

    asyncio.run(run())


def test_an_engine_with_requests_in_flight_is_never_evicted_and_a_full_queue_gets_503(monkeypatch):
    async def run() -> None:
        pool, rec = make_pool(monkeypatch, {"a": 100, "b": 100, "c": 100}, memory_budget=200, queue_size=1,
                              load_timeout=5)
        admissions = [(await pool.acquire(name)).state.admit(1) for name in ("a", "b")]  # both in flight
        waiting = asyncio.create_task(pool.acquire("c"))  # queued: nothing can be evicted
        await asyncio.sleep(0.05)
        assert not waiting.done() and pool.num_queued == 1
        with pytest.raises(APIError) as refused:  # the queue (size 1) is full
            await pool.acquire("c")
        assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "1"}
        assert refused.value.code == "queue_full" and "--pool-queue-size" in refused.value.message
        assert ("unload", "a") not in rec.events and ("unload", "b") not in rec.events
        admissions[1].release()  # b finishes: it is evicted for c, a (still in flight) stays
        slot = await asyncio.wait_for(waiting, 5)
        assert slot.name == "c" and rec.events[-2:] == [("unload", "b"), ("load", "c")]
        assert pool.slots["a"].status == LOADED

    asyncio.run(run())


def test_a_request_that_cannot_be_placed_in_time_gets_503(monkeypatch):
    async def run() -> None:
        pool, _ = make_pool(monkeypatch, {"a": 100, "b": 100}, memory_budget=100, load_timeout=0.2)
        (await pool.acquire("a")).state.admit(1)
        with pytest.raises(APIError) as refused:
            await pool.acquire("b")
        assert refused.value.status == 503 and "--load-timeout" in refused.value.message
        assert refused.value.headers == {"Retry-After": "1"}

    asyncio.run(run())


def test_idle_engines_are_unloaded(monkeypatch):
    async def run() -> None:
        pool, rec = make_pool(monkeypatch, {"a": 1, "b": 1}, memory_budget=10, idle_unload_after=0.2)
        idle = asyncio.create_task(pool.run_idle_unloads())
        held = (await pool.acquire("a")).state.admit(1)  # in flight: not idle however long it runs
        await pool.acquire("b")
        await asyncio.sleep(0.6)
        assert pool.slots["b"].status == UNLOADED and pool.slots["a"].status == LOADED
        held.release()
        await asyncio.sleep(0.6)
        assert pool.slots["a"].status == UNLOADED
        assert rec.events[-2:] == [("unload", "b"), ("unload", "a")]
        assert samples(pool)[("kiln:pool_engine_evictions_total", (("engine", "a"), ("reason", "idle")))] == 1
        idle.cancel()

    asyncio.run(run())


def test_unknown_model_is_a_404_naming_the_pools_models_and_too_big_is_refused_naming_both(monkeypatch):
    async def run() -> None:
        pool, _ = make_pool(monkeypatch, {"a": 1, "b": 1}, memory_budget=100 * MIB)
        with pytest.raises(APIError) as missing:
            await pool.acquire("nope")
        assert missing.value.status == 404 and missing.value.code == "model_not_found"
        assert "'nope'" in missing.value.message and "'a', 'b'" in missing.value.message
        Recorder({"huge": 300 * MIB}).install(monkeypatch)
        with pytest.raises(ValueError) as refused:
            pool.make_slot(EngineEntry("huge", "file:///store/engines/huge"))
        assert "300.0 MiB" in str(refused.value) and "100.0 MiB" in str(refused.value)
        assert "--memory-budget" in str(refused.value)

    asyncio.run(run())


def test_a_removed_engine_answers_404_and_is_unloaded_when_its_requests_finish(monkeypatch):
    async def run() -> None:
        pool, rec = make_pool(monkeypatch, {"a": 1, "b": 1}, memory_budget=10)
        held = (await pool.acquire("a")).state.admit(1)
        removal = asyncio.create_task(pool.remove("a"))
        await asyncio.sleep(0.05)
        with pytest.raises(APIError, match="'b'"):
            await pool.acquire("a")
        assert ("unload", "a") not in rec.events and pool.memory_in_use == 1  # still counted until unloaded
        held.release()
        await asyncio.wait_for(removal, 5)
        assert rec.events[-1] == ("unload", "a") and pool.memory_in_use == 0

    asyncio.run(run())


def test_an_adapters_name_places_the_engine_the_adapter_list_names_as_its_base(monkeypatch, tmp_path):
    from kiln import adapter_list

    listed = adapter_list.write(tmp_path / "adapters.json", [
        adapter_list.entry("tone", "file:///store/engines/b-tone-0123", "b-tone-0123", "b")])
    monkeypatch.setenv(adapter_list.ADAPTERS_FILE_ENV, str(listed))

    async def run() -> None:
        pool, rec = make_pool(monkeypatch, {"a": 1, "b": 1}, memory_budget=10)
        for slot in pool.slots.values():
            slot.version = slot.name  # what read_memory reads from the URI
        assert (await pool.acquire("tone")).name == "b" and rec.events == [("load", "b")]
        with pytest.raises(APIError, match="'nope'"):
            await pool.acquire("nope")

    asyncio.run(run())


def test_an_engine_whose_step_loop_died_is_loaded_anew_on_its_next_request(monkeypatch):
    async def run() -> None:
        pool, rec = make_pool(monkeypatch, {"a": 1}, memory_budget=10)
        (await pool.acquire("a")).state.engine.is_running = False
        slot = await pool.acquire("a")
        assert rec.events == [("load", "a"), ("unload", "a"), ("load", "a")] and slot.state.engine.is_running
        assert samples(pool)[("kiln:pool_engine_evictions_total", (("engine", "a"), ("reason", "failed")))] == 1

    asyncio.run(run())


def test_each_engine_records_its_requests_under_its_own_name(monkeypatch):
    pool, _ = make_pool(monkeypatch, {"a": 1, "b": 1}, memory_budget=10)
    for name, tokens in (("a", 3), ("b", 5)):
        timer = pool.slots[name].metrics.timer()
        timer.on_tokens(tokens)
        timer.finish("length", 2)
    got = samples(pool)
    assert got[("kiln:generation_tokens_total", (("model_name", "a"),))] == 3
    assert got[("kiln:generation_tokens_total", (("model_name", "b"),))] == 5


def test_an_engine_that_fails_to_load_is_a_503_naming_why_and_is_not_retried_at_once(monkeypatch):
    async def run() -> None:
        pool, rec = make_pool(monkeypatch, {"a": 1, "b": 1}, memory_budget=10)
        calls = []

        async def broken(slot: EngineSlot) -> None:
            calls.append(slot.name)
            raise ValueError("engines/a: corrupt: manifest says sha256 ...")

        monkeypatch.setattr(EngineSlot, "load", broken)
        for _ in range(2):
            with pytest.raises(APIError) as failed:
                await pool.acquire("a")
            assert failed.value.status == 503 and failed.value.code == "engine_load_failed"
            assert "corrupt" in failed.value.message and int(failed.value.headers["Retry-After"]) >= 1
        assert calls == ["a"] and pool.slots["a"].status == UNLOADED and pool.memory_in_use == 0
        assert pool.cards(0)[0]["load_error"].startswith("engines/a: corrupt")

    asyncio.run(run())


def test_serve_says_which_flags_a_pool_does_not_take():
    from click.testing import CliRunner
    from kiln.serving.cli import serve

    def refused(*args: str) -> str:
        result = CliRunner().invoke(serve, list(args))
        assert result.exit_code == 2, result.output
        return result.output

    assert "--model" in refused("--engine", "a=file:///s/engines/a", "--model", ".")
    assert "--lora-modules" in refused("--engine", "a=file:///s/engines/a", "--enable-lora", "--lora-modules", "x=/y")
    assert "6Gi" in refused("--engine", "a=file:///s/engines/a", "--memory-budget", "6GB")
    assert "given twice" in refused("--engine", "a=file:///s/engines/a", "--engine", "a=file:///s/engines/b")
    assert "NAME=ARTIFACT_URI" in refused("--engine", "file:///s/engines/a")
    assert "--max-loaded-engines sets a pool" in refused("--artifact", "file:///s/engines/a",
                                                         "--max-loaded-engines", "2")
    for flag, value in (("--pool-queue-size", "8"), ("--load-timeout", "30")):  # defaults, but a pool's flags
        assert f"{flag} sets a pool" in refused("--artifact", "file:///s/engines/a", flag, value)
    assert "exactly one of --model DIR or --artifact URI" in refused()


def test_a_request_queued_before_its_engine_was_removed_gets_404_and_never_loads_it(monkeypatch):
    async def run() -> None:
        pool, rec = make_pool(monkeypatch, {"a": 100, "b": 100}, memory_budget=100, load_timeout=5)
        held = (await pool.acquire("a")).state.admit(1)  # b cannot be placed while a is in flight
        waiting = asyncio.create_task(pool.acquire("b"))
        await asyncio.sleep(0.05)
        removal = asyncio.create_task(pool.remove("b"))
        await asyncio.sleep(0.05)
        held.release()  # room for b now: the queued request must not load the removed engine
        with pytest.raises(APIError) as missing:
            await asyncio.wait_for(waiting, 5)
        assert missing.value.status == 404 and ("load", "b") not in rec.events
        await asyncio.wait_for(removal, 5)
        assert pool.leaving == [] and pool.memory_in_use == 100

    asyncio.run(run())


def test_a_request_whose_engine_left_while_it_waited_reaches_the_adapter_of_that_name(monkeypatch, tmp_path):
    """An engine named as an adapter of another engine's base has the name while it is listed; a request that
    waited for it while it was removed is looked up once more and served by the adapter, not answered 404."""
    from kiln import adapter_list

    listed = adapter_list.write(tmp_path / "adapters.json", [
        adapter_list.entry("tone", "file:///store/engines/b-tone-0123", "b-tone-0123", "b")])
    monkeypatch.setenv(adapter_list.ADAPTERS_FILE_ENV, str(listed))

    async def run() -> None:
        pool, rec = make_pool(monkeypatch, {"a": 100, "b": 100, "tone": 100}, memory_budget=100, load_timeout=5)
        for slot in pool.slots.values():
            slot.version = slot.name
        held = (await pool.acquire("a")).state.admit(1)  # nothing else can be placed while a is in flight
        waiting = asyncio.create_task(pool.acquire("tone"))
        await asyncio.sleep(0.05)
        removal = asyncio.create_task(pool.remove("tone"))
        await asyncio.sleep(0.05)
        held.release()
        assert (await asyncio.wait_for(waiting, 5)).name == "b"
        assert ("load", "tone") not in rec.events and rec.events[-1] == ("load", "b")
        await asyncio.wait_for(removal, 5)

    asyncio.run(run())


def test_an_adapter_listed_since_its_engines_last_adapter_pass_is_read_in_before_the_request_goes_on(monkeypatch,
                                                                                                     tmp_path):
    """The request path answers an adapter from the engine's registry: one the list names for the engine it was
    placed on, but which the engine's adapter follower has not read yet, is read in by one pass first (no 404),
    with the engine kept from eviction meanwhile."""
    from kiln import adapter_list

    listed = adapter_list.write(tmp_path / "adapters.json", [
        adapter_list.entry("tone", "file:///store/engines/b-tone-0123", "b-tone-0123", "b")])
    monkeypatch.setenv(adapter_list.ADAPTERS_FILE_ENV, str(listed))

    class Sync:
        def __init__(self, slot):
            self.slot, self.passes = slot, []

        async def sync(self, version):
            self.passes.append((version, self.slot.is_busy))
            await asyncio.sleep(0)
            self.slot.loras.adapters["tone"] = object()

    async def run() -> None:
        pool, _ = make_pool(monkeypatch, {"a": 1, "b": 1}, memory_budget=10)
        for slot in pool.slots.values():
            slot.version = slot.name
        b = await pool.acquire("b")
        b.adapter_sync = sync = Sync(b)
        assert (await pool.acquire("tone")) is b and b.loras.get("tone") is not None
        assert [busy for _, busy in sync.passes] == [True] and not b.is_busy
        assert (await pool.acquire("tone")) is b and len(sync.passes) == 1  # held now: no second pass

    asyncio.run(run())


def test_a_removal_ends_when_its_last_waiter_times_out(monkeypatch):
    async def run() -> None:
        pool, _ = make_pool(monkeypatch, {"a": 100, "b": 100}, memory_budget=100, load_timeout=0.2)
        (await pool.acquire("a")).state.admit(1)  # in flight for good: b waits until --load-timeout
        waiting = asyncio.create_task(pool.acquire("b"))
        await asyncio.sleep(0.05)
        removal = asyncio.create_task(pool.remove("b"))
        with pytest.raises(APIError):
            await waiting
        await asyncio.wait_for(removal, 2)  # nothing else changes: the waiter's leaving must wake it
        assert pool.leaving == []

    asyncio.run(run())


def test_a_failed_unload_is_not_reported_as_an_old_load_failure(monkeypatch):
    async def run() -> None:
        pool, rec = make_pool(monkeypatch, {"a": 1}, memory_budget=10)
        slot = await pool.acquire("a")
        slot.load_error, slot.failed_at = "an old load failure", 0.0  # long past RETRY_S: tried again

        async def broken_unload(slot: EngineSlot) -> None:
            rec.events.append(("unload", slot.name))
            slot.state.engine = None
            raise RuntimeError("shutdown failed")

        monkeypatch.setattr(EngineSlot, "unload", broken_unload)
        slot.state.engine.is_running = False  # its step loop died: unloaded (which fails), then loaded anew
        assert (await pool.acquire("a")) is slot and slot.status == LOADED and slot.load_error is None
        assert rec.events == [("load", "a"), ("unload", "a"), ("load", "a")]

    asyncio.run(run())


def test_a_drain_waits_for_requests_waiting_on_a_load_and_removed_engines_and_shutdown_answers_503(monkeypatch):
    async def run() -> None:
        pool, rec = make_pool(monkeypatch, {"a": 1, "b": 1}, memory_budget=10)
        held = (await pool.acquire("a")).state.admit(1)
        removal = asyncio.create_task(pool.remove("a"))  # leaving, its request still in flight
        await asyncio.sleep(0.05)
        assert pool.num_in_flight == 1 and not await pool.wait_idle(0.05)
        held.release()
        assert await pool.wait_idle(2)
        await asyncio.wait_for(removal, 2)
        rec.gate = asyncio.Event()  # b's load never ends: its request waits on it
        waiting = asyncio.create_task(pool.acquire("b"))
        await asyncio.sleep(0.05)
        assert pool.num_in_flight == 1 and not await pool.wait_idle(0.05)
        await pool.shutdown()  # the drain timed out: the load is cancelled, its waiter answered
        with pytest.raises(APIError) as draining:
            await asyncio.wait_for(waiting, 2)
        assert draining.value.status == 503 and draining.value.code == "draining"
        assert draining.value.headers == {"Retry-After": "1"}

    asyncio.run(run())


def publish_engine(tmp_path, engine_json: dict, signer=None, version: str = "tiny-0123456789ab") -> str:
    """An artifact holding only ``engine_json``, published (signed by ``signer``) to a file store: its URI."""
    from kiln.artifacts import ArtifactStore

    src = tmp_path / f"src-{version}"
    src.mkdir()
    (src / "engine.json").write_text(json.dumps(engine_json))
    store = ArtifactStore.from_uri((tmp_path / "store").as_uri())
    store.publish(version, src, {}, signer=signer)
    return store.artifact_uri(version)


def test_an_engines_memory_is_read_only_from_a_verified_engine_json(tmp_path):
    from kiln.signing import Signer, generate_key_pair

    private, public = generate_key_pair(tmp_path / "keys")
    other, _ = generate_key_pair(tmp_path / "other-keys")
    measured = {"build_report": {"memory": {"stages": {"tune": {"host_extra_bytes": 300 * MIB}}}}}
    uri = publish_engine(tmp_path, measured, Signer.from_pem(private))
    config = ServeConfig(served_model_name="pool", verify_key=public, cache_dir=tmp_path / "cache")

    def read(uri: str) -> int:
        slot = EngineSlot(EngineEntry("a", uri), config, ServingMetrics("pool", lambda: None))
        slot.read_memory()
        return slot.memory_bytes

    assert read(uri) == 300 * MIB
    lying = {"build_report": {"memory": {"stages": {"tune": {"host_extra_bytes": MIB}}}}}
    cached = tmp_path / "cache" / "tiny-0123456789ab" / "engine.json"
    cached.parent.mkdir(parents=True)
    cached.write_text(json.dumps(lying))  # a cache copy the manifest does not describe: the store's is read
    assert read(uri) == 300 * MIB
    (tmp_path / "store" / "engines" / "tiny-0123456789ab" / "engine.json").write_text(json.dumps(lying))
    with pytest.raises(ValueError, match=r"'a' \(file://.*engine.json cannot be used: .*engine.json: corrupt: sha256"):
        read(uri)
    unsigned = publish_engine(tmp_path, measured, Signer.from_pem(other), "other-0123456789ab")
    with pytest.raises(ValueError, match="refusing this artifact: it is signed by key"):
        read(unsigned)


def test_a_malformed_engine_json_refuses_that_engine_naming_the_field_and_following_goes_on(tmp_path, monkeypatch):

    from kiln.serving import app
    from kiln.serving.pool.follow import EngineFileFollower

    from kiln.engine_list import document

    for bad, field in (({"build_report": {"memory": "x"}}, "build_report.memory is a str"),
                       ({"tuning": []}, "tuning is a list"), ([], "it is a list")):
        with pytest.raises(ValueError, match=field):
            engine_memory(bad)
    good = publish_engine(tmp_path, {"kv_plan": {"weight_bytes_per_rank": 5, "kv_pool_bytes": 5}})
    bad = publish_engine(tmp_path, {"tuning": "cpu", "kv_plan": {}}, version="bad-0123456789ab")
    pool = EnginePool(PoolSettings(memory_budget=2**30), ServeConfig(served_model_name="pool",
                      cache_dir=tmp_path / "cache"), ServingMetrics("pool", lambda: None))
    with pytest.raises(ValueError, match=r"engine 'bad' \(file://.*bad-0123456789ab\): engine.json: tuning is a str"):
        pool.make_slot(EngineEntry("bad", bad))
    listed = tmp_path / "engines.json"
    listed.write_text(json.dumps(document([EngineEntry("bad", bad), EngineEntry("good", good)])))
    follower = EngineFileFollower(pool, listed)

    async def run() -> None:
        await follower.sync()  # the malformed one refused (logged), the other served
        assert sorted(pool.slots) == ["good"] and pool.slots["good"].memory_bytes == 10
        calls = []

        async def failing_sync() -> None:
            calls.append(1)
            raise AttributeError("'str' object has no attribute 'get'")

        monkeypatch.setattr(app, "POLL_S", 0.01)
        ctx = SimpleNamespace(state=SimpleNamespace(phase=READY), pool=pool,
                              pool_follower=SimpleNamespace(path=listed, sync=failing_sync))
        following = asyncio.create_task(app._follow_pool(ctx))
        await asyncio.sleep(0.2)
        assert not following.done() and len(calls) >= 2  # a pass that failed is logged; the next one runs
        following.cancel()

    asyncio.run(run())


def test_a_pools_process_freezes_its_heap_before_any_load_and_an_engines_cycles_still_go(monkeypatch):
    import gc
    import weakref

    from kiln.serving import loader, server

    frozen = []
    monkeypatch.setattr(server, "freeze_heap", lambda: frozen.append(1) or 1)
    monkeypatch.setattr(server.KilnServer, "run", lambda self: None)
    server.run_server(ServeConfig(served_model_name="one"))
    assert frozen == []  # one engine: nothing frozen
    server.run_server(ServeConfig(served_model_name="pool"), PoolSettings(memory_budget=2**30))
    assert frozen == [1]

    class Node:
        pass

    try:
        assert loader.freeze_heap() > 1000 and gc.get_freeze_count() > 1000  # torch's objects among them
        made_after = Node()
        made_after.self = made_after  # a cycle, as an engine's modules make: freed by the collection alone
        gone = weakref.ref(made_after)
        del made_after
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()


def test_an_engine_builds_with_a_quick_handover_of_the_interpreters_lock(monkeypatch):
    import sys

    from kiln.serving.pool import slot as slot_mod

    usual, seen = sys.getswitchinterval(), []

    def build(self):  # what the load's build thread sees, then a failed build (nothing to start)
        seen.append(sys.getswitchinterval())
        raise ValueError("no weights")

    monkeypatch.setattr(EngineSlot, "build", build)

    async def run() -> None:
        with slot_mod.quick_handover():  # two builds overlapping: the interval stays short until both end
            with pytest.raises(ValueError, match="no weights"):
                await EngineSlot(EngineEntry("a", "file:///store/engines/a"), ServeConfig(),
                                 ServingMetrics("pool", lambda: None)).load()
            seen.append(sys.getswitchinterval())
        seen.append(sys.getswitchinterval())

    asyncio.run(run())
    assert seen == [slot_mod.LOAD_SWITCH_INTERVAL_S, slot_mod.LOAD_SWITCH_INTERVAL_S, usual]
    assert slot_mod.LOAD_SWITCH_INTERVAL_S < usual


def test_an_adapter_pass_that_hangs_does_not_hold_up_the_engine_list(monkeypatch):
    """The pool follows its engines file and its engines' adapters in loops of their own: an adapter's fetch
    that takes minutes (or, before the fix in kiln.engine.async_llm, a removal never answered) leaves engines
    still added to and removed from the list."""
    from kiln.serving import app as app_mod

    monkeypatch.setattr(app_mod, "POLL_S", 0.01)
    passes, stuck = [], asyncio.Event()

    class Follower:
        path = "engines.json"

        async def sync(self):
            passes.append("engines")

    class Adapters:
        async def sync(self, version):
            passes.append("adapters")
            await asyncio.Event().wait()  # never ends

    slot = SimpleNamespace(name="a", adapter_sync=Adapters(), state=SimpleNamespace(engine=object(), engine_info={}))

    async def idle():
        await stuck.wait()

    pool = SimpleNamespace(slots={"a": slot}, run_idle_unloads=idle)
    ctx = SimpleNamespace(state=SimpleNamespace(phase=READY), pool=pool, pool_follower=Follower())

    async def run():
        task = asyncio.create_task(app_mod._follow_pool(ctx))
        await asyncio.sleep(0.3)
        task.cancel()

    asyncio.run(run())
    assert passes.count("adapters") == 1 and passes.count("engines") >= 5, passes


def test_models_list_a_name_once_as_what_a_request_naming_it_reaches(monkeypatch):
    """An adapter of engine a named b, as engine b of the pool is (the operator leaves such an adapter out of the
    list; a pod holds it until it reads the list again): a request naming b reaches the engine b, and /v1/models
    lists b once, as that engine; a's other adapter is listed as a's."""
    pool, _ = make_pool(monkeypatch, {"a": 1, "b": 1}, memory_budget=10)
    for name in ("b", "sql"):
        pool.slots["a"].loras.adapters[name] = SimpleNamespace(lora_path=f"/adapters/{name}", base_model_name=None)
    pool.slots["a"].status = LOADED
    assert pool.slot_for("b") is pool.slots["b"] and pool.slot_for("sql") is pool.slots["a"]
    cards = [(c["id"], c["parent"]) for c in pool.cards(0)]
    assert sorted(cards, key=str) == [("a", None), ("b", None), ("sql", "a")]


def test_a_name_not_found_reads_the_engines_file_once_more_before_its_404(monkeypatch, tmp_path):
    """The operator lists an engine and drops the adapter it takes the name of in one ConfigMap edit; the pod reads
    the adapter list at each request and the engines file every POLL_S: a request in between found the name in
    neither and got a 404. A miss now runs one pass over the engines file first (one at a time with the loop's)."""
    from kiln.serving.pool.follow import start_pool

    from kiln.engine_list import document

    listed = tmp_path / "engines.json"
    entries = [EngineEntry(n, f"file:///store/engines/{n}") for n in ("a", "b")]
    listed.write_text(json.dumps(document(entries[:1])))

    async def run() -> None:
        pool, rec = make_pool(monkeypatch, {"a": 1, "b": 1}, memory_budget=10, engines_file=listed)
        pool.slots.clear()  # the file's engines only
        follower = await start_pool(pool)
        assert pool.follower is follower and sorted(pool.slots) == ["a"]
        listed.write_text(json.dumps(document(entries)))  # b joins; the loop's next pass is seconds away
        first, second = await asyncio.gather(pool.acquire("b"), pool.acquire("b"))  # the second waits for the pass
        assert first is second is pool.slots["b"] and rec.events == [("load", "b")]
        with pytest.raises(APIError, match="'a', 'b'"):
            await pool.acquire("c")

    asyncio.run(run())
