"""TP=2 over gloo on two local processes gives the same tokens as TP=1 (and as Hugging Face)."""

from __future__ import annotations

import pytest
from engine_testlib import random_prompts
from kiln.engine import SamplingParams


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen2-tiny", "qwen3-tiny"])
def test_tp2_equals_tp1(preset, toy_model, make_llm, hf_greedy):
    model_dir = toy_model(preset)
    prompts = random_prompts([5, 23, 40], seed=11)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (8, 5, 6)]
    # One pinned kernel: each engine (each rank a process) would time its own table, and under load two
    # engines can pick different kernels, whose last bits differ (issue 38).
    kwargs = dict(num_kv_blocks=32, block_size=8, max_num_tokens=16, max_batch_size=4, tactics="aten")
    tp1 = make_llm(model_dir, **kwargs).generate(prompts, params)
    tp2 = make_llm(model_dir, tensor_parallel_size=2, **kwargs).generate(prompts, params)
    assert [o.token_ids for o in tp2] == [o.token_ids for o in tp1]
    expected = [hf_greedy(model_dir, p, sp.max_tokens) for p, sp in zip(prompts, params, strict=True)]
    assert [o.token_ids for o in tp1] == expected
