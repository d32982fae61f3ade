"""The KV pool on CPU comes from calloc (kv_cache._zeroed): zero, of the engine's dtype and shape, without
writing its pages at start-up; an engine on it generates what one on torch.zeros does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kiln.engine import kv_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_cpu_pool_is_zero_and_of_its_dtype(dtype):
    shape = (2, 3, 2, 5, 16, 8)
    pool = kv_cache._zeroed(shape, dtype, "cpu")
    assert pool.shape == shape and pool.dtype == dtype and pool.is_contiguous()
    assert torch.count_nonzero(pool) == 0
    pool[1, 2, 1, 4].fill_(1.5)  # writable, and each view is its own memory
    assert torch.count_nonzero(pool) == 16 * 8


def test_an_engine_on_the_calloc_pool_generates_as_on_torch_zeros(toy_model, make_llm, monkeypatch):
    from kiln.engine.sampling_params import SamplingParams

    model_dir = toy_model("llama-tiny")
    prompts = [[1, 5, 9, 200, 31], [7, 7, 300, 12, 40, 41, 42]]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="float32", num_kv_blocks=16, block_size=16, max_num_tokens=64, max_batch_size=4, device="cpu")
    calloc = [o.token_ids for o in make_llm(model_dir, **kw).generate(prompts, sp)]
    monkeypatch.setattr(kv_cache, "_zeroed", lambda shape, dtype, device: torch.zeros(shape, dtype=dtype))
    zeros = [o.token_ids for o in make_llm(model_dir, **kw).generate(prompts, sp)]
    assert calloc == zeros and np.asarray(calloc).size == 16
