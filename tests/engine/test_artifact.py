"""from_artifact: per-rank sharded (and int8/fp8) weights written by shard_checkpoint load and run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from engine_testlib import random_prompts
from kiln.engine import LLM, ConfigError, SamplingParams
from kiln.engine.artifact import FORMAT_VERSION, quantize_weight, save_rank_weights, shard_checkpoint


def make_artifact(model_dir: Path, out: Path, tp: int, quantization: str | None, arch: str = "cpu",
                  fmt: int = FORMAT_VERSION) -> Path:
    out.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    save_rank_weights(shard_checkpoint(model_dir, tp, "float32", quantization), out / "weights")
    (out / "engine.json").write_text(json.dumps({
        "format_version": fmt, "gpu": {"sku": "cpu" if arch == "cpu" else "H100-80GB", "arch": arch},
        "engine_config": {"dtype": "float32", "quantization": quantization or "none", "tensor_parallel_size": tp,
                          "max_batch_size": 8, "max_num_tokens": 64, "block_size": 8, "num_kv_blocks": 48,
                          "enable_prefix_caching": True, "some_future_knob": 1},
    }))
    return out


PINNED = "aten"  # one kernel for every linear: engines compared token for token must run the same kernels


def greedy(llm, prompts, n=8):
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))]


def test_quantize_weight_per_channel():
    w = torch_randn(6, 32)
    for method, tol in (("int8", 0.01), ("fp8", 0.07)):
        q, scale = quantize_weight(w, method)
        assert scale.shape == (6,) and scale.dtype.is_floating_point
        err = (q.float() * scale[:, None] - w).abs().max() / w.abs().max()
        assert err < tol, (method, err)


def torch_randn(*shape):
    import torch

    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def test_tp1_fp32_artifact_equals_checkpoint(toy_model, tmp_path, make_llm):
    model_dir = toy_model("qwen2-tiny")  # tied embeddings: the artifact leaves lm_head out
    art = make_artifact(model_dir, tmp_path / "art", 1, None)
    prompts = random_prompts([6, 19], seed=4)
    llm = LLM.from_artifact(art)
    try:
        assert llm.engine_config.num_kv_blocks == 48 and llm.engine_config.block_size == 8
        assert greedy(llm, prompts) == greedy(make_llm(model_dir, num_kv_blocks=48), prompts)
    finally:
        llm.shutdown()


def test_tp2_int8_artifact_round_trip(toy_model, tmp_path, make_llm):
    model_dir = toy_model("llama-tiny")
    art = make_artifact(model_dir, tmp_path / "art", 2, "int8")
    assert sorted(p.name for p in (art / "weights").iterdir()) == ["rank-0-of-2.safetensors", "rank-1-of-2.safetensors"]
    prompts = random_prompts([6, 19, 33, 12], seed=4)
    reference = greedy(make_llm(model_dir, num_kv_blocks=48), prompts, n=12)
    # Both engines run one pinned kernel ("aten"): each engine times its own table otherwise, and under load a
    # TP=1 and a TP=2 engine picked different int8 kernels, so their tokens differed (issue 38).
    llm = LLM.from_artifact(art, tactics=PINNED)
    try:
        quantized = greedy(llm, prompts, n=12)
    finally:
        llm.shutdown()
    # Weight-only int8 is not exact; on a random tiny model greedy paths still mostly agree.
    pairs = [(a, b) for r, q in zip(reference, quantized, strict=True) for a, b in zip(r, q, strict=True)]
    agree = sum(a == b for a, b in pairs) / len(pairs)
    assert agree >= 0.6, agree
    # ... and the quantized engine itself is deterministic and TP-consistent.
    tp1 = make_artifact(model_dir, tmp_path / "art1", 1, "int8")
    with LLM.from_artifact(tp1, tactics=PINNED) as llm1:
        assert greedy(llm1, prompts, n=12) == quantized


def test_fp8_artifact_runs(toy_model, tmp_path):
    art = make_artifact(toy_model("llama-tiny"), tmp_path / "art", 1, "fp8")
    with LLM.from_artifact(art) as llm:
        out = llm.generate([[1, 5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def test_refuses_other_arch_and_format(toy_model, tmp_path):
    model_dir = toy_model("llama-tiny")
    gpu = make_artifact(model_dir, tmp_path / "gpu", 1, None, arch="sm90")
    with pytest.raises(ConfigError, match="sm90.*cpu"):
        LLM.from_artifact(gpu)
    future = make_artifact(model_dir, tmp_path / "future", 1, None, fmt=FORMAT_VERSION + 1)
    with pytest.raises(ConfigError, match="format_version"):
        LLM.from_artifact(future)
    tp1 = make_artifact(model_dir, tmp_path / "tp1", 1, None)
    with pytest.raises(ConfigError, match="lacks rank-0-of-2.safetensors, rank-1-of-2.safetensors"):
        LLM.from_artifact(tp1, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="engine.json"):
        LLM.from_artifact(model_dir)


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_runtime_quantization_bf16_close_to_unquantized(toy_model, make_llm, quantization):
    """Next-token agreement over many prompts (whole greedy paths of a random model diverge for good
    after one flip, which says little about the weights' quality)."""
    model_dir = toy_model("llama-tiny")
    prompts = random_prompts([5 + 3 * i for i in range(16)], seed=4)
    ref = greedy(make_llm(model_dir, dtype="bfloat16", num_kv_blocks=64), prompts, n=1)
    quant = greedy(make_llm(model_dir, dtype="bfloat16", quantization=quantization, num_kv_blocks=64), prompts, n=1)
    agree = sum(a == b for a, b in zip(ref, quant, strict=True)) / len(prompts)
    assert agree >= 0.75, agree
