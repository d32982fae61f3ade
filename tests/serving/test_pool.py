"""`kiln serve --engine ...`: four engines of three shapes in one process, memory for two (docs/pools.md).

The artifacts are small random-weight models published to a ``file://`` store; their engine.json records a
measured memory of 100 MiB each, and the pool's budget is 250 MiB, so at most two are loaded at once. Every
engine's greedy answer must equal what the same artifact gives served alone (the offline engine), through
loads and evictions; the tactic table is pinned (``aten``) on both sides.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import pytest
from conftest import Server
from kiln.engine import LLM, SamplingParams
from kiln.engine.artifact import FORMAT_VERSION, save_rank_weights, shard_checkpoint
from kiln.engine.cpu_target import describe_host

from kiln.artifacts import ArtifactStore

MIB = 2**20
SHAPES = {"a": ("llama-tiny", 0), "b": ("qwen2-tiny", 0), "c": ("mistral-tiny", 0), "d": ("llama-tiny", 1),
          "e": ("qwen2-tiny", 1)}
LIMITS = {"max_batch_size": 4, "max_num_tokens": 64, "max_seq_len": 256, "max_input_len": 128, "block_size": 16,
          "num_kv_blocks": 64}
POOL_FLAGS = ["--memory-budget", "250Mi", "--tactics", "aten", "--idle-unload-after", "6", "--pool-queue-size", "0"]


def publish(store: ArtifactStore, name: str, model_dir: Path, work: Path, memory: int = 100 * MIB) -> str:
    version = f"pool-{name}-0123456789ab"
    src = work / version
    src.mkdir()
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, src / f.name)
    save_rank_weights(shard_checkpoint(model_dir, 1, "float32", None), src / "weights")
    (src / "engine.json").write_text(json.dumps({
        "format_version": FORMAT_VERSION, "engine_version": version, "kiln_version": "0.1.0",
        "gpu": {"sku": "cpu", "arch": "cpu"},
        "engine_config": {"dtype": "float32", "quantization": "none", "tensor_parallel_size": 1, **LIMITS},
        "tuning": {"device": "cpu", "torch_num_threads": 1, "cpu": describe_host()},
        "build_report": {"memory": {"stages": {"tune": {"host_extra_bytes": memory}}}},
    }))
    store.publish(version, src, {"test": True})
    return store.artifact_uri(version)


@pytest.fixture(scope="module")
def artifacts(toy_model, tmp_path_factory) -> dict[str, tuple[str, Path]]:
    """name -> (artifact URI, its directory), every engine of :data:`SHAPES`."""
    work = tmp_path_factory.mktemp("pool-artifacts")
    store = ArtifactStore.from_uri(f"file://{work / 'store'}")
    out = {}
    for name, (preset, seed) in SHAPES.items():
        out[name] = (publish(store, name, toy_model(preset, seed=seed), work), work / f"pool-{name}-0123456789ab")
    return out


@pytest.fixture(scope="module")
def alone(artifacts) -> dict[str, str]:
    """Each engine served alone (offline, same artifact, same tactic table): its greedy answer."""
    answers = {}
    for name, (_, path) in artifacts.items():
        llm = LLM.from_artifact(path, tactics="aten")
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        answers[name] = llm.generate([f"Tell {name} a story"], params)[0].text
        llm.shutdown()
    return answers


def complete(srv: Server, model: str, max_tokens: int = 8) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/completions", timeout=120, json={
        "model": model, "prompt": f"Tell {model} a story", "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})


def states(srv: Server) -> dict[str, str]:
    """The engines' states (an adapter's card has none)."""
    return {card["id"]: card["state"] for card in httpx.get(f"{srv.url}/v1/models", timeout=10).json()["data"]
            if "state" in card}


def test_a_pool_serves_each_engine_as_alone_within_its_budget(start_server, artifacts, alone, scrape, tmp_path):
    engines_file = tmp_path / "engines.json"
    engines_file.write_text(json.dumps({"format": 1, "engines": [{"name": "d", "artifactURI": artifacts["d"][0]}]}))
    flags = [f for n in "abc" for f in ("--engine", f"{n}={artifacts[n][0]}")]
    srv = start_server(*POOL_FLAGS, "--cache-dir", str(tmp_path / "cache"),
                       source=[*flags, "--engines-file", str(engines_file)])
    srv.wait_ready()
    assert states(srv) == dict.fromkeys("abcd", "unloaded")  # nothing loads before it is asked for

    for name in "aabacdbaad":  # skewed towards a, over all four
        got = complete(srv, name)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["text"] == alone[name], name
        assert list(states(srv).values()).count("loaded") <= 2
    metrics = scrape(srv.url)
    loads = sum(v for (k, _), v in metrics.items() if k == "kiln:pool_engine_loads_total")
    evictions = sum(v for (k, labels), v in metrics.items()
                    if k == "kiln:pool_engine_evictions_total" and ("reason", "lru") in labels)
    assert loads >= 6 and evictions == loads - list(states(srv).values()).count("loaded")
    assert metrics[("kiln:pool_memory_in_use_bytes", ())] <= 250 * MIB
    assert metrics[("kiln:pool_engine_load_seconds_count", (("engine", "a"),))] >= 1
    engine_series_are_per_loaded_engine(srv)

    missing = complete(srv, "nope")
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert error["code"] == "model_not_found" and all(f"'{n}'" in error["message"] for n in "abcd")
    # /tokenize needs the engine in a pool (each has its tokenizer) and answers as that engine's /v1/completions
    # encodes: the prompt's tokens, echoed.
    anonymous = httpx.post(f"{srv.url}/tokenize", json={"prompt": "hello there"}, timeout=30)
    assert anonymous.status_code == 400 and anonymous.json()["error"]["param"] == "model", anonymous.text
    ids = httpx.post(f"{srv.url}/tokenize", json={"model": "b", "prompt": "hello there"}, timeout=30).json()["tokens"]
    echoed = httpx.post(f"{srv.url}/v1/completions", json={"model": "b", "prompt": "hello there", "max_tokens": 1,
                                                             "echo": True, "logprobs": 0}, timeout=60).json()
    assert len(echoed["choices"][0]["logprobs"]["tokens"]) == len(ids) + 1

    # The engines file is followed: d leaves (404, unloaded), e joins, without a restart.
    engines_file.write_text(json.dumps({"format": 1, "engines": [{"name": "e", "artifactURI": artifacts["e"][0]}]}))
    deadline = time.monotonic() + 30
    while set(states(srv)) != set("abce") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert set(states(srv)) == set("abce")
    assert complete(srv, "d").status_code == 404
    got = complete(srv, "e")
    assert got.status_code == 200 and got.json()["choices"][0]["text"] == alone["e"]

    # Idle engines are unloaded (--idle-unload-after 6).
    deadline = time.monotonic() + 30
    while "loaded" in states(srv).values() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert set(states(srv).values()) == {"unloaded"}


def engine_series_are_per_loaded_engine(srv: Server) -> None:
    """Every engine-level series a single server exports, a row per loaded engine under its name, none for an
    unloaded one; one family per name."""
    from prometheus_client.parser import text_string_to_metric_families

    before = states(srv)
    families = list(text_string_to_metric_families(httpx.get(f"{srv.url}/metrics", timeout=10).text))
    after = states(srv)  # an engine unloaded (--idle-unload-after) or loaded meanwhile is not judged
    assert len({f.name for f in families}) == len(families)
    rows = {(x.name, x.labels.get("model_name")): x.value for f in families for x in f.samples}
    steady = [name for name in after if before.get(name) == after[name] and after[name] in ("loaded", "unloaded")]
    loaded = {name for name in steady if after[name] == "loaded"}
    assert loaded, (before, after)
    for name in steady:
        for series in ("kiln:kv_cache_total_blocks", "kiln:num_requests_running", "kiln:kv_cache_usage_perc",
                       "kiln:prefix_cache_queries_total", "kiln:iteration_batch_size_count"):
            assert ((series, name) in rows) == (name in loaded), (series, name)
        if name in loaded:
            assert rows[("kiln:kv_cache_total_blocks", name)] == LIMITS["num_kv_blocks"]
            assert rows[("kiln:iteration_batch_size_count", name)] >= 1  # it ran steps
            assert rows[("kiln:num_requests_running", name)] == 0
    picker = [x.labels.get("model_name") for f in families if f.name == "vllm:num_requests_waiting" for x in f.samples]
    assert len(picker) == 1 and picker[0] not in after  # the pod's one row, under the server's name


def test_a_request_that_cannot_be_placed_gets_503_and_in_flight_engines_are_never_evicted(start_server,
                                                                                          artifacts, tmp_path):
    flags = [f for n in "abc" for f in ("--engine", f"{n}={artifacts[n][0]}")]
    srv = start_server(*POOL_FLAGS, "--cache-dir", str(tmp_path / "cache"), source=flags)
    srv.wait_ready()
    for name in "ab":
        assert complete(srv, name).status_code == 200
    body = {"prompt": "x", "max_tokens": 240, "temperature": 0, "ignore_eos": True, "stream": True, "n": 4}
    with httpx.Client(timeout=120) as client, \
            client.stream("POST", f"{srv.url}/v1/completions", json={**body, "model": "a"}) as first, \
            client.stream("POST", f"{srv.url}/v1/completions", json={**body, "model": "b"}) as second:
        streams = [first.iter_lines(), second.iter_lines()]
        for lines in streams:  # both generating: in flight
            assert next(line for line in lines if line.startswith("data:"))
        refused = complete(srv, "c")  # no room, queue size 0
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "1" and refused.json()["error"]["code"] == "queue_full"
        ends = ["".join(lines) for lines in streams]
    for end in ends:  # both ran to the end: neither was evicted under them
        assert '"finish_reason":"length"' in end and "[DONE]" in end
    assert states(srv) == {"a": "loaded", "b": "loaded", "c": "unloaded"}


def test_an_engine_too_big_for_the_budget_is_refused_at_start_naming_both(artifacts, tmp_path):
    srv = Server([f"--engine=a={artifacts['a'][0]}"], tmp_path / "server.log", "--memory-budget", "50Mi",
                 "--cache-dir", str(tmp_path / "cache"))
    try:
        assert srv.proc.wait(timeout=120) == 1
    finally:
        srv.stop()
    log = srv.log()
    assert "100.0 MiB" in log and "50.0 MiB" in log and "--memory-budget" in log and "Traceback" not in log


def test_an_engines_adapters_are_served_by_the_pool_and_come_back_with_its_reload(start_server, artifacts, toy_model,
                                                                                   tmp_path):
    """The adapter list a pool's pods follow (docs/pools.md, "LoRA adapters"): an adapter of engine a's version
    places a (loading it) and answers as the same artifact with that adapter offline; another engine's adapter is
    not a's; a evicted and loaded again serves its adapter again, the same process all along."""
    from kiln.engine.lora import LoRARequest
    from test_lora_serving import make_adapter

    from kiln.signing import Signer, generate_key_pair

    adapter = make_adapter(toy_model("llama-tiny", seed=0), tmp_path / "adapter", ["q_proj", "down_proj"], 7)
    private, _ = generate_key_pair(tmp_path / "keys")
    store = ArtifactStore.from_uri(f"file://{tmp_path / 'store'}")
    store.publish("pool-adapter-0123", adapter, {"kind": "lora-adapter"}, signer=Signer.from_pem(private))
    entry = {"name": "story", "artifactURI": store.artifact_uri("pool-adapter-0123"), "version": "pool-adapter-0123",
             "baseEngineVersion": "pool-a-0123456789ab"}
    listing = tmp_path / "adapters.json"
    listing.write_text(json.dumps({"format": 1, "adapters": [entry, {**entry, "name": "of-b",
                                                                     "baseEngineVersion": "pool-b-0123456789ab"}]}))
    lora = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
    llm = LLM.from_artifact(artifacts["a"][1], tactics="aten", enable_lora=True, max_loras=2, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want, base = [o.text for o in llm.generate(["Tell story a story"] * 2, params,
                                                lora_request=[LoRARequest("story", 1, str(adapter)), None])]
    llm.shutdown()
    assert want != base  # the adapter changes the answer

    flags = [f for n in "abc" for f in ("--engine", f"{n}={artifacts[n][0]}")]
    srv = start_server(*POOL_FLAGS, *lora, "--cache-dir", str(tmp_path / "cache"), source=flags,
                       env={"KILN_LORA_ADAPTERS_FILE": str(listing)})
    srv.wait_ready()
    for _ in range(2):  # first load, then a reload after a was evicted by b and c
        got = complete(srv, "story")
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["text"] == want and states(srv)["a"] == "loaded"
        cards = {c["id"]: c for c in httpx.get(f"{srv.url}/v1/models", timeout=10).json()["data"]}
        assert cards["story"]["parent"] == "a" and "of-b" not in cards  # b is not loaded, a does not serve it
        for name in "bc":
            assert complete(srv, name).status_code == 200
        assert states(srv)["a"] == "unloaded"
    assert "story" not in {c["id"] for c in httpx.get(f"{srv.url}/v1/models", timeout=10).json()["data"]}
