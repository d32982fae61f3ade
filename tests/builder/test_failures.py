"""Builds that must fail: the documented exit code, a message naming the field, nothing published."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from builder_helpers import REPO, manifest_dict, version_of
from kiln.builder.errors import EXIT_FETCH, EXIT_INVALID_SPEC, EXIT_QUALITY_GATE, EXIT_STORAGE

from kiln.artifacts import ArtifactStore


def nothing_published(store_uri: str, version: str) -> bool:
    store = ArtifactStore.from_uri(store_uri)
    return not store.exists(version) and store.list_versions() == []


def test_impossible_quality_gate_fails_with_4_and_publishes_nothing(
        toy_model, write_manifest, kiln_build, tmp_path, termination_log):
    manifest = write_manifest(f"file://{toy_model('llama-tiny')}", quantization="int8",
                              build={"qualityGate": {"maxKLDivergence": 0.0, "minTokenAgreement": 1.0}})
    store = f"file://{tmp_path / 'store'}"
    result = kiln_build("-f", str(manifest), "--store", store)
    assert result.exit_code == EXIT_QUALITY_GATE, result.output
    assert "spec.build.qualityGate.maxKLDivergence 0.0" in result.output
    assert '"passed": false' in result.output  # the report is printed
    assert nothing_published(store, version_of(manifest))
    assert termination_log.read_text().startswith("QualityGateFailed: quality gate failed: KL divergence")


def test_tp_that_does_not_divide_heads_fails_with_2(toy_model, write_manifest, kiln_build, tmp_path,
                                                    termination_log):
    model = toy_model("llama-tiny", num_attention_heads=3, num_key_value_heads=3, hidden_size=48)
    manifest = write_manifest(f"file://{model}", tensorParallel=2)
    store = f"file://{tmp_path / 'store'}"
    result = kiln_build("-f", str(manifest), "--store", store)
    assert result.exit_code == EXIT_INVALID_SPEC, result.output
    assert "spec.tensorParallel: 2 does not divide the model's num_attention_heads (3)" in result.output
    assert "Traceback" not in result.output
    assert nothing_published(store, version_of(manifest))
    assert "spec.tensorParallel" in termination_log.read_text()


def test_max_seq_len_beyond_the_model_fails_with_2(toy_model, write_manifest, kiln_build, tmp_path):
    manifest = write_manifest(f"file://{toy_model('llama-tiny')}", maxSeqLen=4096, maxInputLen=2048)
    result = kiln_build("-f", str(manifest), "--store", f"file://{tmp_path / 'store'}")
    assert result.exit_code == EXIT_INVALID_SPEC, result.output
    assert "spec.maxSeqLen: 4096 exceeds the model's 1024 positions" in result.output


def test_invalid_manifest_fails_with_2_naming_the_field(write_manifest, kiln_build, tmp_path):
    manifest = write_manifest("file:///nowhere", tensorParallel=3)
    result = kiln_build("-f", str(manifest), "--store", f"file://{tmp_path / 'store'}")
    assert result.exit_code == EXIT_INVALID_SPEC
    assert "tensorParallel" in result.output and "Traceback" not in result.output


def test_pickle_only_checkpoint_is_refused_with_5(write_manifest, kiln_build, tmp_path):
    ckpt = tmp_path / "pickled"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "pytorch_model.bin").write_bytes(b"not really a pickle")
    result = kiln_build("-f", str(write_manifest(f"file://{ckpt}")), "--store", f"file://{tmp_path / 'store'}")
    assert result.exit_code == EXIT_FETCH
    assert "only pickle weights (pytorch_model.bin)" in result.output and "safetensors" in result.output


def test_missing_s3_source_fails_with_5(s3_bucket, write_manifest, kiln_build, tmp_path):
    manifest = write_manifest(f"s3://{s3_bucket}/models/absent")
    result = kiln_build("-f", str(manifest), "--store", f"file://{tmp_path / 'store'}")
    assert result.exit_code == EXIT_FETCH
    assert f"nothing under s3://{s3_bucket}/models/absent" in result.output


def test_unreachable_store_fails_with_3(s3_endpoint, write_manifest, kiln_build):
    manifest = write_manifest("file:///nowhere")
    result = kiln_build("-f", str(manifest), "--store", "s3://no-such-bucket-kiln/x")
    assert result.exit_code == EXIT_STORAGE, result.output


def test_spec_from_env_must_match_the_operators_version(toy_model, kiln_build, tmp_path):
    doc = manifest_dict(f"file://{toy_model('llama-tiny')}")
    env = {"KILN_SPEC": json.dumps(doc), "KILN_ENGINE_VERSION": "llama-tiny-000000000000"}
    result = kiln_build("--store", f"file://{tmp_path / 'store'}", env=env)
    assert result.exit_code == EXIT_INVALID_SPEC
    assert "KILN_ENGINE_VERSION is llama-tiny-000000000000 but this builder computes" in result.output
    bad = kiln_build("--store", f"file://{tmp_path / 'store'}", env={"KILN_SPEC": "{not json"})
    assert bad.exit_code == EXIT_INVALID_SPEC and "KILN_SPEC is not valid JSON" in bad.output


@pytest.mark.parametrize("stage", ["shard"])  # after the gate: weights are being written to the work dir
def test_build_killed_midway_leaves_no_version(stage, toy_model, write_manifest, tmp_path):
    manifest = write_manifest(f"file://{toy_model('llama-tiny')}", quantization="int8")
    store = f"file://{tmp_path / 'store'}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln", "build", "-f", str(manifest), "--store", store,
         "--work-dir", str(tmp_path / "work")],
        cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )
    deadline = time.monotonic() + 120
    for line in proc.stderr:
        if f"[{stage}] start" in line:
            proc.send_signal(signal.SIGKILL)
            break
        assert time.monotonic() < deadline
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert nothing_published(store, version_of(manifest))


def test_gpu_engine_cannot_be_built_on_this_cpu_machine(toy_model, write_manifest, kiln_build, tmp_path):
    manifest = write_manifest(f"file://{toy_model('llama-tiny')}", gpu="H100-80GB", dtype="bfloat16")
    result = kiln_build("-f", str(manifest), "--store", f"file://{tmp_path / 'store'}")
    assert result.exit_code == EXIT_INVALID_SPEC
    assert "spec.gpu: H100-80GB engines (sm90) must be built on a H100-80GB" in result.output
