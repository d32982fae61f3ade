"""Greedy output equals transformers' ``generate(do_sample=False)`` token for token (fp32).

Every scenario runs the same mixed batch (different prompt lengths, different
max_tokens) and compares each request with Hugging Face run on that prompt
alone; the engine stops where HF stops (EOS included) or at max_tokens.
"""

from __future__ import annotations

import pytest
from engine_testlib import random_prompts
from kiln.engine import SamplingParams

PRESETS = ["llama-tiny", "qwen2-tiny", "qwen3-tiny", "smollm3-tiny", "mistral-tiny", "llama3-tiny"]
LENGTHS = [3, 17, 40, 71]
MAX_TOKENS = [9, 4, 12, 6]


def check(llm, model_dir, hf_greedy, prompts, max_tokens):
    params = [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens]
    outs = llm.generate(prompts, params)
    for prompt, n, out in zip(prompts, max_tokens, outs, strict=True):
        expected = hf_greedy(model_dir, prompt, n)
        assert out.token_ids == expected, f"prompt of {len(prompt)} tokens"
        assert out.finish_reason == ("length" if len(expected) == n and expected[-1] != 2 else "stop")
        assert out.prompt_token_ids == prompt
    return outs


@pytest.mark.parametrize("preset", PRESETS)
def test_batch_of_mixed_lengths(preset, toy_model, make_llm, hf_greedy):
    model_dir = toy_model(preset)
    llm = make_llm(model_dir, num_kv_blocks=64, enable_prefix_caching=False)
    check(llm, model_dir, hf_greedy, random_prompts(LENGTHS, seed=1), MAX_TOKENS)


@pytest.mark.parametrize("preset", PRESETS)
def test_chunked_prefill(preset, toy_model, make_llm, hf_greedy):
    model_dir = toy_model(preset)
    llm = make_llm(model_dir, num_kv_blocks=64, max_num_tokens=8, max_batch_size=4, block_size=4)
    check(llm, model_dir, hf_greedy, random_prompts(LENGTHS, seed=1), MAX_TOKENS)
    # 131 prompt tokens through an 8-token budget: chunking happened.
    assert llm.stats().num_steps > sum(LENGTHS) // 8


@pytest.mark.parametrize("preset", PRESETS)
def test_prefix_cache_hits(preset, toy_model, make_llm, hf_greedy):
    model_dir = toy_model(preset)
    shared = random_prompts([33], seed=7)[0][1:]
    prompts = random_prompts([45, 50, 37], seed=2, prefix=shared)
    llm = make_llm(model_dir, num_kv_blocks=64, block_size=8)
    first = check(llm, model_dir, hf_greedy, prompts[:1], [5])
    assert first[0].num_cached_tokens == 0
    computed_before = llm.stats().num_computed_tokens
    outs = check(llm, model_dir, hf_greedy, prompts, [5, 7, 3])
    # BOS + 32 shared tokens = 4 full blocks of 8 shared with the first request.
    assert [o.num_cached_tokens for o in outs] == [40, 32, 32]
    stats = llm.stats()
    assert stats.prefix_cache_hits == 40 + 32 + 32
    uncached = sum(len(p) for p in prompts) + 5 + 7 + 3 - 3
    assert stats.num_computed_tokens - computed_before == uncached - (40 + 32 + 32)


@pytest.mark.parametrize("preset", PRESETS)
def test_preemption(preset, toy_model, make_llm, hf_greedy):
    model_dir = toy_model(preset)
    # All four prompts fit 14 blocks of 4 tokens when admitted; growing by 10-14 tokens each does not.
    llm = make_llm(model_dir, num_kv_blocks=14, block_size=4)
    check(llm, model_dir, hf_greedy, random_prompts([12, 14, 10, 13], seed=3), [12, 10, 14, 11])
    assert llm.stats().num_preemptions > 0


def test_everything_at_once(toy_model, make_llm, hf_greedy):
    """Shared prefixes + chunking + a pool small enough to preempt, arriving in two waves."""
    model_dir = toy_model("llama-tiny")
    shared = random_prompts([21], seed=9)[0][1:]
    prompts = random_prompts([30, 26, 41, 23, 35, 28], seed=10, prefix=shared) + random_prompts([7, 15], seed=11)
    max_tokens = [11, 3, 8, 14, 6, 9, 12, 5]
    llm = make_llm(model_dir, num_kv_blocks=24, block_size=4, max_num_tokens=12, max_batch_size=6)
    check(llm, model_dir, hf_greedy, prompts[:3], max_tokens[:3])
    outs = check(llm, model_dir, hf_greedy, prompts, max_tokens)
    stats = llm.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert any(o.num_cached_tokens > 0 for o in outs)


@pytest.mark.parametrize(("preset", "step"), [("llama-tiny", 1), ("mistral-tiny", 3)])
def test_decode_attention_in_kv_head_chunks(preset, step, toy_model, make_llm, hf_greedy, monkeypatch):
    """Large decode batches attend a few KV heads at a time (cache locality); the tokens stay HF's."""
    from kiln.engine.layers import attention

    calls = []
    monkeypatch.setattr(attention, "heads_per_chunk", lambda kvh, kv_bytes: calls.append(kvh) or step)
    model_dir = toy_model(preset)
    llm = make_llm(model_dir, num_kv_blocks=64, enable_prefix_caching=False, attention_backend="torch")
    check(llm, model_dir, hf_greedy, random_prompts(LENGTHS, seed=1), MAX_TOKENS)
    assert calls  # the chunked path really ran


def test_heads_per_chunk_keeps_small_gathers_whole():
    from kiln.engine.layers.attention import _CHUNK_BYTES, heads_per_chunk

    assert heads_per_chunk(4, _CHUNK_BYTES) == 4
    assert heads_per_chunk(4, 2 * _CHUNK_BYTES) == 2
    assert heads_per_chunk(4, 3 * _CHUNK_BYTES) == 1
    assert heads_per_chunk(8, 100 * _CHUNK_BYTES) == 1
