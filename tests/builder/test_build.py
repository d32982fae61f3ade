"""End-to-end builds of toy checkpoints into file:// and s3:// stores, loaded back through the runtime."""

from __future__ import annotations

import json
import time
from pathlib import Path

import boto3
import pytest
from builder_helpers import PROMPTS, engine_json, hf_greedy, version_of
from kiln.engine.kernels.candidates import ACTIVATION_QUANT
from safetensors import safe_open

NEW_TOKENS = 8


def runtime_greedy(artifact_dir: Path, prompts: list[str], max_tokens: int, **overrides) -> list[list[int]]:
    from kiln.engine import LLM, SamplingParams

    llm = LLM.from_artifact(artifact_dir, **overrides)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    finally:
        llm.shutdown()
    return [o.token_ids for o in outs]


def upload_dir(bucket: str, prefix: str, local: Path) -> None:
    s3 = boto3.client("s3")
    for f in local.iterdir():
        if f.is_file():
            s3.upload_file(str(f), bucket, f"{prefix}/{f.name}")


def test_file_source_into_s3_store_matches_transformers_then_cache_hit(
        toy_model, s3_bucket, write_manifest, kiln_build, tmp_path, monkeypatch):
    from kiln.artifacts import ArtifactStore
    from kiln.signing import Verifier, generate_key_pair

    model = toy_model("llama-tiny")
    manifest = write_manifest(f"file://{model}")
    store = f"s3://{s3_bucket}/engines-store"
    signing_key, verify_key = generate_key_pair(tmp_path / "keys")
    result = kiln_build("-f", str(manifest), "--store", store, env={"KILN_SIGNING_KEY": str(signing_key)})
    assert result.exit_code == 0, result.output
    version = version_of(manifest)
    assert f"built: {version}" in result.output
    _, document = ArtifactStore.from_uri(store).read_signed_manifest(version)
    assert Verifier.from_pem(verify_key).problem(document) is None  # the whole manifest, signed

    artifact, doc = engine_json(store, version, tmp_path / "fetched")
    assert doc["format_version"] == 1 and doc["engine_version"] == version
    assert doc["gpu"]["arch"] == "cpu" and doc["engine_config"]["num_kv_blocks"] == doc["kv_plan"]["num_kv_blocks"]
    report = doc["build_report"]
    assert {"fetch", "check", "quality_reference", "shard", "plan", "quality_runtime", "tune"} <= set(
        report["stage_seconds"]) == set(report["memory"]["stages"])
    assert report["convert"]["num_tensors"] > 0  # converted as the gate streamed the weights
    assert doc["kv_plan"]["cuda_graph_memory_bytes"] is None is doc["tuning"]["cuda_graph_memory_bytes"]  # CPU
    kernels = doc["kernels"]  # kiln's C kernels, one library per ISA level of the build's architecture
    assert kernels["packed"] and kernels["device"] == "cpu" and kernels["libraries"]
    assert all((artifact / kernels["path"] / lib["file"]).is_file() for lib in kernels["libraries"].values())
    q = report["quality"]
    assert q["passed"] and q["kl_divergence"] == 0.0 and q["runtime_token_agreement"] == 1.0
    assert doc["tuning"]["measurement"]["decode"][0]["decode_tokens_per_s"] > 0
    assert (artifact / "weights" / "rank-0-of-1.safetensors").is_file() and (artifact / "tokenizer.json").is_file()
    from kiln.engine.light_tokenizer import ARTIFACT_RECORD, LightTokenizer
    from kiln.engine.tokenizer import load_hf_tokenizer, load_tokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "fresh-cache"))  # no record on this host: the artifact's
    assert (artifact / ARTIFACT_RECORD).is_file()
    light, hf = load_tokenizer(str(artifact)), load_hf_tokenizer(str(artifact))
    assert isinstance(light, LightTokenizer) and [light.encode(p) for p in PROMPTS] == [hf.encode(p) for p in PROMPTS]

    assert runtime_greedy(artifact, PROMPTS, NEW_TOKENS) == hf_greedy(model, PROMPTS, NEW_TOKENS)

    t0 = time.monotonic()
    again = kiln_build("-f", str(manifest), "--store", store)
    assert again.exit_code == 0 and f"cache hit: {version}" in again.output
    assert time.monotonic() - t0 < 10


def test_a_bad_signing_key_fails_before_the_build_naming_it(toy_model, write_manifest, kiln_build, tmp_path):
    manifest = write_manifest(f"file://{toy_model('llama-tiny')}")
    (tmp_path / "public.pem").write_bytes(b"-----BEGIN PUBLIC KEY-----\nnot a private key\n")
    for key in (tmp_path / "missing.pem", tmp_path / "public.pem"):
        result = kiln_build("-f", str(manifest), "--store", f"file://{tmp_path / 'store'}", "--signing-key", str(key))
        assert result.exit_code == 2 and "--signing-key" in result.output and key.name in result.output
    assert not (tmp_path / "store" / "engines").exists()


def test_s3_source_bf16_build_loads_and_follows_source(toy_model, s3_bucket, write_manifest, kiln_build, tmp_path):
    model = toy_model("qwen2-tiny")
    upload_dir(s3_bucket, "models/qwen2-tiny", model)
    calibration = ["Paged attention keeps KV blocks in a pool.", "The operator rolls out a new version."]
    manifest = write_manifest(f"s3://{s3_bucket}/models/qwen2-tiny", dtype="bfloat16",
                              build={"calibrationPrompts": calibration})
    store = f"s3://{s3_bucket}/store"
    result = kiln_build("-f", str(manifest), "--store", store)
    assert result.exit_code == 0, result.output
    artifact, doc = engine_json(store, version_of(manifest), tmp_path / "fetched")
    assert doc["build_report"]["source"]["files"]["model.safetensors"] > 0
    with safe_open(str(artifact / "weights" / "rank-0-of-1.safetensors"), framework="pt") as f:
        dtypes = {str(f.get_tensor(k).dtype) for k in f.keys()}
    assert dtypes == {"torch.bfloat16"}
    # bf16 rounding may flip near-ties of a random model; the gate measured how often.
    assert doc["build_report"]["quality"]["token_agreement"] >= 0.9
    assert doc["build_report"]["quality"]["calibration_prompts"] == "spec"
    assert doc["build_report"]["quality"]["num_prompts"] == 2
    assert len(runtime_greedy(artifact, PROMPTS[:1], NEW_TOKENS)[0]) == NEW_TOKENS


# The fp8 case also uses shapes smaller than the calibration prompts: the gate and tuning must fit them.
@pytest.mark.parametrize("method,qdtype,shapes", [
    ("int8", "torch.int8", {}),
    ("fp8", "torch.float8_e4m3fn", {"maxInputLen": 24, "maxSeqLen": 48, "maxNumTokens": 32}),
])
def test_quantized_builds_load_and_pass_the_gate(method, qdtype, shapes, toy_model, write_manifest, kiln_build,
                                                 tmp_path):
    model = toy_model("llama-tiny")
    # A random model's next-token distributions are nearly flat, so small weight errors flip near-ties
    # far more often than in a trained model: the gate here allows 20% flips but only a tiny KL.
    gate = {"maxKLDivergence": 0.01, "minTokenAgreement": 0.8}
    manifest = write_manifest(f"file://{model}", quantization=method, build={"qualityGate": gate}, **shapes)
    store = f"file://{tmp_path / 'store'}"
    result = kiln_build("-f", str(manifest), "--store", store)
    assert result.exit_code == 0, result.output
    artifact, doc = engine_json(store, version_of(manifest), tmp_path / "fetched")
    q = doc["build_report"]["quality"]
    assert q["passed"] and 0 < q["kl_divergence"] < 0.01 and q["token_agreement"] >= 0.8
    assert abs(q["perplexity_converted"] / q["perplexity_source"] - 1) < 0.01
    sizes = doc["build_report"]["sizes"]
    assert sizes["artifact_weight_bytes"] < sizes["source_weight_bytes"]
    with safe_open(str(artifact / "weights" / "rank-0-of-1.safetensors"), framework="pt") as f:
        names = list(f.keys())
        qkv = next(n for n in names if n.endswith("qkv_proj.weight"))
        assert str(f.get_tensor(qkv).dtype) == qdtype
        assert qkv + "_scale" in names
    outs = runtime_greedy(artifact, PROMPTS, NEW_TOKENS)
    assert all(len(o) == NEW_TOKENS for o in outs)
    if method == "int8":  # W8A8 gated separately: allowed, or excluded from every host's tactic table
        w8a8 = doc["build_report"]["w8a8_gate"]
        refused = w8a8["excluded"]  # each W8A8 candidate measured on its own
        assert set(refused) | set(w8a8["allowed_candidates"]) == set(w8a8["candidates"]) == set(ACTIVATION_QUANT)
        want = None if not refused else ["w8a8"] if not w8a8["allowed"] else refused
        assert doc["engine_config"].get("tactics_exclude") == want, w8a8


def test_an_int8_build_whose_w8a8_fails_the_gate_ships_without_it(toy_model, write_manifest, kiln_build, tmp_path,
                                                                 monkeypatch):
    _w8a8_drifts(monkeypatch)
    artifact, doc = _int8_toy_build(toy_model, write_manifest, kiln_build, tmp_path)
    gate = doc["build_report"]["w8a8_gate"]
    assert not gate["allowed"] and doc["build_report"]["quality"]["passed"]
    assert all(not v["allowed"] and v.get("runtime_token_agreement", 0) < 0.8 for v in gate["candidates"].values())
    assert doc["engine_config"]["tactics_exclude"] == ["w8a8"]
    tactics = json.loads((artifact / "tactics.json").read_text())
    assert "w8a8" not in json.dumps(tactics.get("linear", {}))  # the build's table never timed or picked it


def test_a_w8a8_candidate_the_build_host_cannot_run_is_excluded_not_assumed(toy_model, write_manifest, kiln_build,
                                                                           tmp_path, monkeypatch):
    """Forcing a candidate the host cannot run would time the others instead and measure weight-only int8: the
    gate refuses it unmeasured, so a serving host that can run it never picks it untested."""
    from kiln.engine.kernels import candidates

    real = candidates.why_not
    monkeypatch.setattr(candidates, "why_not", lambda name, *a, **k: "no such unit here" if name == "torch-w8a8"
                        else real(name, *a, **k))
    _, doc = _int8_toy_build(toy_model, write_manifest, kiln_build, tmp_path)
    torch_gate = doc["build_report"]["w8a8_gate"]["candidates"]["torch-w8a8"]
    assert not torch_gate["allowed"] and "no such unit here" in torch_gate["why"]
    assert "torch-w8a8" in doc["engine_config"]["tactics_exclude"] or doc["engine_config"]["tactics_exclude"] == ["w8a8"]


def test_w8a8_that_passes_only_with_the_lm_head_kept_ships_lm_head_int8_off(toy_model, write_manifest, kiln_build,
                                                                           tmp_path, monkeypatch):
    """The gate measures W8A8 with the int8 engine's LM head in int8 first; where that fails and W8A8 with the
    head kept in the engine's dtype passes, the engine ships W8A8 allowed and lm_head_int8: off."""
    _w8a8_drifts(monkeypatch, lambda overrides: overrides.get("lm_head_int8") != "off")  # an int8 head drifts
    _, doc = _int8_toy_build(toy_model, write_manifest, kiln_build, tmp_path)
    gate = doc["build_report"]["w8a8_gate"]
    kept = [v for v in gate["candidates"].values() if v.get("lm_head") == "kept"]
    assert kept and all(not v["with_int8_head"]["allowed"] for v in kept)
    assert doc["engine_config"]["lm_head_int8"] == "off"


def _int8_toy_build(toy_model, write_manifest, kiln_build, tmp_path):
    """The toy built ``quantization: int8`` under a 0.8 agreement gate: (artifact dir, engine.json)."""
    manifest = write_manifest(f"file://{toy_model('llama-tiny')}", quantization="int8",
                              build={"qualityGate": {"maxKLDivergence": 0.01, "minTokenAgreement": 0.8}})
    store = f"file://{tmp_path / 'store'}"
    result = kiln_build("-f", str(manifest), "--store", store)
    assert result.exit_code == 0, result.output
    return engine_json(store, version_of(manifest), tmp_path / "fetched")


def _w8a8_drifts(monkeypatch, when=lambda overrides: True) -> None:
    """The gate's continuations with a W8A8 candidate forced (and ``when`` the overrides say so) flip every other
    token, as a model W8A8 does not suit would."""
    from kiln.builder.stages import quality_runtime

    real = quality_runtime._continuations

    def drifting(ctx, overrides):
        out = real(ctx, overrides)
        if overrides.get("tactics") in ACTIVATION_QUANT and when(overrides):
            out = [[t if i % 2 else t + 1 for i, t in enumerate(seq)] for seq in out]
        return out

    monkeypatch.setattr(quality_runtime, "_continuations", drifting)
