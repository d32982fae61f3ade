"""Envelope checks and the KV plan as pure functions of config.json and the spec (no torch)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from kiln.builder.errors import InvalidSpec
from kiln.builder.kv_plan import CUDA_GRAPH_MEMORY_MARGIN, kv_plan_summary, plan_kv, plan_with_cuda_graphs
from kiln.builder.model_facts import ModelFacts, model_facts
from kiln.builder.sizing import weight_bytes_per_rank
from kiln.builder.stages.check import check_envelope
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
    facts = eight_b_facts(tmp_path)  # on an L4
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


def eight_b_facts(tmp_path):
    """An 8B-class Llama's numbers on the header-derived facts of a small checkpoint."""
    facts = model_facts(write_checkpoint(tmp_path / "m"))
    facts.num_layers, facts.num_key_value_heads, facts.head_dim = 32, 8, 128
    facts.hidden_size, facts.intermediate_size, facts.vocab_size = 4096, 14336, 128256
    facts.num_params, facts.num_quantizable_params, facts.num_quantizable_rows = 8_030_000_000, 6_980_000_000, 1
    facts.max_positions = 131072
    return facts


def test_kv_plan_leaves_the_measured_cuda_graph_memory_out_of_the_pool(tmp_path):
    facts, s = eight_b_facts(tmp_path), spec(dtype="bfloat16", maxSeqLen=8192, maxInputLen=4096, maxBatchSize=128)
    weights = weight_bytes_per_rank(facts, s)
    graphs = 4 * 2**30  # e.g. the decode gather buffers of 128 x 8192 (issue 11)
    eager = plan_kv(s, facts, weights)
    plan = plan_kv(s, facts, weights, cuda_graph_bytes=graphs)
    reserve = plan["cuda_graph_reserve_bytes"]
    assert reserve == math.ceil(graphs * (1 + CUDA_GRAPH_MEMORY_MARGIN)) and plan["cuda_graph_memory_bytes"] == graphs
    free = plan["budget_bytes"] - weights - plan["activation_reserve_bytes"]
    assert plan["num_kv_blocks"] == (free - reserve) // plan["block_bytes"]
    assert weights + plan["activation_reserve_bytes"] + reserve + plan["kv_pool_bytes"] <= plan["budget_bytes"]
    # 4.8 GiB of 2 MiB blocks (32 layers x 8 heads x 128 x bf16 x K,V x 16 tokens) fewer than without graphs.
    assert eager["num_kv_blocks"] - plan["num_kv_blocks"] in (reserve // plan["block_bytes"],
                                                              reserve // plan["block_bytes"] + 1)
    assert eager["cuda_graph_memory_bytes"] is None and eager["cuda_graph_reserve_bytes"] == 0
    assert "MiB kept for CUDA graphs" in kv_plan_summary(plan) and "CUDA graphs" not in kv_plan_summary(eager)


def test_plan_after_tuning_uses_graph_memory_only_when_graphs_run(tmp_path):
    facts, s = eight_b_facts(tmp_path), spec(dtype="bfloat16", maxSeqLen=8192, maxInputLen=4096)
    weights = weight_bytes_per_rank(facts, s)
    buckets = {"cuda_graph_batch_sizes": [1, 2, 4, 8]}
    chosen = plan_with_cuda_graphs(s, facts, weights, {"use_cuda_graphs": True, "cuda_graph_memory_bytes": 2**30},
                                   dict(buckets))
    assert chosen[0]["cuda_graph_reserve_bytes"] > 2**30 and chosen[1] == buckets
    for tuning in ({"use_cuda_graphs": False, "cuda_graph_memory_bytes": 2**30},  # eager was faster
                   {"cuda_graph_memory_bytes": None}):  # CPU
        plan, overrides = plan_with_cuda_graphs(s, facts, weights, tuning, {})
        assert plan["cuda_graph_reserve_bytes"] == 0 and plan == plan_kv(s, facts, weights)
    # Graphs that leave no room for one maxSeqLen request are dropped, not the build.
    tuning = {"use_cuda_graphs": True, "cuda_graph_memory_bytes": 60 * 2**30}
    plan, overrides = plan_with_cuda_graphs(s, facts, weights, tuning, dict(buckets))
    assert overrides == {"enforce_eager": True} and plan["cuda_graph_reserve_bytes"] == 0
    assert not tuning["use_cuda_graphs"] and "CUDA graphs" in tuning["cuda_graphs_dropped"]


def test_cuda_graph_buckets():
    assert cuda_graph_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert cuda_graph_buckets(6) == [1, 2, 4, 6]
    assert cuda_graph_buckets(1) == [1]


def llama_70b_facts() -> ModelFacts:
    """Llama 3.1 70B's config.json (80 layers, hidden 8192, MLP 28672, GQA 64/8, vocab 128256, untied head)."""
    hidden, inter, layers, vocab, heads, kv, hd = 8192, 28672, 80, 128256, 64, 8, 128
    linear = 2 * hidden * heads * hd + 2 * hidden * kv * hd + 3 * hidden * inter
    return ModelFacts(
        architecture="LlamaForCausalLM", num_layers=layers, hidden_size=hidden, intermediate_size=inter,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, vocab_size=vocab,
        max_position_embeddings=131072, max_positions=131072, rope_type="llama3",
        num_params=layers * (linear + 2 * hidden) + 2 * vocab * hidden + hidden, num_quantizable_params=layers * linear,
        num_quantizable_rows=layers * (heads * hd + 2 * kv * hd + hidden + 2 * inter))


def test_the_70b_example_builds_on_paper():
    """docs/build.md's memory table: the envelope check passes and the pool holds full-length requests."""
    from kiln.manifest import load_manifest

    s = load_manifest(Path(__file__).resolve().parents[2] / "examples" / "llama-3.1-70b-4xh100.yaml").spec
    facts = llama_70b_facts()
    assert 70.5e9 < facts.num_params < 70.6e9
    estimate = check_envelope(s, facts)
    assert 35 * 2**30 < estimate["weight_bytes_per_rank"] < 36 * 2**30
    plan = plan_kv(s, facts, estimate["weight_bytes_per_rank"], cuda_graph_bytes=2**30)
    assert plan["full_length_requests"] >= 10 and plan["block_bytes"] == 2 * 80 * 2 * 128 * 2 * 16
    with pytest.raises(InvalidSpec, match="maxBatchSize 64"):  # what the example asked before
        check_envelope(s.model_copy(update={"max_batch_size": 64}), facts)
