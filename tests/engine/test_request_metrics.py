"""Serving hooks: per-request queue time (first delta, RequestOutput.metrics) and the batch-size histogram."""

from __future__ import annotations

from conftest import assert_no_leaks
from engine_testlib import random_prompts
from kiln.engine import AsyncLLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_queue_time_counts_the_wait_for_a_batch_slot(toy_model, make_llm):
    llm = make_llm(toy_model("llama-tiny"), num_kv_blocks=64, block_size=8, max_batch_size=1)
    first, second = llm.generate(random_prompts([12, 7], seed=1), PARAMS)
    m1, m2 = first.metrics, second.metrics
    assert m1.queue_time is not None and 0 <= m1.queue_time <= m1.first_token_time - m1.arrival_time
    # One slot: the second request is first scheduled only after the first one finished.
    assert m2.queue_time >= m1.finished_time - m1.first_token_time > 0
    assert m2.queue_time <= m2.first_token_time - m2.arrival_time


def test_batch_size_histogram_counts_every_step(toy_model, make_llm):
    llm = make_llm(toy_model("llama-tiny"), num_kv_blocks=64, block_size=8, max_batch_size=2)
    llm.generate(random_prompts([9, 5, 14], seed=2), [PARAMS, PARAMS, SamplingParams(temperature=0, max_tokens=2)])
    stats = llm.stats()
    hist = stats.batch_size_histogram
    assert set(hist) <= {1, 2} and hist.get(2, 0) > 0
    assert sum(hist.values()) == stats.num_steps
    assert sum(size * n for size, n in hist.items()) == stats.sum_running
    hist[2] += 100  # a copy: the engine's own record is unchanged
    assert llm.stats().batch_size_histogram[2] == hist[2] - 100


async def test_first_stream_delta_carries_queue_time(toy_model):
    engine = AsyncLLM(toy_model("llama-tiny"), num_kv_blocks=64, block_size=8)
    async with engine:
        deltas = [d async for d in engine.generate([1, 9, 10, 11], PARAMS)]
    assert len(deltas) == PARAMS.max_tokens
    assert deltas[0].queue_time is not None and deltas[0].queue_time >= 0
    assert all(d.queue_time is None for d in deltas[1:])
    assert_no_leaks(engine)
