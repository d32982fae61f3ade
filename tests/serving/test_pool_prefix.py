"""Routing signals of an engine pool (docs/pools.md, docs/prefix-routing.md): the prefix-cache keys are the engine's,
named by ``model`` and rooted at its version, and ``kiln:num_requests_waiting`` counts the pool's queue.

In process, over ASGI, with each engine's load replaced by a fake engine (a tokenizer, a block size, a queue) as in
test_pool_unit.py: the routes, the pool's placement and the metrics are the server's own code. The expected keys
are written out with hashlib from the documented scheme, not imported from kiln.
"""

from __future__ import annotations

import asyncio
import hashlib
import struct
from types import SimpleNamespace

import httpx
import pytest
from conftest import engine_stats
from kiln.engine.prefix_hash import block_keys
from kiln.serving.app import create_app
from kiln.serving.config import ServeConfig
from kiln.serving.metrics import ServingMetrics
from kiln.serving.pool.pool import EnginePool
from kiln.serving.pool.settings import PoolSettings
from kiln.serving.pool.slot import EngineSlot
from kiln.serving.server_state import READY
from prometheus_client.parser import text_string_to_metric_families

from kiln.engine_list import EngineEntry

BLOCK = {"a": 4, "b": 8}  # each engine its own block size
DIGEST = "ab" * 32  # the content digest of engine b's adapter "tone"


def version(name: str) -> str:
    return f"pool-{name}-0123456789ab"  # what read_memory reads from the artifact URI


class FakeTokenizer:
    chat_template = "{{ messages }}"

    def __init__(self, shift: int) -> None:
        self.shift = shift  # each engine tokenizes the same text to other ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) + self.shift for c in text]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **_: object) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" * add_generation_prompt)


class FakeEngine:
    is_running = True

    def __init__(self, name: str) -> None:
        self.tokenizer = FakeTokenizer(1000 if name == "b" else 0)
        self.engine_config = SimpleNamespace(enable_prefix_caching=True, max_batch_size=4, max_seq_len=256,
                                             hf_config={"vocab_size": 2048})
        self.block_size, self.num_waiting = BLOCK[name], 0

    def stats(self) -> object:
        return engine_stats(block_size=self.block_size, num_total_blocks=64, num_waiting=self.num_waiting)

    def lora_digest(self, name: str) -> str | None:
        return DIGEST if name == "tone" else None


class FakeLoras:
    def __init__(self, names: set[str]) -> None:
        self.names = names

    def get(self, name: str) -> SimpleNamespace | None:
        return SimpleNamespace(lora_name=name) if name in self.names else None

    async def ensure_loaded(self, lora: SimpleNamespace) -> None:
        pass

    def cards(self, created: int, base: str) -> list[dict]:
        return []


@pytest.fixture
def loads(monkeypatch) -> list[str]:
    """Fake engine loads (recorded, in order): engine b holds the adapter "tone"."""
    loaded: list[str] = []

    def read_memory(slot: EngineSlot) -> None:
        slot.memory_bytes, slot.memory_source, slot.version = 1, "test", version(slot.name)

    async def load(slot: EngineSlot) -> None:
        loaded.append(slot.name)
        slot.state.engine, slot.state.engine_info, slot.state.phase = FakeEngine(slot.name), {}, READY
        slot.loras = FakeLoras({"tone"} if slot.name == "b" else set())

    async def unload(slot: EngineSlot) -> None:
        slot.state.engine = None

    monkeypatch.setattr(EngineSlot, "read_memory", read_memory)
    monkeypatch.setattr(EngineSlot, "load", load)
    monkeypatch.setattr(EngineSlot, "unload", unload)
    return loaded


@pytest.fixture
async def pool_app(loads):
    engines = {n: EngineEntry(n, f"file:///store/engines/{version(n)}") for n in "ab"}
    app = create_app(ServeConfig(served_model_name="pool"), PoolSettings(engines=engines, memory_budget=10))
    await app.state.kiln.load()  # the pool starts: both listed, neither loaded
    try:
        yield app
    finally:
        await app.state.kiln.pool.shutdown()


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kiln")


def documented_keys(ids: list[int], block_size: int, engine: str | None = None, digest: str | None = None,
                    salt: str | None = None) -> list[str]:
    """docs/prefix-routing.md's scheme with hashlib: the last token is always computed."""
    named = b"kiln-prefix-v1" + (b"\x00engine\x00" + engine.encode() if engine else b"")
    root = hashlib.sha256(named + (b"\x00lora\x00" + digest.encode() if digest else b"")).digest()
    if salt:
        root = hashlib.sha256(root + b"\x00salt\x00" + salt.encode()).digest()
    keys, parent = [], root
    for i in range((len(ids) - 1) // block_size):
        parent = hashlib.sha256(parent + struct.pack(f"<{block_size}I", *ids[i * block_size:(i + 1) * block_size]))
        parent = parent.digest()
        keys.append(parent.hex())
    return keys


async def test_two_engines_of_a_pool_give_one_prompt_different_keys_rooted_at_their_versions(pool_app, loads):
    ids = list(range(1, 18))
    async with client(pool_app) as http:
        got = {n: (await http.post("/v1/prefix_cache/keys", json={"model": n, "prompt": ids})).json() for n in "ab"}
        salted = (await http.post("/v1/prefix_cache/keys", json={"model": "a", "prompt": ids, "cache_salt": "t"}))
        text = (await http.post("/v1/prefix_cache/keys", json={"model": "b", "prompt": "hello, world!"})).json()
    assert loads == ["a", "b"]  # each loaded as a request for it would load it
    for name in "ab":
        assert got[name]["engine_version"] == version(name) and got[name]["block_size"] == BLOCK[name]
        assert got[name]["keys"] == documented_keys(ids, BLOCK[name], engine=version(name))
    assert got["a"]["keys"][:2] != documented_keys(ids, 4)[:2]  # not the single engine's keys either
    assert set(got["a"]["keys"]).isdisjoint(documented_keys(ids, 4, engine=version("b")))
    assert salted.json()["keys"] == documented_keys(ids, 4, engine=version("a"), salt="t")
    b_ids = [ord(c) + 1000 for c in "hello, world!"]  # engine b's own tokenizer
    assert text["num_prompt_tokens"] == len(b_ids) and text["keys"] == documented_keys(b_ids, 8, version("b"))


async def test_an_adapters_keys_in_a_pool_are_rooted_at_its_engine_and_its_digest(pool_app):
    ids = list(range(1, 18))
    async with client(pool_app) as http:
        assert (await http.post("/v1/prefix_cache/keys", json={"model": "b", "prompt": ids})).status_code == 200
        tone = (await http.post("/v1/prefix_cache/keys", json={"model": "tone", "prompt": ids})).json()
    assert tone["engine_version"] == version("b")
    assert tone["keys"] == documented_keys(ids, 8, engine=version("b"), digest=DIGEST)
    assert tone["keys"] != documented_keys(ids, 8, digest=DIGEST)


async def test_a_dialect_body_in_a_pool_is_rendered_by_the_engine_its_model_names(pool_app):
    body = {"model": "b", "max_tokens": 5, "messages": [{"role": "user", "content": "Hello there, how are you?"}]}
    async with client(pool_app) as http:
        got = (await http.post("/v1/prefix_cache/keys?endpoint=/v1/messages", json=body)).json()
        chat = (await http.post("/v1/prefix_cache/keys", json={"model": "b", "messages": body["messages"]})).json()
    rendered = [ord(c) + 1000 for c in "<user>Hello there, how are you?<assistant>"]
    assert got["num_prompt_tokens"] == len(rendered) and got["keys"] == documented_keys(rendered, 8, version("b"))
    assert chat["keys"] == got["keys"]


async def test_the_scheme_of_a_pool_is_asked_by_model_and_unknown_models_name_the_pools(pool_app, loads):
    async with client(pool_app) as http:
        bare = await http.get("/v1/prefix_cache")
        assert loads == []
        scheme = (await http.get("/v1/prefix_cache", params={"model": "b"})).json()
        missing = await http.get("/v1/prefix_cache", params={"model": "nope"})
        posted = await http.post("/v1/prefix_cache/keys", json={"model": "nope", "prompt": [1, 2, 3]})
    assert bare.status_code == 400
    error = bare.json()["error"]
    assert error["param"] == "model" and "'a', 'b'" in error["message"] and "?model=" in error["message"]
    assert scheme["block_size"] == 8 and scheme["engine_version"] == version("b") and loads == ["b"]
    for answer in (missing, posted):
        assert answer.status_code == 404
        assert answer.json()["error"]["code"] == "model_not_found" and "'a', 'b'" in answer.json()["error"]["message"]


async def test_a_single_engines_keys_and_scheme_are_as_before():
    app = create_app(ServeConfig(served_model_name="tiny"))
    app.state.kiln.state.engine, app.state.kiln.state.phase = FakeEngine("a"), READY
    ids = list(range(1, 18))
    async with client(app) as http:
        scheme = (await http.get("/v1/prefix_cache")).json()
        keys = (await http.post("/v1/prefix_cache/keys", json={"model": "tiny", "prompt": ids})).json()
        missing = await http.get("/v1/prefix_cache", params={"model": "nope"})
    assert "engine_version" not in scheme and "engine_version" not in keys
    assert keys["keys"] == documented_keys(ids, 4) == [k.hex() for k in block_keys(ids, 4, limit=4)]
    assert missing.status_code == 404 and "'tiny'" in missing.json()["error"]["message"]


def waiting(text: str) -> dict[str, float]:
    return {s.labels["model_name"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "kiln:num_requests_waiting"}


async def test_num_requests_waiting_counts_each_engines_queue_and_the_pools(pool_app):
    ctx = pool_app.state.kiln
    ctx.pool.settings.max_loaded_engines = 1
    held = (await ctx.pool.acquire("a")).state.admit(1)  # a busy: b cannot be placed
    ctx.pool.slots["a"].state.engine.num_waiting = 2  # two queued in engine a
    queued = [asyncio.create_task(ctx.pool.acquire("b")) for _ in range(3)]
    await asyncio.sleep(0.05)
    async with client(pool_app) as http:
        text = (await http.get("/metrics")).text
    assert text.count("# TYPE kiln:num_requests_waiting gauge") == 1
    assert waiting(text) == {"a": 2, "pool": 3}  # sum over the pod: 5
    assert "kiln:pool_queue_length 3.0" in text
    held.release()
    await asyncio.wait_for(asyncio.gather(*queued), 2)
    assert waiting(ctx.metrics.render().decode()) == {"b": 0, "pool": 0}


async def test_requests_waiting_on_a_load_count_as_waiting(loads, monkeypatch):
    gate = asyncio.Event()
    load = EngineSlot.load

    async def slow_load(slot: EngineSlot) -> None:
        await gate.wait()
        await load(slot)

    monkeypatch.setattr(EngineSlot, "load", slow_load)
    metrics = ServingMetrics("p", lambda: None)
    pool = EnginePool(PoolSettings(memory_budget=10), ServeConfig(served_model_name="p"), metrics)
    pool.add(pool.make_slot(EngineEntry("a", "file:///store/engines/a")))
    first = [asyncio.create_task(pool.acquire("a")) for _ in range(2)]
    await asyncio.sleep(0.05)
    assert pool.num_queued == 0 and waiting(pool.metrics.render().decode()) == {"p": 2}  # loading, not queued
    gate.set()
    await asyncio.wait_for(asyncio.gather(*first), 2)
    assert waiting(pool.metrics.render().decode()) == {"a": 0, "p": 0}


@pytest.mark.slow
def test_a_real_pools_keys_predict_each_engines_cache_hits(start_server, toy_model, tmp_path):
    """`kiln serve --engine a=... --engine b=...` on two random-weight engines: one prompt's keys differ per engine,
    each the documented chain under its version, and a repeat of the prompt hits exactly the predicted blocks."""
    from test_pool import publish

    from kiln.artifacts import ArtifactStore

    store = ArtifactStore.from_uri(f"file://{tmp_path / 'store'}")
    uris = {n: publish(store, n, toy_model(preset), tmp_path) for n, preset in (("a", "llama-tiny"),
                                                                                 ("b", "qwen2-tiny"))}
    srv = start_server("--memory-budget", "250Mi", "--tactics", "aten", "--cache-dir", str(tmp_path / "cache"),
                       source=[f for n, uri in uris.items() for f in ("--engine", f"{n}={uri}")])
    srv.wait_ready()
    ids = list(range(5, 5 + 40))
    got = {}
    for name in "ab":
        keys = httpx.post(f"{srv.url}/v1/prefix_cache/keys", json={"model": name, "prompt": ids}, timeout=120).json()
        assert keys["engine_version"] == f"pool-{name}-0123456789ab"
        assert keys["keys"] == documented_keys(ids, keys["block_size"], engine=keys["engine_version"])
        got[name] = keys
        hits = []
        for _ in range(2):  # max_tokens 1: exactly the prompt's full blocks get cached
            out = httpx.post(f"{srv.url}/v1/completions", timeout=120,
                             json={"model": name, "prompt": ids, "max_tokens": 1}).json()
            hits.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert hits == [0, len(keys["keys"]) * keys["block_size"]]
    assert set(got["a"]["keys"]).isdisjoint(got["b"]["keys"])
    samples = {s.labels["model_name"] for f in text_string_to_metric_families(httpx.get(f"{srv.url}/metrics").text)
               for s in f.samples if s.name == "kiln:num_requests_waiting"}
    assert {"a", "b"} < samples and len(samples) == 3  # both engines', and the pool's under the server's name


def test_num_requests_waiting_has_one_row_per_label_set():
    """An engine named as the pool, or a slot draining beside its successor under one name: their rows sum, never two
    samples with one label set (Prometheus would drop one, and the autoscaler read the other); so do the other
    engine-level series, but for an ``_info`` one, whose first row stays."""
    from types import SimpleNamespace

    from kiln.serving.pool.metrics import EnginesCollector
    from kiln.serving.pool.slot import LOADED

    def slot(name: str, waiting: int, kv: float = 0.25) -> SimpleNamespace:
        stats = engine_stats(num_waiting=waiting, num_running=1, kv_usage=kv, num_total_blocks=64,
                             prefix_cache_queries=10, prefix_cache_hits=4, num_steps=3, sum_running=3, block_size=16)
        engine = SimpleNamespace(stats=lambda: stats, engine=SimpleNamespace(lora_info=lambda: None))
        return SimpleNamespace(name=name, status=LOADED, state=SimpleNamespace(engine=engine), num_waiting=0,
                               metrics=SimpleNamespace(labels={"model_name": name}))

    pool = SimpleNamespace(metrics=SimpleNamespace(labels={"model_name": "chat"}), num_waiting=5,
                           slots={"chat": slot("chat", 3), "b": slot("b", 1, kv=0.5)}, leaving=[slot("b", 2)],
                           settings=SimpleNamespace(max_loaded_engines=2))
    families = {f.name: f for f in EnginesCollector(pool).collect()}
    assert len(families) == len(list(EnginesCollector(pool).collect()))

    def rows(name: str) -> list[tuple[str, float]]:
        return sorted((s.labels["model_name"], s.value) for s in families[name].samples if s.name == name)

    assert rows("kiln:num_requests_waiting") == [("b", 3.0), ("chat", 8.0)]
    assert rows("kiln:num_requests_running") == [("b", 2.0), ("chat", 1.0)]
    # The endpoint picker's names are the pod's, one row under the pool's name: every queue (3 + 1 + 2 + the 5 no
    # engine has admitted), every running request, the fullest KV cache.
    assert rows("vllm:num_requests_waiting") == [("chat", 11.0)]
    assert rows("vllm:num_requests_running") == [("chat", 3.0)]
    assert rows("vllm:kv_cache_usage_perc") == [("chat", 0.5)]
    assert [s.labels["block_size"] for s in families["vllm:cache_config_info"].samples] == ["16"]
    empty = SimpleNamespace(metrics=pool.metrics, num_waiting=2, slots={}, leaving=[],
                            settings=SimpleNamespace(max_loaded_engines=None))
    got = {f.name: [s.value for s in f.samples] for f in EnginesCollector(empty).collect()}
    assert got["kiln:num_requests_waiting"] == [2.0] and got["vllm:num_requests_waiting"] == [2.0]
    assert not [n for n in got if n.startswith("kiln:") and n != "kiln:num_requests_waiting"]


def test_the_endpoint_picker_sees_a_pool_pods_loaded_engines_as_active_models():
    """An InferencePool over pool pods (``spec.routing.inferencePool`` of the pool): the picker's LoRA-affinity
    scorer reads ``vllm:lora_requests_info``, so a pool pod lists its loaded engines (and the adapters running in
    them) as running, the engines requests wait to see loaded as waiting, and how many it holds as max_lora."""
    from types import SimpleNamespace

    from kiln.serving.pool.metrics import EnginesCollector
    from kiln.serving.pool.slot import LOADED, UNLOADED

    def slot(name: str, status: str, waiting: int = 0, lora=None) -> SimpleNamespace:
        stats = engine_stats(num_waiting=0, num_running=0, kv_usage=0.0, num_total_blocks=8, prefix_cache_queries=0,
                             prefix_cache_hits=0, num_steps=0, sum_running=0, block_size=16)
        engine = SimpleNamespace(stats=lambda: stats, engine=SimpleNamespace(lora_info=lambda: lora))
        return SimpleNamespace(name=name, status=status, num_waiting=waiting, metrics=SimpleNamespace(
            labels={"model_name": name}), state=SimpleNamespace(engine=engine if status == LOADED else None))

    slots = {"a": slot("a", LOADED, lora={"running": ["sql"], "waiting": ["poem"], "max_lora": 4}),
             "b": slot("b", UNLOADED, waiting=2), "c": slot("c", UNLOADED), "d": slot("d", LOADED)}
    for limit, max_lora in ((2, "2"), (None, "4")):  # --max-loaded-engines, else every listed engine
        pool = SimpleNamespace(metrics=SimpleNamespace(labels={"model_name": "shared"}), num_waiting=2, slots=slots,
                               leaving=[], settings=SimpleNamespace(max_loaded_engines=limit))
        families = {f.name: f for f in EnginesCollector(pool).collect()}
        (info,) = families["vllm:lora_requests_info"].samples
        assert info.labels == {"model_name": "shared", "running_lora_adapters": "a,d,sql",
                               "waiting_lora_adapters": "b,poem", "max_lora": max_lora}
