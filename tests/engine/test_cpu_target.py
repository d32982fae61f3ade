"""CPU targets: native-dtype detection (forced both ways), the cgroup quota, and a bf16 artifact on a
host without native bf16 computing in float32 with its weights upcast once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from kiln.engine import LLM, SamplingParams
from kiln.engine import cpu_target as ct
from kiln.engine.artifact import save_rank_weights, shard_checkpoint


def test_cgroup_quota_v2_v1_and_unlimited(tmp_path):
    v2 = tmp_path / "cpu.max"
    v1 = (tmp_path / "quota", tmp_path / "period")
    v2.write_text("150000 100000\n")
    assert ct.cgroup_cpu_quota(v2, v1) == 1.5
    v2.write_text("max 100000\n")
    assert ct.cgroup_cpu_quota(v2, v1) is None
    v2.unlink()
    v1[0].write_text("200000\n")
    v1[1].write_text("100000\n")
    assert ct.cgroup_cpu_quota(v2, v1) == 2.0
    v1[0].write_text("-1\n")
    assert ct.cgroup_cpu_quota(v2, v1) is None


def test_threads_follow_omp_then_quota_then_the_same_cpu_hint(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert ct.choose_threads(8)[0] is None  # the operator's explicit setting wins, untouched
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(ct, "cgroup_cpu_quota", lambda: 1.7)
    monkeypatch.setattr(ct, "available_cpus", lambda: 4)
    assert ct.choose_threads(4) == (1, "cgroup CPU quota 1.7")
    monkeypatch.setattr(ct, "cgroup_cpu_quota", lambda: None)
    here = {"model": ct.cpu_model(), "cpus": 4, "flags": [f for f in ct.RELEVANT_FLAGS if f in ct.cpu_flags()]}
    assert ct.choose_threads(2, here) == (2, "the build's measurement (same CPU type)")
    other = {**here, "model": "Some Other CPU"}
    monkeypatch.setattr(ct, "measure_threads", lambda: {1: 10.0, 2: 10.5, 4: 30.0})
    threads, why = ct.choose_threads(2, other)
    assert threads == 4 and why.startswith("measured at load") and "hint 2 not used" in why


def test_native_detection_can_be_forced_and_is_measured_otherwise(monkeypatch):
    monkeypatch.setenv("KILN_CPU_NATIVE_BF16", "0")
    assert ct.probe("bfloat16") == {"dtype": "bfloat16", "native": False, "how": "$KILN_CPU_NATIVE_BF16=0"}
    monkeypatch.setenv("KILN_CPU_NATIVE_BF16", "1")
    assert ct.probe("bfloat16")["native"] is True
    monkeypatch.delenv("KILN_CPU_NATIVE_BF16")
    measured = ct.probe("bfloat16")
    assert measured["how"] == "measured" and measured["gflops"] > 0 and measured["float32_gflops"] > 0
    assert measured["native"] == (measured["gflops"] >= ct.NATIVE_MIN_RATIO * measured["float32_gflops"])


def test_plan_falls_back_to_float32_and_picks_the_int8_path(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # it would win over $KILN_CPU_THREADS (documented order)
    monkeypatch.setenv("KILN_CPU_THREADS", "1")
    monkeypatch.setenv("KILN_CPU_NATIVE_BF16", "0")
    plan = ct.plan_cpu_load("bfloat16", "int8", apply_threads=False)
    assert plan["dtype"] == "float32" and plan["artifact_dtype"] == "bfloat16"
    assert plan["int8_path"] == ("kiln's int8 GEMM (float32 activations) or torch's dequantize to float32 per "
                                 "matmul, as timed") and plan["threads"] == 1
    monkeypatch.setenv("KILN_CPU_NATIVE_BF16", "1")
    plan = ct.plan_cpu_load("bfloat16", "int8", apply_threads=False)
    assert plan["dtype"] == "bfloat16" and "torch's int8-weight x bf16 kernel" in plan["int8_path"]


def _bf16_artifact(model_dir: Path, out: Path) -> Path:
    out.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    save_rank_weights(shard_checkpoint(model_dir, 1, "bfloat16", None), out / "weights")
    (out / "engine.json").write_text(json.dumps({
        "format_version": 1, "gpu": {"sku": "cpu", "arch": "cpu"},
        "engine_config": {"dtype": "bfloat16", "quantization": "none", "tensor_parallel_size": 1,
                          "max_batch_size": 4, "max_num_tokens": 64, "block_size": 8, "num_kv_blocks": 32},
        "tuning": {"torch_num_threads": 1}}))
    return out


@pytest.mark.parametrize("native", ["0", "1"])
def test_bf16_artifact_without_native_bf16_runs_in_float32(toy_model, tmp_path, monkeypatch, native):
    monkeypatch.setenv("KILN_CPU_NATIVE_BF16", native)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # it would win over $KILN_CPU_THREADS (documented order)
    monkeypatch.setenv("KILN_CPU_THREADS", "1")
    art = _bf16_artifact(toy_model("llama-tiny"), tmp_path / "art")
    before = torch.get_num_threads()
    try:
        llm = LLM.from_artifact(art)
        try:
            cfg = llm.engine_config
            params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
            out = llm.generate([[5, 6, 7, 8]], params)[0].token_ids
        finally:
            llm.shutdown()
    finally:
        torch.set_num_threads(before)
    assert cfg.cpu_target["artifact_dtype"] == "bfloat16" and cfg.cpu_target["threads_from"] == "$KILN_CPU_THREADS=1"
    if native == "0":
        assert cfg.dtype == "float32" and cfg.cpu_target["dtype"] == "float32"
        # the upcast bf16 weights in float32 compute: the same greedy tokens as the checkpoint's float32
        # weights rounded to bf16 and run in float32 by the plain (non-artifact) path
        ref_dir = tmp_path / "bf16-as-fp32"
        shutil.copytree(toy_model("llama-tiny"), ref_dir)
        from safetensors.torch import load_file, save_file

        w = load_file(str(ref_dir / "model.safetensors"))
        save_file({k: v.to(torch.bfloat16).float() for k, v in w.items()}, str(ref_dir / "model.safetensors"))
        ref = LLM(str(ref_dir), dtype="float32", max_batch_size=4, max_num_tokens=64, block_size=8,
                  num_kv_blocks=32, device="cpu")
        try:
            assert out == ref.generate([[5, 6, 7, 8]], params)[0].token_ids
        finally:
            ref.shutdown()
    else:
        assert cfg.dtype == "bfloat16"
