"""What translating into another API costs: the CPU time the Messages and Responses layers spend on a request (its
body into a chat request, the chat answer or each chunk of it into the dialect's), counted on ``/metrics`` as
``kiln:dialect_translation_seconds_total{endpoint}``, which ``kiln bench --server --endpoints`` reads beside the
throughput it measures (docs/serving.md).

It is thread CPU time (``time.thread_time``), so neither the engine's thread holding the GIL nor other requests'
coroutines running while a stream awaits its next chunk count; a stream's time is its own work between chunks,
less the time the chunks' producer (the chat layer underneath, the same for every dialect) spent.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def translating(counter: Any) -> Iterator[None]:
    """Add the CPU time of the ``with`` block to ``counter`` (a labelled prometheus Counter)."""
    start = time.thread_time()
    try:
        yield
    finally:
        counter.inc(max(time.thread_time() - start, 0.0))


def costed(spent: list[float], fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``fn``, its CPU time added to ``spent[0]`` (a request's translation runs before its engine, hence its
    counter, is known; :func:`kiln.serving.request_path.generate` adds it there)."""
    def call(arg: Any) -> Any:
        start = time.thread_time()
        try:
            return fn(arg)
        finally:
            spent[0] += time.thread_time() - start
    return call


async def timed_stream(counter: Any, translate: Callable[[AsyncIterator[Any]], AsyncIterator[str]],
                       chunks: AsyncIterator[Any]) -> AsyncIterator[str]:
    """``translate(chunks)``, the CPU time it spends between chunks (not the chunks' own) added to ``counter``."""
    inner = [0.0]  # CPU time spent producing chunks, inside the translator's awaits

    async def measured() -> AsyncIterator[Any]:
        it = chunks.__aiter__()
        while True:
            start = time.thread_time()
            try:
                chunk = await it.__anext__()
            except StopAsyncIteration:
                return
            finally:
                inner[0] += time.thread_time() - start
            yield chunk

    outer = translate(measured())
    try:
        while True:
            start, before = time.thread_time(), inner[0]
            try:
                line = await outer.__anext__()
            except StopAsyncIteration:
                return
            finally:
                counter.inc(max(time.thread_time() - start - (inner[0] - before), 0.0))
            yield line
    finally:
        await outer.aclose()  # a client that left closes this stream: close the translator (and its chunks) now
