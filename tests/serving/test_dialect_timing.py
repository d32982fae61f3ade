"""The translation's cost counter (kiln.serving.dialect_timing): a stream's own work between chunks is counted, the
chunks' producer's is not, and a closed stream closes its translator."""

from __future__ import annotations

import asyncio
import time

from kiln.serving.dialect_timing import costed, timed_stream, translating


class Counter:
    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float) -> None:
        assert amount >= 0
        self.value += amount


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


async def _chunks(n: int, cost: float):
    for i in range(n):
        _burn(cost)  # the producer's own CPU (the chat layer): not the translation's
        yield i


def _translate(cost: float):
    async def translate(chunks):
        async for chunk in chunks:
            _burn(cost)
            yield f"event {chunk}"
    return translate


def test_a_stream_counts_its_own_work_between_chunks_not_the_producers():
    counter = Counter()

    async def run():
        return [line async for line in timed_stream(counter, _translate(0.01), _chunks(5, 0.03))]

    assert asyncio.run(run()) == [f"event {i}" for i in range(5)]
    assert 0.04 <= counter.value < 0.09  # 5 x 10 ms of its own, none of the producer's 150 ms


def test_a_closed_stream_closes_its_translator():
    counter, closed = Counter(), []

    async def translate(chunks):
        try:
            async for chunk in chunks:
                yield f"event {chunk}"
        finally:
            closed.append(True)

    async def run():
        stream = timed_stream(counter, translate, _chunks(100, 0.0))
        assert await stream.__anext__() == "event 0"
        await stream.aclose()  # a client that left

    asyncio.run(run())
    assert closed == [True]


def test_a_body_and_a_request_translation_are_counted():
    counter, spent = Counter(), [0.0]
    with translating(counter):
        _burn(0.02)
    assert counter.value >= 0.02
    assert costed(spent, lambda x: (_burn(0.02), x)[1])("req") == "req" and spent[0] >= 0.02
