"""The envelope check with pipeline parallelism: stages <= layers, per-rank weights and KV of one stage."""

from __future__ import annotations

import pytest
from kiln.builder.errors import InvalidSpec
from kiln.builder.model_facts import ModelFacts
from kiln.builder.sizing import kv_bytes_per_token, layers_per_stage, weight_bytes_per_rank
from kiln.builder.stages.check import check_envelope

from kiln.api import LLMEngineSpec

# Llama 3.1 405B's config.json, in the numbers the check reads (126 layers, GQA 128/8 heads).
LLAMA_405B = ModelFacts(
    architecture="LlamaForCausalLM", num_layers=126, hidden_size=16384, intermediate_size=53248,
    num_attention_heads=128, num_key_value_heads=8, head_dim=128, vocab_size=128256,
    max_position_embeddings=131072, max_positions=131072, rope_type="llama3",
    num_params=405_853_388_800, num_quantizable_params=401_650_000_000, num_quantizable_rows=4_000_000)


def spec(**fields) -> LLMEngineSpec:
    base = {"model": {"source": "hf://meta-llama/Llama-3.1-405B-Instruct"}, "gpu": "H100-80GB",
            "dtype": "bfloat16", "maxBatchSize": 32, "maxInputLen": 7168, "maxSeqLen": 8192, "maxNumTokens": 8192,
            "kv": {"memoryFraction": 0.92}}
    return LLMEngineSpec.model_validate({**base, **fields})


def test_405b_fits_two_8xh100_nodes_but_not_one():
    with pytest.raises(InvalidSpec, match=r"spec.gpu: .*tensorParallel 8, pipelineParallel 1.*pipelineParallel"):
        check_envelope(spec(tensorParallel=8), LLAMA_405B)
    estimate = check_envelope(spec(tensorParallel=8, pipelineParallel=2), LLAMA_405B)
    assert estimate["weight_bytes_per_rank"] < 60 * 2**30  # 810 GB / 16 ranks + whole embeddings on each
    one = weight_bytes_per_rank(LLAMA_405B, spec(tensorParallel=8))
    two = weight_bytes_per_rank(LLAMA_405B, spec(tensorParallel=8, pipelineParallel=2))
    assert two < one * 0.6


def test_each_stage_holds_kv_for_its_own_layers():
    assert layers_per_stage(LLAMA_405B, spec(pipelineParallel=4)) == 32  # 126 = 32 + 32 + 31 + 31
    full = kv_bytes_per_token(LLAMA_405B, spec(tensorParallel=8))
    assert kv_bytes_per_token(LLAMA_405B, spec(tensorParallel=8, pipelineParallel=2)) == full // 2


def test_more_stages_than_layers_names_the_field():
    tiny = ModelFacts(**{**LLAMA_405B.to_dict(), "num_layers": 4})
    with pytest.raises(InvalidSpec, match=r"spec.pipelineParallel: 8 stages exceed the model's 4 layers"):
        check_envelope(spec(tensorParallel=1, pipelineParallel=8, gpusPerNode=1), tiny)
