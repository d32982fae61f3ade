"""The build envelope and engine version: stable, blind to serving/build knobs, sensitive to the artifact."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kiln.api import LLMEngineSpec
from kiln.envelope import (
    ARTIFACT_FORMAT_VERSION,
    ENVELOPE_VERSION,
    MAX_VERSION_LEN,
    adapter_version,
    build_envelope,
    canonical_json,
    engine_version,
    envelope_digest,
    is_pinned,
    model_slug,
    normalize_source,
    short_version,
)
from kiln.manifest import load_manifest

ROOT = Path(__file__).resolve().parents[2]
CPU = ROOT / "examples/cpu-small.yaml"
H100 = ROOT / "examples/llama-3.1-8b-h100-fp8.yaml"
# Changing this means every published engine gets rebuilt: only on purpose, with a version bump.
GOLDEN_CPU_SMALL = "llama-demo-e34c747f5bd05122263b9ac3ed3e533173194ad3dba205a760d8c616838ed2d0"
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def spec_dict(path: Path) -> dict:
    return load_manifest(path).spec.to_k8s()


def version_with(base: Path, field: str, value: object) -> str:
    data = copy.deepcopy(spec_dict(base))
    *parents, leaf = field.split(".")
    node = data
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return engine_version(LLMEngineSpec.model_validate(data))


def test_golden_version_of_the_cpu_example():
    assert engine_version(load_manifest(CPU)) == GOLDEN_CPU_SMALL


def test_version_is_stable_across_processes():
    code = "from kiln.manifest import load_manifest; from kiln.envelope import engine_version; " \
           f"print(engine_version(load_manifest({str(CPU)!r})))"
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {GOLDEN_CPU_SMALL}


def test_envelope_is_versioned_and_plain_json():
    envelope = build_envelope(load_manifest(H100).spec)
    assert envelope["envelope_version"] == ENVELOPE_VERSION
    assert envelope["artifact_format_version"] == ARTIFACT_FORMAT_VERSION
    assert json.loads(canonical_json(envelope)) == envelope
    assert envelope["gpu"] == {"arch": "sm90", "memory_gib": 80}
    assert envelope["kv_cache_dtype"] == "bfloat16"  # auto resolved


# (base manifest, field, new value): every one of these changes what the builder writes.
SENSITIVE = [
    (CPU, "model.source", "file://./.kiln-work/models/other"),
    (CPU, "model.revision", "seed-1"),
    (CPU, "gpu", "L4"),
    (CPU, "dtype", "bfloat16"),
    (CPU, "quantization", "int8"),
    (CPU, "kvCacheDtype", "bfloat16"),
    (CPU, "tensorParallel", 2),
    (CPU, "pipelineParallel", 2),  # one file per (stage, TP rank), a KV plan per stage
    (CPU, "maxBatchSize", 16),
    (CPU, "maxInputLen", 256),
    (CPU, "maxSeqLen", 2048),
    (CPU, "maxNumTokens", 1024),
    (CPU, "kv.blockSize", 32),
    (CPU, "kv.enablePrefixCaching", False),
    (CPU, "kv.memoryFraction", 0.8),
    (H100, "gpu", "H200-141GB"),  # same arch, more memory: a different KV plan
    (H100, "model.file", "model.Q4_K_M.gguf"),  # a GGUF in the repo instead of its safetensors
    (CPU, "speculative", {"method": "ngram"}),  # the build measures and ships a per-batch table
    (CPU, "lora", {"maxLoras": 2}),  # the slots; the adapter list is not in (tests/core/test_lora_api.py)
]
# Every one of these leaves the artifact alone.
INSENSITIVE = [
    (CPU, "model.source", "file://./.kiln-work//models/./llama-demo/"),  # same path, other spelling
    (CPU, "kvCacheDtype", "float32"),  # what auto resolves to
    (H100, "model.credentialsSecret", "other-token"),
    (CPU, "gpusPerNode", 2),  # how ranks are packed into pods, not what is in their files
    (H100, "gpusPerNode", 4),
    (CPU, "pipelineParallel", 1),  # the default, spelled out
    (CPU, "serving.replicas", 7),
    (CPU, "serving.port", 9000),
    (CPU, "serving.resources", {"limits": {"cpu": "4", "memory": "8Gi"}}),
    (CPU, "serving.apiKeySecret", "api-key"),
    (CPU, "serving.image", "registry.example/kiln-serve:2"),
    (CPU, "serving.maxQueueLen", 10),
    (CPU, "serving.drainTimeoutSeconds", 5),
    (CPU, "serving.autoscaling", {"minReplicas": 0, "maxReplicas": 4, "targetWaitingRequests": 2}),
    (CPU, "serving.routing.inferencePool", True),
    (CPU, "serving.routing.endpointPicker", "shared-epp"),
    (CPU, "serving.routing.endpointPickerPort", 9003),
    (CPU, "serving.routing.endpointPickerFailureMode", "FailOpen"),
    (CPU, "serving.rolloutStrategy", "RecreateOneAtATime"),
    (CPU, "serving.batchInvariant", True),  # how the pods bind the same artifact's kernels
    (CPU, "serving.reasoningParser", "qwen3"),  # how the server splits the same engine's output
    (CPU, "serving.defaultChatTemplateKwargs", {"enable_thinking": False}),  # what the server renders
    (CPU, "serving.pool", "small-models"),
    (CPU, "build.image", "registry.example/kiln-build:2"),
    (CPU, "build.timeoutSeconds", 600),
    (CPU, "build.qualityGate.maxKLDivergence", 0.5),
    (CPU, "build.qualityGate.minTokenAgreement", 0.5),
    (CPU, "build.calibrationPrompts", ["Hello"]),
]


@pytest.mark.parametrize(("base", "field", "value"), SENSITIVE, ids=lambda v: getattr(v, "name", str(v)))
def test_version_changes_with_each_artifact_field(base: Path, field: str, value: object):
    assert version_with(base, field, value) != engine_version(load_manifest(base))


@pytest.mark.parametrize(("base", "field", "value"), INSENSITIVE, ids=lambda v: getattr(v, "name", str(v)))
def test_version_ignores_serving_and_build_knobs(base: Path, field: str, value: object):
    assert version_with(base, field, value) == engine_version(load_manifest(base))


def test_every_spec_field_is_classified():
    """A new API field must be put in SENSITIVE or INSENSITIVE (and in the envelope if sensitive)."""
    def leaves(model: type, prefix: str = "") -> set[str]:
        out = set()
        for name, field in model.model_fields.items():
            path = prefix + (field.alias or name)
            inner = field.annotation if isinstance(field.annotation, type) else None
            if inner is not None and hasattr(inner, "model_fields"):
                out |= leaves(inner, path + ".")
            else:
                out.add(path)
        return out
    classified = {field for _, field, _ in SENSITIVE + INSENSITIVE}
    assert leaves(LLMEngineSpec) == classified


NGRAM = {"method": "ngram", "numSpeculativeTokens": 4, "promptLookupMax": 3, "promptLookupMin": 1}


@pytest.mark.parametrize(("field", "value"), [("numSpeculativeTokens", 2), ("promptLookupMax", 4),
                                              ("promptLookupMin", 2)])
def test_each_speculative_field_changes_the_version_when_on(field: str, value: int):
    on = version_with(CPU, "speculative", NGRAM)
    assert version_with(CPU, "speculative", {**NGRAM, field: value}) != on
    # With method off the rest is ignored: the version is the one without the field.
    assert version_with(CPU, "speculative", {**NGRAM, "method": "off", field: value}) == GOLDEN_CPU_SMALL


def test_speculation_off_keeps_every_earlier_version():
    assert version_with(CPU, "speculative", {"method": "off"}) == GOLDEN_CPU_SMALL
    spec = LLMEngineSpec.model_validate({**spec_dict(CPU), "speculative": NGRAM})
    assert build_envelope(spec)["speculative"] == {"method": "ngram", "num_speculative_tokens": 4,
                                                   "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    assert "speculative" not in build_envelope(load_manifest(CPU).spec)


def test_a_draft_model_joins_the_envelope_normalized():
    draft = {"method": "draft_model", "draftModel": {"source": "hf://Qwen/Qwen2.5-0.5B-Instruct", "revision": "a" * 40}}
    spec = LLMEngineSpec.model_validate({**spec_dict(CPU), "speculative": draft})
    assert build_envelope(spec)["speculative"] == {
        "method": "draft_model", "num_speculative_tokens": 4,
        "draft_model": {"source": "hf://Qwen/Qwen2.5-0.5B-Instruct", "revision": "a" * 40}}
    assert version_with(CPU, "speculative", {**draft, "promptLookupMax": 5}) == version_with(CPU, "speculative", draft)
    on = version_with(CPU, "speculative", draft)
    assert on not in (GOLDEN_CPU_SMALL, version_with(CPU, "speculative", NGRAM))
    other = {**draft, "draftModel": {**draft["draftModel"], "revision": "b" * 40}}
    assert version_with(CPU, "speculative", other) != on  # other draft weights, another artifact
    spelled = {**draft, "draftModel": {"source": "file://./.kiln-work//models/./d.gguf"}}
    assert version_with(CPU, "speculative", spelled) == version_with(
        CPU, "speculative", {**draft, "draftModel": {"source": "file://./.kiln-work/models/d.gguf"}})


def test_metadata_does_not_change_the_version():
    engine = load_manifest(CPU)
    data = engine.to_k8s()
    data["metadata"] = {"name": "renamed", "namespace": "prod", "labels": {"team": "x"},
                        "annotations": {"a": "b"}}
    assert engine_version(load_manifest(data)) == engine_version(engine) == GOLDEN_CPU_SMALL


@pytest.mark.parametrize("path", sorted(p for p in (ROOT / "examples").glob("*.yaml")
                                         if "\nkind: LLMEnginePool" not in p.read_text()), ids=lambda p: p.name)
def test_versions_carry_the_full_digest_and_a_short_form_for_display(path: Path):
    spec = load_manifest(path).spec
    version = engine_version(spec)
    assert version.endswith("-" + envelope_digest(build_envelope(spec))) and len(version) <= MAX_VERSION_LEN, version
    short = short_version(version)
    assert DNS1123_LABEL.match(short) and len(short) <= 45 and version.startswith(short), short


def test_envelopes_sharing_the_first_12_hex_digits_are_different_versions(monkeypatch, tmp_path: Path):
    """Issue 38, Med 5: a version named 48 bits of the digest, so a ground prefix collision was the same version,
    the same store key and a cache hit. Here every digest is made to share its first 12 hex digits."""
    import kiln.envelope
    from kiln.artifacts import ArtifactStore

    real = kiln.envelope.envelope_digest
    monkeypatch.setattr(kiln.envelope, "envelope_digest", lambda envelope: "0" * 12 + real(envelope)[12:])
    spec = load_manifest(CPU).spec
    other = spec.model_copy(update={"max_batch_size": spec.max_batch_size + 1})
    mine, theirs = engine_version(spec), engine_version(other)
    assert mine != theirs and short_version(mine) == short_version(theirs)
    artifact = tmp_path / "artifact"
    artifact.mkdir()
    (artifact / "engine.json").write_text("{}")
    store = ArtifactStore.from_uri(f"file://{tmp_path / 'store'}")
    store.publish(theirs, artifact, build_envelope(other))
    assert store.read_manifest(theirs) is not None and store.read_manifest(mine) is None  # not a cache hit
    adapter = SimpleNamespace(name="sql", model_source=spec.model)
    assert adapter_version(mine, adapter) != adapter_version(theirs, adapter)
    assert short_version(adapter_version(mine, adapter)) == short_version(adapter_version(theirs, adapter))


@pytest.mark.parametrize(("source", "slug"), [
    ("hf://meta-llama/Llama-3.1-8B-Instruct", "llama-3-1-8b-instruct"),
    ("s3://bucket/models/Qwen2_7B/", "qwen2-7b"),
    ("pvc://model-cache", "model-cache"),
    ("file:///models/7b", "m-7b"),
    ("hf://org/" + "x" * 80, "x" * 32),
    ("file:///___", "m"),
])
def test_model_slug(source: str, slug: str):
    assert model_slug(source) == slug
    assert DNS1123_LABEL.match(model_slug(source))


@pytest.mark.parametrize(("source", "normal"), [
    ("file://./a//b/", "file://./a/b"),
    ("file://./a/../b", "file://./b"),
    ("file://./a/..", "file://./"),
    ("file://../x/./y", "file://../x/y"),
    ("file:///abs//p/", "file:///abs/p"),
    ("s3://bucket/p//q/", "s3://bucket/p/q"),
    ("s3://bucket/", "s3://bucket"),
    ("pvc://claim/sub/", "pvc://claim/sub"),
    ("hf://Org/Name", "hf://Org/Name"),
])
def test_normalize_source(source: str, normal: str):
    assert normalize_source(source) == normal


def test_unpinned_hf_revision_is_flagged():
    spec = load_manifest(H100).spec
    assert is_pinned(spec)
    assert not is_pinned(spec.model_copy(update={"model": spec.model.model_copy(update={"revision": "main"})}))
    assert build_envelope(LLMEngineSpec.model_validate(
        {"model": {"source": "hf://a/b"}, "gpu": "L4"}))["model"]["revision"] == "main"
    assert is_pinned(load_manifest(CPU).spec)


def test_gguf_sources_name_the_file_in_the_version_and_leave_other_versions_alone():
    """A GGUF's identity (file name + revision/sha256) is in the envelope; `model.file` only when set."""
    base = spec_dict(H100)
    plain = LLMEngineSpec.model_validate(base)
    assert "file" not in build_envelope(plain)["model"]  # safetensors sources keep their versions
    q4 = LLMEngineSpec.model_validate({**base, "model": {**base["model"], "file": "gguf/./m.Q4_K_M.gguf"}})
    q8 = LLMEngineSpec.model_validate({**base, "model": {**base["model"], "file": "gguf/m.Q8_0.gguf"}})
    assert build_envelope(q4)["model"]["file"] == "gguf/m.Q4_K_M.gguf"  # one spelling per file
    assert engine_version(q4).startswith("m-q4-k-m-") and engine_version(q8).startswith("m-q8-0-")
    assert len({engine_version(plain), engine_version(q4), engine_version(q8)}) == 3

    cpu = spec_dict(CPU)
    local = {**cpu, "model": {"source": "file://./models/SmolLM2-135M-Instruct.Q4_1.gguf"}}
    pinned = {**cpu, "model": {**local["model"], "revision": "b" * 64}}
    v_local, v_pinned = (engine_version(LLMEngineSpec.model_validate(d)) for d in (local, pinned))
    assert v_local.startswith("smollm2-135m-instruct-q4-1-") and v_local != v_pinned


def test_pipeline_parallel_is_in_the_envelope_only_above_one():
    """Versions built before pipeline parallelism existed stay the same (GOLDEN_CPU_SMALL above);
    pipelineParallel > 1 is a key of its own."""
    assert "pipeline_parallel" not in build_envelope(load_manifest(CPU).spec)
    data = load_manifest(CPU).to_k8s()
    data["spec"]["pipelineParallel"] = 4
    assert build_envelope(load_manifest(data).spec)["pipeline_parallel"] == 4
