"""The CUDA path: same engine on a GPU, eager and with CUDA graphs. Skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch
from engine_testlib import random_prompts
from kiln.engine import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-tiny"])
def test_fp32_cuda_equals_hf(toy_model, make_llm, hf_greedy, preset):
    model_dir = toy_model(preset)
    prompts = random_prompts([3, 17, 40], seed=1)
    outs = make_llm(model_dir, device="cuda", num_kv_blocks=64, enforce_eager=True).generate(
        prompts, SamplingParams(temperature=0, max_tokens=8))
    assert [o.token_ids for o in outs] == [hf_greedy(model_dir, p, 8) for p in prompts]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_equal_eager(toy_model, make_llm, dtype):
    model_dir = toy_model("qwen2-tiny")
    prompts = random_prompts([5, 9, 30, 12, 7], seed=2)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 3, 9, 16, 5)]
    kwargs = dict(device="cuda", dtype=dtype, num_kv_blocks=64, block_size=8, max_batch_size=8,
                  cuda_graph_batch_sizes=[1, 2, 4, 8])
    eager = make_llm(model_dir, enforce_eager=True, **kwargs).generate(prompts, params)
    graphed_llm = make_llm(model_dir, **kwargs)
    assert graphed_llm.engine.runner.graphs is not None
    graphed = graphed_llm.generate(prompts, params)
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
