"""A request can hurt only itself: bad ids are refused up front, and a request that fails while
its token is sampled or decoded ends alone (finish reason "error") while the batch goes on."""

from __future__ import annotations

import hashlib
import math
import random
import struct

import pytest
from engine_testlib import random_prompts
from kiln.engine import RequestError, SamplingParams
from kiln.engine.detokenizer import StopPrefixes
from kiln.engine.prefix_hash import PREFIX_HASH_SCHEME, chain_hash
from kiln.engine.sampling_params import MAX_STOP_STRINGS, SEED_MAX


@pytest.fixture
def llm(toy_model, make_llm):
    return make_llm(toy_model("llama-tiny"), num_kv_blocks=64, block_size=8)


def greedy(n=8, **kwargs):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kwargs)


@pytest.mark.parametrize("field", ["stop_token_ids", "allowed_token_ids"])
def test_out_of_vocab_ids_are_refused_before_queueing(llm, field):
    vocab = llm.engine.vocab_size
    # The request that used to kill a replica: an id past the vocabulary, masked below min_tokens.
    with pytest.raises(RequestError) as err:
        llm.generate(["hi"], SamplingParams(min_tokens=1, **{field: [vocab + 999_999]}))
    assert err.value.param == field and str(vocab) in str(err.value)
    with pytest.raises(RequestError) as err:
        llm.generate(["hi"], SamplingParams(logit_bias={vocab: 5.0}))
    assert err.value.param == "logit_bias"
    assert llm.generate(["hi"], greedy(2))[0].finish_reason == "length"  # the engine is untouched


@pytest.mark.parametrize("kwargs, field", [
    ({"seed": SEED_MAX + 1}, "seed"),
    ({"seed": True}, "seed"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"top_p": math.nan}, "top_p"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"stop": ["x" * 10_000]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logit_bias": {3: 101.0}}, "logit_bias"),
    ({"logit_bias": {3: math.nan}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"logprobs": 21}, "logprobs"),
])
def test_sampling_params_bounds(kwargs, field):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert str(err.value).startswith(field)
    assert len(str(err.value)) < 300  # a megabyte of input is not echoed back


def test_allowed_token_ids_and_logit_bias_steer_sampling(llm):
    prompt = random_prompts([9], seed=3)[0]
    ref = llm.generate([prompt], greedy())[0].token_ids
    banned = ref[0]
    allowed = [t for t in range(40, 50) if t != banned]
    for params in (greedy(allowed_token_ids=allowed),
                   SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed)):
        out = llm.generate([prompt], params)[0].token_ids
        assert len(out) == 8 and set(out) <= set(allowed)
    forced = llm.generate([prompt], greedy(logit_bias={17: 100.0}))[0].token_ids
    assert forced == [17] * 8
    out = llm.generate([prompt], greedy(logit_bias={banned: -100.0}))[0].token_ids
    assert out[0] != banned


def test_a_request_failing_in_its_detokenizer_ends_alone(llm):
    prompts = random_prompts([7, 9, 11], seed=4)
    reqs = [llm.engine.make_request(p, greedy(6)) for p in prompts]

    def broken(_ids):
        raise RuntimeError("simulated decoding failure")

    reqs[1].detokenizer.append = broken
    for req in reqs:
        llm.engine.add(req)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert [r.finish_reason for r in reqs] == ["length", "error", "length"]
    assert "decoding" in reqs[1].error
    alone = llm.generate([prompts[2]], greedy(6))[0].token_ids
    assert reqs[2].output_token_ids == alone


def test_a_request_failing_in_the_sampler_ends_alone(llm, monkeypatch):
    prompts = random_prompts([7, 9, 11], seed=6)
    poisoned = SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True)
    sampler = llm.engine.runner.sampler
    real = type(sampler).__call__

    def flaky(self, logits, rows):
        if any(r.params is poisoned for r in rows):
            raise IndexError("simulated sampler failure")
        return real(self, logits, rows)

    monkeypatch.setattr(type(sampler), "__call__", flaky)
    outs = llm.generate(prompts, [greedy(6), poisoned, greedy(6, logprobs=2)])
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert outs[1].token_ids == [] and "sampling" in outs[1].error
    assert outs[2].token_ids == llm.generate([prompts[2]], greedy(6))[0].token_ids
    assert all(len(step) >= 1 for step in outs[2].logprobs)
    assert llm.engine.runner.sample  # the engine keeps serving
    assert llm.generate([prompts[0]], greedy(3))[0].finish_reason == "length"


def test_async_stream_of_a_failed_request_raises_and_others_finish(toy_model):
    import asyncio

    from kiln.engine import AsyncLLM
    from kiln.engine.errors import RequestFailedError

    async def main():
        engine = AsyncLLM(toy_model("llama-tiny"), num_kv_blocks=64, block_size=8)
        make_request = engine.engine.make_request

        def breaking(prompt, params, request_id, lora_request=None):
            req = make_request(prompt, params, request_id, lora_request)
            if request_id == "bad":
                req.detokenizer.append = None  # calling it fails
            return req

        engine.engine.make_request = breaking
        async with engine:
            good = engine.generate([5, 6, 7], greedy(5))
            bad = engine.generate([8, 9], greedy(5), request_id="bad")
            with pytest.raises(RequestFailedError):
                async for _ in bad:
                    pass
            deltas = [d async for d in good]
            assert deltas[-1].finish_reason == "length"
            assert engine.is_running
            stats = engine.stats()
            assert stats.num_free_blocks == stats.num_total_blocks

    asyncio.run(main())


def test_stop_prefix_automaton_matches_brute_force():
    def longest(text, stops):
        return max((k for s in stops for k in range(1, len(s) + 1) if text.endswith(s[:k])), default=0)

    rng = random.Random(0)
    for _ in range(2000):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 7))) for _ in range(rng.randint(1, 4))]
        automaton, text = StopPrefixes(stops), ""
        for _ in range(rng.randint(1, 10)):
            piece = "".join(rng.choice("abcd") for _ in range(rng.randint(0, 4)))
            text += piece
            assert automaton.feed(piece) == longest(text, stops), (stops, text)


def test_prefix_cache_hash_is_the_documented_sha256_chain():
    first = chain_hash(None, (1, 2, 3, 4))
    root = hashlib.sha256(PREFIX_HASH_SCHEME.encode()).digest()
    assert first == hashlib.sha256(root + struct.pack("<4I", 1, 2, 3, 4)).digest()
    second = chain_hash(first, (5, 6, 7, 8))
    assert second == hashlib.sha256(first + struct.pack("<4I", 5, 6, 7, 8)).digest()
    assert chain_hash(second, (1, 2, 3, 4)) != first  # the same tokens after another prefix differ
