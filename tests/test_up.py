"""`kiln up`: build a manifest into a local store and serve it, as a real subprocess over HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from netutil import free_port

API = "serving.kiln.dev/v1alpha1"

REPO = Path(__file__).resolve().parents[1]



def wait_ready(base: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"kiln up exited with {proc.returncode}"
        try:
            if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{base}/ready never answered 200")


def test_kiln_up_builds_serves_and_stops(toy_model, tmp_path):
    import torch
    from openai import OpenAI
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = toy_model("llama-tiny")
    manifest = tmp_path / "tiny.yaml"
    manifest.write_text(yaml.safe_dump({
        "apiVersion": "serving.kiln.dev/v1alpha1", "kind": "LLMEngine", "metadata": {"name": "tiny-up"},
        "spec": {"model": {"source": f"file://{model_dir}"}, "gpu": "cpu", "dtype": "float32", "maxBatchSize": 4,
                 "maxInputLen": 128, "maxSeqLen": 256, "maxNumTokens": 128},
    }))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln", "up", "-f", str(manifest), "--store", f"file://{tmp_path / 'store'}",
         "--port", str(port), "--work-dir", str(tmp_path / "work")],
        cwd=REPO, env={**os.environ, "KILN_TERMINATION_LOG": str(tmp_path / "term")},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        wait_ready(base, proc)
        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        out = client.completions.create(model="tiny-up", prompt="The kiln engine", max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        ids = tok("The kiln engine", return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                              do_sample=False, pad_token_id=tok.eos_token_id)
        assert out.choices[0].text == tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
        assert out.usage.completion_tokens == 8
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, output
    assert "built: " in output and "quality gate:" in output and f"on http://127.0.0.1:{port}/v1" in output


@pytest.mark.slow
def test_demo_script_runs_end_to_end():
    """`make demo`'s script: gets the real model's GGUF if missing, builds, serves, answers, shows the cache hit."""
    proc = subprocess.run([sys.executable, "examples/demo.py"], cwd=REPO, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Q: What is the capital of France?\nA: " in proc.stdout
    answer = proc.stdout.split("Q: What is the capital of France?\nA: ", 1)[1].splitlines()[0]
    assert "Paris" in answer
    assert "cache hit: smollm2-135m-instruct-q4-1-" in proc.stdout and "quality gate: KL" in proc.stdout


def test_kiln_up_stops_at_a_failed_build_with_its_exit_code(toy_model, tmp_path):
    from click.testing import CliRunner

    from kiln.up import up

    manifest = tmp_path / "too-long.yaml"
    manifest.write_text(yaml.safe_dump({
        "apiVersion": "serving.kiln.dev/v1alpha1", "kind": "LLMEngine", "metadata": {"name": "too-long"},
        "spec": {"model": {"source": f"file://{toy_model('llama-tiny')}"}, "gpu": "cpu", "dtype": "float32",
                 "maxInputLen": 1024, "maxSeqLen": 2048, "maxNumTokens": 1024},
    }))
    result = CliRunner().invoke(up, ["-f", str(manifest), "--store", f"file://{tmp_path / 'store'}", "--port", "0"])
    assert result.exit_code == 2
    assert "spec.maxSeqLen: 2048 exceeds the model's 1024 positions" in result.output
    assert "serving" not in result.output


def test_kiln_up_checks_the_port_before_it_builds(toy_model, tmp_path):
    """A busy port is one line naming --port, exit 2, before a build of minutes (nothing is built)."""
    import socket

    from click.testing import CliRunner

    from kiln.up import up

    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump({
        "apiVersion": "serving.kiln.dev/v1alpha1", "kind": "LLMEngine", "metadata": {"name": "busy"},
        "spec": {"model": {"source": f"file://{toy_model('llama-tiny')}"}, "gpu": "cpu", "dtype": "float32"}}))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = CliRunner().invoke(up, ["-f", str(manifest), "--store", f"file://{tmp_path / 'store'}",
                                         "--port", str(port)])
    assert result.exit_code == 2, result.output
    assert f"error: --port {port}: 127.0.0.1:{port} is already in use" in result.output
    assert not (tmp_path / "store").exists()


def test_kiln_up_serves_the_manifests_lora_adapters(toy_model, tmp_path):
    """`spec.lora.adapters` under `kiln up`: each adapter built into the store as its own signed artifact and
    served by name from the first request; an adapter that does not fit the base is reported and left out,
    the base and the others served all the same (docs/lora.md)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model_dir = toy_model("llama-tiny")
    adapters = {}
    for name, r in (("tone", 8), ("too-wide", 32)):
        torch.manual_seed(len(name))
        peft = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                              LoraConfig(r=r, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                         init_lora_weights=False))
        peft.save_pretrained(tmp_path / name)
        adapters[name] = tmp_path / name
    manifest = tmp_path / "tiny-lora.yaml"
    manifest.write_text(yaml.safe_dump({
        "apiVersion": "serving.kiln.dev/v1alpha1", "kind": "LLMEngine", "metadata": {"name": "tiny-lora"},
        "spec": {"model": {"source": f"file://{model_dir}"}, "gpu": "cpu", "dtype": "float32", "maxBatchSize": 4,
                 "maxInputLen": 128, "maxSeqLen": 256, "maxNumTokens": 128,
                 "lora": {"maxLoras": 2, "maxLoraRank": 16,
                          "adapters": [{"name": n, "source": f"file://{p}"} for n, p in adapters.items()]}},
    }))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln", "up", "-f", str(manifest), "--store", f"file://{tmp_path / 'store'}",
         "--port", str(port), "--work-dir", str(tmp_path / "work")],
        cwd=REPO, env={**os.environ, "KILN_KEY_DIR": str(tmp_path / "keys")},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        wait_ready(base, proc)
        models = {card["id"]: card for card in httpx.get(f"{base}/v1/models", timeout=10).json()["data"]}
        assert set(models) == {"tiny-lora", "tone"} and models["tone"]["parent"] == "tiny-lora"
        body = {"prompt": "The kiln engine", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        texts = {m: httpx.post(f"{base}/v1/completions", json={**body, "model": m}, timeout=60).json()
                 ["choices"][0]["text"] for m in ("tiny-lora", "tone")}
        assert texts["tone"] != texts["tiny-lora"]  # the adapter is applied, not ignored
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, output
    assert "adapter tone: built: " in output
    assert "adapter 'too-wide' is not served" in output and "maxLoraRank" in output


def _engine_manifest(path: Path, name: str, model_dir: Path) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "serving.kiln.dev/v1alpha1", "kind": "LLMEngine", "metadata": {"name": name},
        "spec": {"model": {"source": f"file://{model_dir}"}, "gpu": "cpu", "dtype": "float32", "maxBatchSize": 4,
                 "maxInputLen": 128, "maxSeqLen": 256, "maxNumTokens": 128},
    }))
    return path


def test_a_pool_manifest_names_its_engines_and_becomes_serve_flags(toy_model, tmp_path):
    from kiln.up import pool_serve_command, read_manifests

    (tmp_path / "engines").mkdir()
    for name in ("one", "two"):
        _engine_manifest(tmp_path / "engines" / f"{name}.yaml", name, toy_model("llama-tiny"))
    pool = tmp_path / "pool.yaml"
    pool.write_text(yaml.safe_dump({
        "apiVersion": "serving.kiln.dev/v1alpha1", "kind": "LLMEnginePool", "metadata": {"name": "small"},
        "spec": {"engines": ["engines/one.yaml", "engines/two.yaml"], "maxLoadedEngines": 1,
                 "memoryBudget": "6Gi", "idleUnloadAfter": 600, "port": 8123, "batchInvariant": True},
    }))
    engines, manifest = read_manifests((pool,))
    assert [e.metadata.name for e in engines] == ["one", "two"] and manifest.port == 8123
    cmd = pool_serve_command([(e, f"file:///s/engines/{e.metadata.name}") for e in engines], manifest,
                             "127.0.0.1", 8123, tmp_path / "key.pem")
    assert cmd[cmd.index("--served-model-name") + 1] == "small"
    assert [cmd[i + 1] for i, w in enumerate(cmd) if w == "--engine"] == ["one=file:///s/engines/one",
                                                                           "two=file:///s/engines/two"]
    for flag, value in (("--max-loaded-engines", "1"), ("--memory-budget", "6Gi"), ("--idle-unload-after", "600"),
                        ("--load-timeout", "300"), ("--pool-queue-size", "64"), ("--max-queue-len", "256"),
                        ("--drain-timeout", "30")):
        assert cmd[cmd.index(flag) + 1] == value and cmd.count(flag) == 1, flag
    assert cmd.count("--batch-invariant") == 1


def test_engines_served_in_one_process_run_one_batch_invariant_setting(toy_model, tmp_path):
    from kiln.manifest import ManifestError
    from kiln.up import pool_serve_command, read_manifests

    paths = [_engine_manifest(tmp_path / f"{n}.yaml", n, toy_model("llama-tiny")) for n in ("one", "two")]

    def steady(path: Path) -> None:
        doc = yaml.safe_load(path.read_text())
        doc["spec"]["serving"] = {"batchInvariant": True}
        path.write_text(yaml.safe_dump(doc))

    steady(paths[0])
    with pytest.raises(ManifestError, match=r"spec.serving.batchInvariant: 'one' asks for it and the other engines "
                                            r"do not.*make them agree, or serve them from a pool manifest"):
        read_manifests(tuple(paths))
    steady(paths[1])
    engines, _ = read_manifests(tuple(paths))  # both ask: the one process runs with it
    doc = yaml.safe_load(paths[0].read_text())  # a chat setting is the one process's too (--reasoning-parser)
    doc["spec"]["serving"]["reasoningParser"] = "qwen3"
    paths[0].write_text(yaml.safe_dump(doc))
    with pytest.raises(ManifestError, match=r"spec.serving.reasoningParser: the engines ask for different values "
                                            r"\('one': \"qwen3\", 'two': unset\).*make them agree"):
        read_manifests(tuple(paths))
    doc["spec"]["serving"].pop("reasoningParser")
    paths[0].write_text(yaml.safe_dump(doc))
    cmd = pool_serve_command([(e, "file:///s") for e in engines], None, "127.0.0.1", 8000, tmp_path / "key.pem")
    assert cmd.count("--batch-invariant") == 1
    pool = tmp_path / "pool.yaml"
    pool.write_text(yaml.safe_dump({"apiVersion": API, "kind": "LLMEnginePool", "metadata": {"name": "p"},
                                    "spec": {"engines": ["one.yaml"], "batchInvariant": True}}))
    with pytest.raises(ManifestError, match=r"spec.serving.batchInvariant: this engine is served by the pool "
                                            r"manifest 'p'.*set it as the pool's spec.batchInvariant and remove it"):
        read_manifests((pool,))


def test_a_pool_manifest_member_is_refused_what_the_operator_refuses_a_pool_member(toy_model, tmp_path):
    """kiln up and the operator share kiln.pool_api.member_problem: a member's own key is refused, not ignored."""
    from kiln.manifest import ManifestError
    from kiln.up import read_manifests

    path = _engine_manifest(tmp_path / "one.yaml", "one", toy_model("llama-tiny"))
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["serving"] = {"apiKeySecret": "one-key"}
    path.write_text(yaml.safe_dump(doc))
    pool = tmp_path / "pool.yaml"
    pool.write_text(yaml.safe_dump({"apiVersion": API, "kind": "LLMEnginePool", "metadata": {"name": "p"},
                                    "spec": {"engines": ["one.yaml"]}}))
    with pytest.raises(ManifestError, match=r"spec.serving.apiKeySecret: this engine is served by the pool manifest "
                                            r"'p'.*set it as the pool's spec.apiKeySecret .*and remove it here, or "
                                            r"serve it outside the pool") as err:
        read_manifests((pool,))
    assert err.value.origin == str(path)
    engines, _ = read_manifests((path,))  # on its own, its manifest is served as it is
    assert engines[0].spec.serving.api_key_secret == "one-key"
    assert "$KILN_API_KEY" in str(err.value)  # what guards a kiln up pool: it reads no Secret
    doc["spec"]["serving"] = {"replicas": 3, "port": 9000}  # its pods' own: kept for when it leaves the pool
    path.write_text(yaml.safe_dump(doc))
    assert read_manifests((pool,))[0][0].spec.serving.replicas == 3


def test_a_pool_manifest_is_read_as_the_cluster_s_llmenginepool(toy_model, tmp_path):
    """kiln up and the operator read one type (kiln.pool_api.LLMEnginePool): its rules and its kiln serve flags."""
    from kiln.manifest import ManifestError
    from kiln.pool_api import serve_flags
    from kiln.up import read_manifests

    _engine_manifest(tmp_path / "one.yaml", "one", toy_model("llama-tiny"))
    pool = tmp_path / "pool.yaml"

    def problems(spec: dict) -> list[str]:
        pool.write_text(yaml.safe_dump({"apiVersion": "serving.kiln.dev/v1alpha1", "kind": "LLMEnginePool",
                                        "metadata": {"name": "p"}, "spec": {"engines": ["one.yaml"], **spec}}))
        with pytest.raises(ManifestError) as info:
            read_manifests((pool,))
        assert info.value.origin == f"LLMEnginePool manifest {pool}"
        return info.value.problems

    assert problems({"memoryBudget": "6 GB"}) == [
        "spec.memoryBudget: must be a Kubernetes quantity such as 6Gi, 512Mi or 8G (got '6 GB')"]
    assert problems({"idleUnloadAfter": 0, "loadTimeout": "soon"}) == [
        "spec.idleUnloadAfter: must be >= 1 (got 0)", "spec.loadTimeout: must be an integer (got 'soon')"]
    assert problems({"engines": []}) == [
        "spec.engines: list the LLMEngine manifests to serve, as paths relative to this file"]
    pool.write_text(yaml.safe_dump({"apiVersion": API, "kind": "LLMEnginePool", "metadata": {"name": "p"},
                                    "spec": {"engines": ["one.yaml"], "queueSize": 3, "gpu": "cpu"}}))
    _, manifest = read_manifests((pool,))
    assert manifest.flags[:-2] == serve_flags(manifest.pool.spec) and "--pool-queue-size" in manifest.flags
    assert manifest.port == 8000  # the pool's own default, as the cluster's Service


def test_kiln_up_refuses_a_bad_pool_manifest_naming_each_field(toy_model, tmp_path):
    from click.testing import CliRunner

    from kiln.up import up

    one = _engine_manifest(tmp_path / "one.yaml", "one", toy_model("llama-tiny"))
    pool = tmp_path / "pool.yaml"
    pool.write_text(yaml.safe_dump({"apiVersion": API, "kind": "LLMEnginePool", "metadata": {"name": "p"},
                                    "spec": {"engines": [], "maxLoadedEngines": 0, "colour": "red"}}))
    result = CliRunner().invoke(up, ["-f", str(pool), "--store", f"file://{tmp_path / 'store'}"])
    assert result.exit_code == 2 and f"invalid LLMEnginePool manifest {pool}" in result.output
    assert "spec.maxLoadedEngines: must be >= 1 (got 0)" in result.output
    assert "spec.colour: unknown field" in result.output
    assert "spec.engines: list the LLMEngine manifests" in result.output
    pool.write_text(yaml.safe_dump({"apiVersion": API, "kind": "LLMEnginePool", "metadata": {"name": "p"},
                                    "spec": {"engines": 5}}))
    scalar = CliRunner().invoke(up, ["-f", str(pool), "--store", f"file://{tmp_path / 'store'}"])
    assert scalar.exit_code == 2 and "spec.engines" in scalar.output and "Traceback" not in scalar.output
    twice = CliRunner().invoke(up, ["-f", str(one), "-f", str(one), "--store", f"file://{tmp_path / 'store'}"])
    assert twice.exit_code == 2 and "'one' is served twice" in twice.output
    assert "serving" not in result.output + twice.output


@pytest.mark.slow
def test_kiln_up_serves_several_manifests_as_one_pool(toy_model, tmp_path):
    """Two manifests, two engines built and served by one process; each answers by its name."""
    manifests = [_engine_manifest(tmp_path / f"{n}.yaml", n, toy_model(p)) for n, p in (("one", "llama-tiny"),
                                                                                         ("two", "qwen2-tiny"))]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln", "up", "-f", str(manifests[0]), "-f", str(manifests[1]), "--store",
         f"file://{tmp_path / 'store'}", "--port", str(port), "--work-dir", str(tmp_path / "work")],
        cwd=REPO, env={**os.environ, "KILN_KEY_DIR": str(tmp_path / "keys")},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        wait_ready(base, proc, timeout=600)
        models = {c["id"]: c["state"] for c in httpx.get(f"{base}/v1/models", timeout=10).json()["data"]}
        assert models == {"one": "unloaded", "two": "unloaded"}
        for name in ("one", "two"):
            got = httpx.post(f"{base}/v1/completions", timeout=120, json={
                "model": name, "prompt": "The kiln", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
            assert got.status_code == 200 and got.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, output
    assert "serving 2 engines (one, two) as one pool" in output


def test_an_adapter_name_that_is_another_engines_or_adapters_is_refused_naming_the_field(toy_model, tmp_path):
    """One server answers every name (model): a clash would leave an adapter unreachable or ambiguous."""
    from kiln.manifest import ManifestError
    from kiln.up import read_manifests

    paths = [_engine_manifest(tmp_path / f"{n}.yaml", n, toy_model("llama-tiny")) for n in ("one", "two")]

    def with_adapters(path: Path, *names: str, revision: str = "v1") -> None:
        doc = yaml.safe_load(path.read_text())
        doc["spec"]["lora"] = {"adapters": [{"name": n, "source": f"file:///adapters/{n}", "revision": revision}
                                            for n in names]}
        path.write_text(yaml.safe_dump(doc))

    with_adapters(paths[0], "tone")
    with_adapters(paths[1], "sql", "tone")  # one base (the same envelope): the same adapter under two engines
    assert [e.metadata.name for e in read_manifests(tuple(paths))[0]] == ["one", "two"]  # as the operator's pool
    with_adapters(paths[1], "sql", "tone", revision="v2")  # another adapter of that name: a request names either
    with pytest.raises(ManifestError, match=r"spec.lora.adapters\[1\].name: 'tone' is also an adapter of engine "
                                            r"'one' served here.*rename one of them") as err:
        read_manifests(tuple(paths))
    assert err.value.origin == str(paths[1])
    with_adapters(paths[1], "one")
    with pytest.raises(ManifestError, match=r"adapters\[0\].name: 'one' is also an engine served here"):
        read_manifests(tuple(paths))
    with_adapters(paths[1], "sql")
    assert [e.metadata.name for e in read_manifests(tuple(paths))[0]] == ["one", "two"]
