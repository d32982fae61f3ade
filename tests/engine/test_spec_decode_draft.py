"""Draft-model speculative decoding: greedy output equals Hugging Face's and the engine's own without
speculation, token for token, through every scheduling path; KV blocks stay exact; bad drafts are refused
with the field named.

Two random-weight drafts per target: the target itself (every draft should be accepted, so the draft's
bookkeeping of which K/V it holds is checked by acceptance staying near 100 %), and the target's first
layer under its head (``make_truncated_draft``: most drafts rejected, so the rollback path runs).
"""

from __future__ import annotations

import pytest
from engine_testlib import random_prompts
from kiln.engine import SamplingParams
from kiln.engine.errors import ConfigError
from kiln.engine.random_checkpoint import make_random_model, make_truncated_draft
from kiln.engine.spec_decode.draft_model import DraftModel
from test_spec_decode import assert_blocks_exact, check_hf, repetitive_prompts, spec_stats


def draft_spec(draft_dir, k: int = 4) -> dict:
    return {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def truncated(tmp_path_factory):
    made = {}

    def make(model_dir, layers: int = 1):
        key = (str(model_dir), layers)
        if key not in made:
            made[key] = make_truncated_draft(model_dir, tmp_path_factory.mktemp("draft"), layers)
        return made[key]

    return make


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen2-tiny"])
@pytest.mark.parametrize("draft", ["self", "truncated"])
def test_greedy_equals_hf_with_a_draft_model(preset, draft, toy_model, make_llm, hf_greedy, truncated):
    model_dir = toy_model(preset)
    draft_dir = model_dir if draft == "self" else truncated(model_dir)
    # A step of 8 tokens: chunked prefill for the target, catch-up passes in chunks for the draft.
    llm = make_llm(model_dir, num_kv_blocks=96, block_size=4, max_num_tokens=8, max_batch_size=4,
                   speculative_config=draft_spec(draft_dir))
    prompts = repetitive_prompts([3, 17, 40], seed=1) + random_prompts([25], seed=2)
    check_hf(llm, model_dir, hf_greedy, prompts, [9, 24, 30, 16])
    stats = spec_stats(llm)
    if draft == "self":  # the same weights: a rejection is a near-tie that another kernel order broke
        assert stats.acceptance_rate > 0.9, stats
    else:
        assert stats.num_accepted_tokens < stats.num_draft_tokens, stats


def test_draft_catch_up_passes_fit_the_step_budget(toy_model, make_llm, monkeypatch):
    model_dir = toy_model("llama-tiny")
    sizes = []
    real_run = DraftModel.run

    def recording_run(self, rows, logits):
        sizes.append(sum(len(ids) for ids, _, _ in rows))
        return real_run(self, rows, logits)

    monkeypatch.setattr(DraftModel, "run", recording_run)
    llm = make_llm(model_dir, num_kv_blocks=96, max_num_tokens=16, max_batch_size=4,
                   speculative_config=draft_spec(model_dir))
    outs = llm.generate(random_prompts([60, 45, 70], seed=3), SamplingParams(temperature=0, max_tokens=8))
    assert all(len(o.token_ids) == 8 for o in outs)
    assert max(sizes) <= 16 and len(sizes) > 8, sizes


def test_blocks_exact_and_preemption_with_a_draft_model(toy_model, make_llm, hf_greedy, truncated):
    model_dir = toy_model("llama-tiny")
    llm = make_llm(model_dir, num_kv_blocks=16, block_size=4, speculative_config=draft_spec(truncated(model_dir)))
    engine = llm.engine
    prompts = repetitive_prompts([12, 14, 10, 13], seed=5)
    reqs = [engine.make_request(p, SamplingParams(temperature=0, max_tokens=n))
            for p, n in zip(prompts, [14, 12, 16, 13], strict=True)]
    for req in reqs:
        engine.add(req)
    while engine.has_unfinished():
        engine.step()
        assert_blocks_exact(llm)
    assert llm.stats().num_preemptions > 0
    for prompt, req in zip(prompts, reqs, strict=True):
        assert req.output_token_ids == hf_greedy(model_dir, prompt, req.max_tokens)[:len(req.output_token_ids)]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_prefix_hits_and_seeded_sampling_match_without_speculation(toy_model, make_llm, truncated):
    """A prefix-cache hit (the draft rewrites the shared blocks' draft K/V itself) and seeded sampling
    (one draw per committed token): the same tokens as the engine without speculation."""
    model_dir = toy_model("llama-tiny")
    shared = random_prompts([24], seed=6)[0]
    prompts = [shared + tail for tail in random_prompts([5, 9, 7], seed=7)]
    params = [SamplingParams(temperature=0, max_tokens=20),
              SamplingParams(temperature=0.5, top_k=20, seed=2, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.3, top_p=0.9, seed=3, max_tokens=20, ignore_eos=True)]
    kwargs = dict(num_kv_blocks=96, block_size=4)
    plain = make_llm(model_dir, **kwargs)
    spec = make_llm(model_dir, **kwargs, speculative_config=draft_spec(model_dir))
    for llm in (plain, spec):
        llm.generate(prompts[:1], params[:1])  # the shared prefix is cached from here on
    a, b = plain.generate(prompts, params), spec.generate(prompts, params)
    assert [o.token_ids for o in b] == [o.token_ids for o in a]
    assert all(o.num_cached_tokens >= 24 for o in b)
    assert spec_stats(spec).num_accepted_tokens > 0


def test_tensor_parallel_target_with_a_draft_on_rank_0(toy_model, make_llm, truncated):
    model_dir = toy_model("llama-tiny")
    prompts = repetitive_prompts([17, 30], seed=8)
    params = SamplingParams(temperature=0, max_tokens=12)
    kwargs = dict(num_kv_blocks=32, block_size=8, max_num_tokens=16, max_batch_size=4)
    expected = [o.token_ids for o in make_llm(model_dir, **kwargs).generate(prompts, params)]
    llm = make_llm(model_dir, tensor_parallel_size=2, **kwargs, speculative_config=draft_spec(model_dir))
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert spec_stats(llm).num_accepted_tokens > 0


def test_pipeline_parallel_target_with_either_draft_source(toy_model, make_llm):
    """Two pipeline stages in two processes, micro-batched: verified rows cross the stages like prefill
    chunks and their logits come back to rank 0; prompt lookup and a draft model give plain decoding's tokens."""
    model_dir = toy_model("llama-tiny")
    prompts = repetitive_prompts([17, 30, 12], seed=9)
    params = SamplingParams(temperature=0, max_tokens=12)
    kwargs = dict(num_kv_blocks=32, block_size=8, max_num_tokens=32, max_batch_size=4, micro_batch_min_tokens=1)
    expected = [o.token_ids for o in make_llm(model_dir, **kwargs).generate(prompts, params)]
    for spec in ({"method": "ngram", "num_speculative_tokens": 3}, draft_spec(model_dir)):
        llm = make_llm(model_dir, pipeline_parallel_size=2, **kwargs, speculative_config=spec)
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected, spec["method"]
        assert spec_stats(llm).num_accepted_tokens > 0, spec["method"]
        llm.shutdown()


def test_a_draft_model_is_refused_with_the_field_named(toy_model, make_llm, tmp_path, truncated):
    model_dir = toy_model("llama-tiny")
    with pytest.raises(ConfigError, match="speculative_config.model must name"):
        make_llm(model_dir, speculative_config={"method": "draft_model"})
    with pytest.raises(ConfigError, match="speculative_config.model must name"):
        make_llm(model_dir, speculative_config={"method": "ngram", "model": str(model_dir)})
    with pytest.raises(ConfigError, match="not a model directory"):
        make_llm(model_dir, speculative_config=draft_spec(tmp_path))
    other = make_random_model(tmp_path / "other", "llama-tiny", seed=5)  # another random tokenizer
    with pytest.raises(ConfigError, match="must share the target's tokenizer"):
        make_llm(model_dir, speculative_config=draft_spec(other))
    llm = make_llm(model_dir, num_kv_blocks=32, speculative_config=draft_spec(truncated(model_dir)))
    with pytest.raises(ConfigError, match="is not the draft model this engine loaded"):
        llm.engine.set_speculative(draft_spec(model_dir))
    llm.engine.set_speculative({"method": "ngram"})  # another source on the same engine is fine
    llm.engine.set_speculative(draft_spec(truncated(model_dir), k=2))
    assert llm.engine.scheduler.proposer.config.num_speculative_tokens == 2
