"""Prompt logprobs (what `/v1/completions` returns for ``echo`` with ``logprobs``) through the whole engine: each
prompt token's logprob given the tokens before it, its rank and the k most likely there, as transformers computes them,
whether the prompt is prefilled in one step or in chunks, beside other requests, and after its prefix is cached."""

from __future__ import annotations

import pytest
import torch
from engine_testlib import random_prompts
from kiln.engine import SamplingParams


def hf_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at each position but the last: row j is token j + 1's distribution."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1], dim=-1)


def check(out, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    entries, ranks = out.prompt_logprobs, out.prompt_ranks
    assert entries is not None and len(entries) == len(ranks) == len(prompt) and entries[0] is ranks[0] is None
    for j, (tok, entry, rank) in enumerate(zip(prompt[1:], entries[1:], ranks[1:], strict=True)):
        top = set(ref[j].topk(k).indices.tolist()) if k else set()
        assert set(entry) == top | {tok}, j
        for t, lp in entry.items():
            assert lp == pytest.approx(ref[j, t].item(), abs=1e-4), (j, t)
        # its rank: 1 + the tokens more likely there (a near tie, within the kernels' rounding, may go either way)
        above, near = (ref[j] > ref[j, tok] + 1e-4).sum().item(), (abs(ref[j] - ref[j, tok]) <= 1e-4).sum().item()
        assert above + 1 <= rank <= above + near, (j, rank, above, near)


@pytest.mark.parametrize("chunk", [None, 16])
def test_prompt_logprobs_match_transformers_in_one_step_or_in_chunks(toy_model, make_llm, chunk, monkeypatch):
    from kiln.engine import prompt_logprobs

    model_dir = toy_model("llama-tiny")
    kwargs = {"max_num_tokens": chunk} if chunk else {}
    if chunk:  # and the prompt-logprob request's own chunks cut to a few tokens
        monkeypatch.setattr(prompt_logprobs, "ROWS_AT_ONCE", 5)
    # tactics pinned: the tokens are held equal across batches of other shapes, which a timed table may run on
    # other kernels
    llm = make_llm(model_dir, num_kv_blocks=64, block_size=8, max_batch_size=4, tactics="aten", **kwargs)
    prompt, other = random_prompts([37, 21], seed=11)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    alone = llm.generate([other], greedy)[0].token_ids
    asked = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=3)
    out, beside = llm.generate([prompt, other], [asked, greedy])
    check(out, prompt, hf_logprobs(model_dir, prompt), 3)
    assert beside.prompt_logprobs is None and beside.token_ids == alone  # the request beside it is untouched
    plain = llm.generate([prompt], greedy)[0]
    assert plain.token_ids == out.token_ids and plain.prompt_logprobs is None


def test_a_cached_prefix_still_gives_every_prompt_token_its_logprob(toy_model, make_llm):
    model_dir = toy_model("llama-tiny")
    llm = make_llm(model_dir, num_kv_blocks=64, block_size=8, tactics="aten")
    prompt = random_prompts([30], seed=12)[0]
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([prompt], greedy)  # its full blocks are in the prefix cache now
    again = llm.generate([prompt], greedy)[0]
    assert again.num_cached_tokens >= 24, "the prefix cache holds the prompt's blocks"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0 and out.token_ids == again.token_ids
    check(out, prompt, hf_logprobs(model_dir, prompt), 0)


def test_prompt_logprobs_out_of_range_are_refused_naming_the_field():
    for bad in (-1, 21, 1.5):
        with pytest.raises(ValueError, match="prompt_logprobs must be between 0 and 20"):
            SamplingParams(prompt_logprobs=bad)


def test_a_prompt_logprobs_prefill_runs_in_chunks_of_rows_at_once(toy_model, make_llm, monkeypatch):
    """Each prompt position is a logits row (rows times the vocabulary): such a request's prefill is cut to
    ROWS_AT_ONCE tokens a step, whatever max_num_tokens allows; a request without them is not."""
    from kiln.engine import prompt_logprobs

    monkeypatch.setattr(prompt_logprobs, "ROWS_AT_ONCE", 8)
    model_dir = toy_model("llama-tiny")
    llm = make_llm(model_dir, num_kv_blocks=64, block_size=8, tactics="aten")
    prompt = random_prompts([37], seed=13)[0]
    steps = llm.stats().num_steps
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    assert llm.stats().num_steps - steps == 5  # 8 + 8 + 8 + 8 + 5 tokens, the last chunk sampling the token
    check(out, prompt, hf_logprobs(model_dir, prompt), 1)
    steps = llm.stats().num_steps
    llm.generate([prompt[:-1] + [prompt[0]]], SamplingParams(temperature=0, max_tokens=1))
    assert llm.stats().num_steps - steps == 1
