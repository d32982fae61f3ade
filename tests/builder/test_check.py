"""Envelope checks and the KV plan as pure functions of config.json and the spec (no torch)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kiln.builder.check import check_envelope, model_facts, weight_bytes_per_rank
from kiln.builder.errors import InvalidSpec
from kiln.builder.tune import plan_kv
from kiln.engine.cuda_graphs import default_batch_sizes as cuda_graph_buckets
from safetensors.numpy import save_file

from kiln.api import LLMEngineSpec


def spec(**fields) -> LLMEngineSpec:
    base = {"model": {"source": "hf://org/model"}, "gpu": "H100-80GB", "maxBatchSize": 64, "maxInputLen": 2048,
            "maxSeqLen": 4096, "maxNumTokens": 8192}
    return LLMEngineSpec.model_validate({**base, **fields})


def write_checkpoint(path: Path, **config) -> Path:
    """config.json plus a small safetensors file: an embedding, one projection, one norm."""
    import numpy as np

    path.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
           "max_position_embeddings": 1024, **config}
    (path / "config.json").write_text(json.dumps(cfg))
    tensors = {"model.embed_tokens.weight": np.zeros((256, 64), np.float32),
               "model.layers.0.self_attn.q_proj.weight": np.zeros((64, 64), np.float32),
               "model.layers.0.input_layernorm.weight": np.zeros((64,), np.float32)}
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("rope,expected", [
    ({"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}, 4096),
    ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512}, 4096),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 256}, 1024),
    ({"rope_type": "default", "rope_theta": 10000.0}, 1024),
])
def test_max_positions_follow_rope_scaling_in_both_config_forms(tmp_path, rope, expected):
    new = model_facts(write_checkpoint(tmp_path / "new", rope_parameters=rope))
    legacy_rope = {("type" if k == "rope_type" else k): v for k, v in rope.items() if k != "rope_theta"}
    old = model_facts(write_checkpoint(tmp_path / "old", rope_scaling=legacy_rope, rope_theta=10000.0))
    assert new.max_positions == old.max_positions == expected


def test_facts_count_quantizable_linears_from_headers(tmp_path):
    facts = model_facts(write_checkpoint(tmp_path / "m"))
    assert facts.num_params == 256 * 64 + 64 * 64 + 64
    assert facts.num_quantizable_params == 64 * 64 and facts.num_quantizable_rows == 64
    bf16 = weight_bytes_per_rank(facts, spec(dtype="bfloat16"))
    int8 = weight_bytes_per_rank(facts, spec(dtype="bfloat16", quantization="int8"))
    assert bf16 - int8 == 64 * 64 - 4 * 64


def test_unsupported_architecture_is_named(tmp_path):
    facts = model_facts(write_checkpoint(tmp_path / "m", architectures=["GPT2LMHeadModel"]))
    with pytest.raises(InvalidSpec, match="architecture GPT2LMHeadModel is not supported.*LlamaForCausalLM"):
        check_envelope(spec(maxSeqLen=1024, maxInputLen=512), facts)


def test_gpu_too_small_names_the_numbers(tmp_path):
    facts = model_facts(write_checkpoint(tmp_path / "m"))
    # An 8B-class model on an L4: scale the header-derived counts up.
    facts.num_layers, facts.num_key_value_heads, facts.head_dim = 32, 8, 128
    facts.hidden_size, facts.intermediate_size, facts.vocab_size = 4096, 14336, 128256
    facts.num_params, facts.num_quantizable_params, facts.num_quantizable_rows = 8_030_000_000, 6_980_000_000, 1
    facts.max_positions = 131072
    with pytest.raises(InvalidSpec) as exc:
        check_envelope(spec(gpu="L4", dtype="bfloat16", maxSeqLen=8192, maxInputLen=4096), facts)
    msg = str(exc.value)
    assert msg.startswith("spec.gpu: L4 (24.0 GiB") and "maxBatchSize 64" in msg and "GiB" in msg
    # The same model fits an H100 with TP 1, and the KV plan then leaves most of the memory to the pool.
    h100 = spec(dtype="bfloat16", maxSeqLen=8192, maxInputLen=4096)
    estimate = check_envelope(h100, facts)
    plan = plan_kv(h100, facts, estimate["weight_bytes_per_rank"])
    assert plan["num_kv_blocks"] * plan["block_bytes"] <= estimate["budget_bytes"] - estimate["weight_bytes_per_rank"]
    assert plan["full_length_requests"] >= 1 and not plan["capped_at_max_batch"]


def test_cpu_pool_is_capped_at_what_max_batch_can_use(tmp_path):
    facts = model_facts(write_checkpoint(tmp_path / "m"))
    s = spec(gpu="cpu", dtype="float32", maxBatchSize=4, maxSeqLen=256, maxInputLen=128, maxNumTokens=128)
    plan = plan_kv(s, facts, 10_000)
    assert plan["capped_at_max_batch"] and plan["num_kv_blocks"] == 4 * 256 // 16


def test_cuda_graph_buckets():
    assert cuda_graph_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert cuda_graph_buckets(6) == [1, 2, 4, 6]
    assert cuda_graph_buckets(1) == [1]
