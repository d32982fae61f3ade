"""AsyncLLM: requests joining a running batch stay HF-exact; aborts end streams and free blocks."""

from __future__ import annotations

import asyncio

import pytest
from conftest import assert_no_leaks
from engine_testlib import random_prompts
from kiln.engine import AsyncLLM, RequestError, SamplingParams

GREEDY = dict(temperature=0)


async def collect(engine, prompt, params, request_id=None, on_delta=None):
    ids, text, deltas = [], "", []
    async for d in engine.generate(prompt, params, request_id=request_id):
        ids += d.new_token_ids
        text += d.text
        deltas.append(d)
        if on_delta is not None:
            await on_delta(len(deltas))
    return ids, text, deltas


async def test_requests_added_mid_decode_match_hf(toy_model, hf_greedy):
    model_dir = toy_model("llama-tiny")
    prompts = random_prompts([30, 9, 21], seed=5)
    engine = AsyncLLM(model_dir, num_kv_blocks=64, block_size=8, max_num_tokens=16, max_batch_size=4)
    async with engine:
        joined: list[asyncio.Task] = []

        async def add_others(n):
            if n == 3:  # the first request is mid-decode: two more join the batch
                joined.extend(asyncio.create_task(collect(engine, p, SamplingParams(**GREEDY, max_tokens=m)))
                              for p, m in ((prompts[1], 10), (prompts[2], 7)))

        first = await collect(engine, prompts[0], SamplingParams(**GREEDY, max_tokens=16), on_delta=add_others)
        others = await asyncio.gather(*joined)
    results = [first, *others]
    for prompt, n, (ids, _, deltas) in zip(prompts, (16, 10, 7), results, strict=True):
        assert ids == hf_greedy(model_dir, prompt, n)
        assert deltas[-1].finish_reason in ("length", "stop")
        assert deltas[-1].num_output_tokens == len(ids) and deltas[-1].num_prompt_tokens == len(prompt)
    assert engine.stats().avg_batch_size > 1  # they really shared steps
    assert_no_leaks(engine)


async def test_abort_ends_stream_and_frees_blocks(toy_model):
    engine = AsyncLLM(toy_model("llama-tiny"), num_kv_blocks=64, block_size=4)
    async with engine:
        params = SamplingParams(**GREEDY, max_tokens=200, ignore_eos=True)

        async def abort_at(n):
            if n == 3:
                engine.abort("victim")

        ids, _, deltas = await collect(engine, [1, 7, 8, 9], params, request_id="victim", on_delta=abort_at)
        assert deltas[-1].finish_reason == "abort"
        assert 3 <= len(ids) < 200
        # A consumer that walks away aborts its request too.
        stream = engine.generate([1, 5, 6], params, request_id="walker")
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(100):
            if engine.stats().num_running == 0 and engine.stats().num_waiting == 0:
                break
            await asyncio.sleep(0.02)
        # The engine still serves after aborts.
        ids2, _, _ = await collect(engine, [1, 7, 8, 9], SamplingParams(**GREEDY, max_tokens=3))
        assert ids2 == ids[:3]
    assert_no_leaks(engine)


async def test_bad_request_raises_at_call_and_queue_keeps_going(toy_model):
    engine = AsyncLLM(toy_model("llama-tiny"), num_kv_blocks=8, block_size=4, max_seq_len=64)
    async with engine:
        with pytest.raises(RequestError) as e:
            engine.generate([], SamplingParams())
        assert e.value.param == "prompt"
        with pytest.raises(RequestError) as e:
            engine.generate([1] * 20, SamplingParams(max_tokens=40))  # 59 tokens > 8 blocks x 4
        assert e.value.param == "max_tokens"
        ids, _, _ = await collect(engine, [1, 2, 3], SamplingParams(**GREEDY, max_tokens=2))
        assert len(ids) >= 1
    assert_no_leaks(engine)


async def test_streamed_text_joins_to_final_text_with_stop_string(toy_model, make_llm):
    model_dir = toy_model("llama-tiny")
    prompt = random_prompts([9], seed=5)[0]
    ref = make_llm(model_dir, num_kv_blocks=64).generate(
        [prompt], SamplingParams(**GREEDY, max_tokens=16, ignore_eos=True))[0]
    stop = ref.text[6:9]
    offline = make_llm(model_dir, num_kv_blocks=64).generate(
        [prompt], SamplingParams(**GREEDY, max_tokens=16, stop=[stop]))[0]
    engine = AsyncLLM(model_dir, num_kv_blocks=64)
    async with engine:
        ids, text, deltas = await collect(engine, prompt, SamplingParams(**GREEDY, max_tokens=16, stop=[stop]))
    assert text == offline.text == ref.text[:6]
    assert ids == offline.token_ids and deltas[-1].finish_reason == "stop"
    assert_no_leaks(engine)


async def test_churn_with_random_aborts_leaves_no_blocks(toy_model):
    import random

    rng = random.Random(0)
    engine = AsyncLLM(toy_model("llama-tiny"), num_kv_blocks=40, block_size=4, max_batch_size=8,
                      max_num_tokens=32)
    async with engine:
        async def one(i):
            prompt = [1] + [rng.randrange(5, 1000) for _ in range(rng.randint(1, 40))]
            params = SamplingParams(temperature=0.8, seed=i, max_tokens=rng.randint(1, 30), ignore_eos=True)
            cut = rng.randint(1, 12) if i % 2 else None
            n = 0
            async for d in engine.generate(prompt, params, request_id=f"r{i}"):
                n += len(d.new_token_ids)
                if cut is not None and n >= cut and d.finish_reason is None:
                    engine.abort(f"r{i}")
                last = d
            return last.finish_reason

        reasons = await asyncio.gather(*(one(i) for i in range(30)))
        assert set(reasons) <= {"length", "abort"} and "abort" in reasons and "length" in reasons
    assert_no_leaks(engine)


async def test_an_adapter_removal_queued_as_the_engine_stops_is_answered(toy_model):
    """A pool unloading an engine while its adapter follower removes one of its adapters: the removal was queued
    for a loop that had stopped taking commands, and its caller (the pool's follower) waited for good."""
    engine = AsyncLLM(toy_model("llama-tiny"), num_kv_blocks=16, block_size=4)
    await engine.start()
    engine._stopping = True  # the loop stops taking commands (what shutdown starts with) ...
    engine._wakeup.set()
    await asyncio.to_thread(engine._thread.join)
    removal = asyncio.ensure_future(engine.remove_lora("gone"))  # ... and then a removal is queued
    await asyncio.sleep(0)
    assert not removal.done()
    await engine.shutdown()
    assert await asyncio.wait_for(removal, 10) is False  # answered: nothing was loaded under that name
