"""LoRA over HTTP, vLLM's API: ``--lora-modules``, ``"model": NAME``, /v1/models, runtime load/unload, errors,
metrics. Outputs equal the offline engine's under the same adapter (itself equal to transformers + PEFT,
tests/engine/test_lora_engine.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch

MODEL_NAME = "tiny"  # the served name the serving suite's conftest gives (tests/serving/conftest.py)
DEFAULT_FLAGS = ["--max-seq-len", "256", "--max-input-len", "128", "--num-kv-blocks", "256"]

PROMPT = [1, 57, 300, 812, 44, 9, 610, 77, 23]


def make_adapter(model_dir: Path, out_dir: Path, targets: list[str], seed: int, r: int = 8) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=16, target_modules=targets, init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.3)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def adapter_dirs(model_dir, toy_model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "one": make_adapter(model_dir, root / "one", ["q_proj", "v_proj", "down_proj"], 1),
        "two": make_adapter(model_dir, root / "two", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                      "up_proj", "down_proj"], 2),
        "three": make_adapter(model_dir, root / "three", ["o_proj", "up_proj"], 3),
        "rank16": make_adapter(model_dir, root / "rank16", ["q_proj"], 4, r=16),
        "other-base": make_adapter(toy_model("llama-tiny", hidden_size=32, intermediate_size=80),
                                   root / "other-base", ["q_proj"], 5),
    }


@pytest.fixture(scope="module")
def lora_server(start_server, adapter_dirs):
    srv = start_server(*DEFAULT_FLAGS, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                       "--max-cpu-loras", "3", "--allow-runtime-lora-updating",
                       "--lora-modules", f"one={adapter_dirs['one']}",
                       f'{{"name": "two", "path": "{adapter_dirs["two"]}", "base_model_name": "{MODEL_NAME}"}}')
    srv.wait_ready()
    return srv


@pytest.fixture(scope="module")
def reference(model_dir, adapter_dirs):
    """Offline greedy text under each adapter (None: the base)."""
    from kiln.engine import LLM, SamplingParams
    from kiln.engine.lora import LoRARequest

    llm = LLM(model_dir, max_seq_len=256, max_input_len=128, num_kv_blocks=256, enable_lora=True, max_loras=3,
              max_lora_rank=8)
    names = [None, "one", "two", "three"]
    loras = [None if n is None else LoRARequest(n, i, str(adapter_dirs[n])) for i, n in enumerate(names)]
    outs = llm.generate([PROMPT] * len(names), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        lora_request=loras)
    llm.shutdown()
    texts = {name: out.text for name, out in zip(names, outs, strict=True)}
    assert len(set(texts.values())) == len(texts), "every adapter must change the output"
    return texts


def complete(url: str, model: str, **kw) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **kw}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_models_lists_adapters_with_parent(lora_server, adapter_dirs):
    data = httpx.get(f"{lora_server.url}/v1/models").json()["data"]
    by_id = {card["id"]: card for card in data}
    assert by_id[MODEL_NAME]["parent"] is None
    for name in ("one", "two"):
        assert by_id[name]["parent"] == MODEL_NAME and by_id[name]["root"] == str(adapter_dirs[name])
        assert by_id[name]["object"] == "model"
    assert httpx.get(f"{lora_server.url}/v1/models/one").json()["root"] == str(adapter_dirs["one"])
    version = httpx.get(f"{lora_server.url}/version").json()
    assert {a["name"] for a in version["lora_adapters"]} >= {"one", "two"}
    assert version["engine_config"]["enable_lora"] is True and version["engine_config"]["max_loras"] == 2


def test_mixed_concurrent_requests_equal_offline(lora_server, reference):
    from openai import AsyncOpenAI

    async def run() -> list[str]:
        client = AsyncOpenAI(base_url=f"{lora_server.url}/v1", api_key="none")
        models = [MODEL_NAME, "one", "two"] * 3
        outs = await asyncio.gather(*(client.completions.create(
            model=m, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}) for m in models))
        assert [o.model for o in outs] == models
        return [(m, o.choices[0].text) for m, o in zip(models, outs, strict=True)]

    for model, text in asyncio.run(run()):
        assert text == reference[None if model == MODEL_NAME else model], model


def test_unknown_model_is_404_and_bad_adapters_are_400(lora_server, adapter_dirs):
    r = complete(lora_server.url, "nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    load = f"{lora_server.url}/v1/load_lora_adapter"
    for name, why in (("rank16", "max-lora-rank"), ("other-base", "another base")):
        r = httpx.post(load, json={"lora_name": name, "lora_path": str(adapter_dirs[name])}, timeout=60)
        assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
    r = httpx.post(load, json={"lora_name": "x", "lora_path": "/no/such/dir"})
    assert r.status_code == 400 and "not a directory" in r.json()["error"]["message"]
    r = httpx.post(load, json={"lora_name": "x"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "Both 'lora_name' and 'lora_path' must be provided."
    r = httpx.post(load, json={"lora_name": "one", "lora_path": str(adapter_dirs["one"])})
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    r = httpx.post(f"{lora_server.url}/v1/unload_lora_adapter", json={"lora_name": "nope"})
    assert r.status_code == 404


def test_load_use_unload_at_run_time(lora_server, adapter_dirs, reference, scrape):
    url = lora_server.url
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "three", "lora_path": str(adapter_dirs["three"])},
                   timeout=60)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'three' added successfully."
    assert "three" in {c["id"] for c in httpx.get(f"{url}/v1/models").json()["data"]}
    r = complete(url, "three")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference["three"]
    # A third adapter with two device slots: requests of "one", "two" and "three" all finish (they take turns).
    assert complete(url, "one").json()["choices"][0]["text"] == reference["one"]
    metrics = scrape(url)
    assert metrics[("kiln:lora_requests_total", (("lora_name", "three"),))] >= 1
    assert metrics[("kiln:lora_generation_tokens_total", (("lora_name", "three"),))] >= 8
    assert metrics[("kiln:lora_load_seconds_count", ())] >= 3
    info = [k for k in metrics if k[0] == "vllm:lora_requests_info"]
    assert info and dict(info[0][1])["max_lora"] == "2"
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "three"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'three' removed successfully."
    assert complete(url, "three").status_code == 404


def test_runtime_updating_is_off_by_default(server):
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp"})
    assert r.status_code == 404 and "error" in r.json()
    assert all(c["parent"] is None for c in httpx.get(f"{server.url}/v1/models").json()["data"])


def test_prefix_keys_of_an_adapter_are_its_own(lora_server, adapter_dirs, model_dir):
    """Rooted at the content digest of the adapter loaded under the name, not at the name."""
    import json

    from kiln.engine.lora.adapter import read_adapter_files
    from kiln.engine.prefix_hash import block_keys

    ids = list(range(5, 60))
    keys = {m: httpx.post(f"{lora_server.url}/v1/prefix_cache/keys", json={"model": m, "prompt": ids}).json()["keys"]
            for m in (MODEL_NAME, "one")}
    size = httpx.get(f"{lora_server.url}/v1/prefix_cache").json()["block_size"]
    base = json.loads((Path(model_dir) / "config.json").read_text())
    digest = read_adapter_files(adapter_dirs["one"], 8, base)[2]
    assert keys["one"] == [k.hex() for k in block_keys(ids, size, limit=(len(ids) - 1) // size, adapter=digest)]
    assert keys["one"] != [k.hex() for k in block_keys(ids, size, limit=(len(ids) - 1) // size, adapter="one")]
    assert keys["one"][0] != keys[MODEL_NAME][0]


def test_the_operators_adapter_file_loads_and_unloads_without_a_restart(start_server, adapter_dirs, reference,
                                                                         tmp_path):
    """The ConfigMap an operator writes (docs/lora.md, "On a cluster"), mounted as a file: a listed adapter of
    this engine is fetched from the store (signature checked) and served, one for another base version is
    not, and one dropped from the list is unloaded: the same process all along."""
    import json
    import time

    from kiln.artifacts import ArtifactStore
    from kiln.signing import Signer, generate_key_pair

    private, _ = generate_key_pair(tmp_path / "keys")
    store = ArtifactStore.from_uri(f"file://{tmp_path / 'store'}")
    store.publish("tiny-three-0123", adapter_dirs["three"], {"kind": "lora-adapter"}, signer=Signer.from_pem(private))
    listing = tmp_path / "lora" / "adapters.json"
    listing.parent.mkdir()
    entry = {"name": "three", "artifactURI": store.artifact_uri("tiny-three-0123"), "version": "tiny-three-0123",
             "baseEngineVersion": None}  # a --model server has no engine version
    other = {**entry, "name": "elsewhere", "baseEngineVersion": "another-base-version"}
    listing.write_text(json.dumps({"format": 1, "adapters": [entry, other]}))
    srv = start_server(*DEFAULT_FLAGS, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                       "--cache-dir", str(tmp_path / "cache"), env={"KILN_LORA_ADAPTERS_FILE": str(listing)})
    srv.wait_ready()

    def served() -> set[str]:
        return {card["id"] for card in httpx.get(f"{srv.url}/v1/models", timeout=10).json()["data"]}

    deadline = time.monotonic() + 60
    while "three" not in served() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert served() == {MODEL_NAME, "three"}
    assert complete(srv.url, "three").json()["choices"][0]["text"] == reference["three"]
    pid = srv.proc.pid
    listing.write_text(json.dumps({"format": 1, "adapters": [other]}))
    deadline = time.monotonic() + 60
    while "three" in served() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert served() == {MODEL_NAME} and srv.proc.pid == pid and srv.proc.poll() is None
    assert complete(srv.url, "three").status_code == 404
