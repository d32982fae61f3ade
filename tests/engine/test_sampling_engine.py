"""Sampling and stopping through the whole engine: seeds, stop rules, min/max tokens, logprobs."""

from __future__ import annotations

import pytest
import torch
from engine_testlib import random_prompts
from kiln.engine import SamplingParams


@pytest.fixture
def llm(toy_model, make_llm):
    return make_llm(toy_model("llama-tiny"), num_kv_blocks=64, block_size=8)


def test_seeded_sampling_is_independent_of_the_batch(llm):
    prompt = random_prompts([12], seed=1)[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate([prompt], seeded)[0].token_ids
    others = random_prompts([5, 30, 18], seed=2)
    noisy = SamplingParams(temperature=1.5, max_tokens=12, ignore_eos=True)
    mixed = llm.generate([others[0], prompt, others[1], others[2]], [noisy, seeded, noisy, noisy])
    assert mixed[1].token_ids == alone
    other_seed = llm.generate([prompt], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=10,
                                                        ignore_eos=True))[0].token_ids
    assert other_seed != alone


def greedy_tokens(llm, prompt, n=12):
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]


def test_stop_token_ids_and_max_tokens(llm):
    prompt = random_prompts([9], seed=3)[0]
    ref = greedy_tokens(llm, prompt).token_ids
    assert len(ref) == 12
    stop_id = ref[4]
    cut = ref.index(stop_id)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == ref[: cut + 1] and out.finish_reason == "stop"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert out.token_ids == ref[:3] and out.finish_reason == "length"


def test_eos_ignore_eos_and_min_tokens(llm):
    prompt = random_prompts([9], seed=3)[0]
    ref = greedy_tokens(llm, prompt).token_ids
    llm.engine.eos_token_ids = [ref[2]]  # pretend the model's EOS is the third greedy token
    first = ref.index(ref[2])
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0]
    assert out.token_ids == ref[: first + 1] and out.finish_reason == "stop"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert out.token_ids == ref and out.finish_reason == "length"
    # Below min_tokens EOS is masked out of sampling, so the request cannot stop early.
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, min_tokens=8))[0]
    assert len(out.token_ids) >= 8 and ref[2] not in out.token_ids[:8]


def test_stop_string_truncates_text_keeps_tokens(llm):
    prompt = random_prompts([9], seed=5)[0]
    ref = greedy_tokens(llm, prompt, n=16)
    text = ref.text
    stop = text[6:9]
    assert len(stop) == 3 and stop.strip() == stop and text.find(stop) == 6, text
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == text[:6]
    assert ref.token_ids[: len(out.token_ids)] == out.token_ids and len(out.token_ids) < 16
    inc = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, stop=[stop],
                                                 include_stop_str_in_output=True))[0]
    assert inc.text == text[:9]


def test_logprobs_match_hf_log_softmax(llm, toy_model):
    from transformers import AutoModelForCausalLM

    prompt = random_prompts([7], seed=6)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3))[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    model = AutoModelForCausalLM.from_pretrained(toy_model("llama-tiny"), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1]
    ref = torch.log_softmax(logits, dim=-1)
    for step, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert tok in entry and len(entry) == 3  # greedy token is also the top-1 alternative
        top = ref[step].topk(3)
        assert set(entry) == set(top.indices.tolist())
        for t, lp in entry.items():
            assert lp == pytest.approx(ref[step, t].item(), abs=1e-4)
