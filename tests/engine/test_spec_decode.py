"""Prompt-lookup speculative decoding: greedy output equals Hugging Face's and the engine's own
without speculation, token for token, through every scheduling path; KV blocks stay exact.

Prompts repeat a random phrase so that n-gram drafts exist and the random-weight toy models
accept some of them (each test checks that drafts were proposed *and* accepted, so the
verification path really ran); outputs are compared with ``generate(do_sample=False)``.
"""

from __future__ import annotations

import pytest
import torch
from engine_testlib import random_prompts
from kiln.engine import SamplingParams
from kiln.engine.prefix_hash import block_keys

PRESETS = ["llama-tiny", "qwen2-tiny", "mistral-tiny", "llama3-tiny"]
SPEC = {"method": "ngram", "num_speculative_tokens": 4}


def repetitive_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    """Prompts of a random 5..9-token phrase repeated up to ``length`` tokens, after BOS."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        phrase = torch.randint(5, 1024, (int(torch.randint(5, 10, (1,), generator=g)),), generator=g).tolist()
        out.append([1, *(phrase * (n // len(phrase) + 1))[:n - 1]])
    return out


def spec_stats(llm):
    return llm.engine.scheduler.proposer.stats


def check_hf(llm, model_dir, hf_greedy, prompts, max_tokens):
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens])
    for prompt, n, out in zip(prompts, max_tokens, outs, strict=True):
        expected = hf_greedy(model_dir, prompt, n)
        assert out.token_ids == expected, f"prompt of {len(prompt)} tokens"
        assert out.finish_reason == ("length" if len(expected) == n and expected[-1] != 2 else "stop")
    stats = spec_stats(llm)
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, stats
    return outs


def assert_blocks_exact(llm):
    """Every running request holds exactly the blocks its computed tokens need (no speculative tail)."""
    bm = llm.engine.block_manager
    for req in llm.engine.scheduler.running:
        assert len(req.block_table) == bm.blocks_needed(req.num_computed_tokens), req.request_id
        assert req.num_computed_tokens <= req.num_tokens


@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_equals_hf_with_speculation(preset, toy_model, make_llm, hf_greedy):
    model_dir = toy_model(preset)
    llm = make_llm(model_dir, num_kv_blocks=96, enable_prefix_caching=False, speculative_config=SPEC)
    prompts = repetitive_prompts([3, 17, 40, 71], seed=1) + random_prompts([25], seed=2)
    check_hf(llm, model_dir, hf_greedy, prompts, [9, 24, 30, 16, 20])


@pytest.mark.parametrize("preset", PRESETS[:2])
def test_chunked_prefill_with_speculation(preset, toy_model, make_llm, hf_greedy):
    model_dir = toy_model(preset)
    llm = make_llm(model_dir, num_kv_blocks=96, max_num_tokens=8, max_batch_size=4, block_size=4,
                   speculative_config=SPEC)
    check_hf(llm, model_dir, hf_greedy, repetitive_prompts([17, 40, 33, 25], seed=3), [20, 12, 25, 18])


def test_prefix_cache_hashes_committed_tokens_only(toy_model, make_llm, hf_greedy):
    model_dir = toy_model("llama-tiny")
    llm = make_llm(model_dir, num_kv_blocks=128, block_size=4, speculative_config=SPEC)
    prompts = repetitive_prompts([30, 23], seed=4)
    outs = check_hf(llm, model_dir, hf_greedy, prompts, [30, 26])
    bm = llm.engine.block_manager
    committed = set()
    for out in outs:
        committed.update(block_keys(out.prompt_token_ids + out.token_ids, bm.block_size))
    assert bm.hash_to_block and set(bm.hash_to_block) <= committed
    # The same sequences come back as prompts: every full block but the last token's is a hit.
    again = [o.prompt_token_ids + o.token_ids for o in outs]
    second = check_hf(llm, model_dir, hf_greedy, again, [5, 5])
    assert [o.num_cached_tokens for o in second] == [(len(p) - 1) // 4 * 4 for p in again]


@pytest.mark.parametrize("preset", PRESETS[:2])
def test_preemption_with_speculation(preset, toy_model, make_llm, hf_greedy):
    model_dir = toy_model(preset)
    llm = make_llm(model_dir, num_kv_blocks=16, block_size=4, speculative_config=SPEC)
    check_hf(llm, model_dir, hf_greedy, repetitive_prompts([12, 14, 10, 13], seed=5), [14, 12, 16, 13])
    assert llm.stats().num_preemptions > 0


def test_blocks_exact_after_every_step(toy_model, make_llm):
    model_dir = toy_model("llama-tiny")
    llm = make_llm(model_dir, num_kv_blocks=64, block_size=4, speculative_config=SPEC)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for prompt in repetitive_prompts([20, 33, 9], seed=6):
        engine.add(engine.make_request(prompt, params))
    while engine.has_unfinished():
        engine.step()
        assert_blocks_exact(llm)
    stats = spec_stats(llm)
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens, stats


def both(make_llm, model_dir, prompts, params, **kwargs):
    plain = make_llm(model_dir, num_kv_blocks=96, **kwargs).generate(prompts, params)
    llm = make_llm(model_dir, num_kv_blocks=96, speculative_config=SPEC, **kwargs)
    return plain, llm.generate(prompts, params), spec_stats(llm)


def test_request_features_match_without_speculation(toy_model, make_llm):
    """Stop strings and ids, max_tokens, ignore_eos, min_tokens, penalties and logprobs: the same
    tokens, text, finish reasons and logprobs as the engine without speculation."""
    model_dir = toy_model("llama-tiny")
    prompts = repetitive_prompts([30, 22, 41, 17, 26, 35], seed=7)
    probe = make_llm(model_dir, num_kv_blocks=96).generate(
        prompts[:2], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    stop_text = probe[0].text[len(probe[0].text) // 2:][:3]  # occurs in the first output: it must stop there
    assert stop_text.strip()
    params = [
        SamplingParams(temperature=0, max_tokens=30, stop=[stop_text]),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[probe[1].token_ids[12]]),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=20, ignore_eos=False),
        SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=30, logprobs=3, ignore_eos=True),
    ]
    plain, spec, stats = both(make_llm, model_dir, prompts, params)
    for a, b in zip(plain, spec, strict=True):
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
    assert spec[0].finish_reason == "stop" and stop_text not in spec[0].text
    assert spec[1].finish_reason == "stop" and len(spec[1].token_ids) <= 13
    assert len(spec[2].token_ids) == 7
    for la, lb in zip(plain[5].logprobs, spec[5].logprobs, strict=True):
        assert la.keys() == lb.keys()
        assert all(abs(la[t] - lb[t]) < 1e-4 for t in la)
    assert stats.num_accepted_tokens > 0


def test_seeded_sampling_matches_without_speculation(toy_model, make_llm):
    """A seeded request's generator is rewound to one draw per committed token: the same tokens."""
    model_dir = toy_model("llama-tiny")
    prompts = repetitive_prompts([30, 22, 41, 17], seed=8)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=s, max_tokens=40, ignore_eos=True)
              for t, k, p, s in [(0.3, 0, 1.0, 1), (0.5, 20, 1.0, 2), (0.2, 0, 0.9, 3), (0.4, 5, 0.95, 4)]]
    plain, spec, stats = both(make_llm, model_dir, prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens


def test_load_rule_turns_speculation_off_above_the_batch_limit(toy_model, make_llm, hf_greedy):
    model_dir = toy_model("llama-tiny")
    llm = make_llm(model_dir, num_kv_blocks=96, speculative_config={**SPEC, "disable_by_batch_size": 1})
    engine = llm.engine
    prompts = repetitive_prompts([20, 30], seed=9)
    reqs = [engine.make_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, [6, 24], strict=True)]
    for req in reqs:
        engine.add(req)
    while engine.has_unfinished():
        engine.step()
        running = engine.scheduler.running
        assert len(running) <= 1 or not any(r.spec_token_ids for r in running)
    assert engine.scheduler.num_steps_speculation_off > 0
    stats = llm.stats()
    assert stats.num_speculative_tokens == 4 and stats.spec_steps_off_by_batch > 0
    assert 0 < stats.spec_num_accepted_tokens == sum(stats.spec_accepted_per_position)
    assert stats.spec_acceptance_rate == stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens
    assert spec_stats(llm).num_draft_tokens > 0  # once the short request left, the long one speculated
    assert reqs[1].output_token_ids == hf_greedy(model_dir, prompts[1], 24)[:len(reqs[1].output_token_ids)]
    assert len(reqs[1].output_token_ids) == 24
