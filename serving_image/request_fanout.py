"""One HTTP request's engine requests, merged into one stream of ``(choice, delta)``.

A request with several prompts or ``n > 1`` fans out into one engine request
per choice; each is pumped by its own task into a shared queue so choices
stream as they are produced. :meth:`Generation.close` is the single exit:
it aborts every engine request that has not finished (freeing its KV blocks
within a step), cancels the pumps and records what finished for metrics. It
runs when the stream ends, fails, is cancelled by a disconnecting client, or
when a drain times out, and running it twice is harmless.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from kiln.serving.inputs import EngineInput
from kiln.serving.metrics import ServingMetrics

log = logging.getLogger("kiln.serving")

_DONE = object()


class Generation:
    def __init__(
        self, engine: Any, metrics: ServingMetrics, request_id: str, inputs: list[EngineInput],
        lora_request: Any = None,
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.inputs = inputs
        self.lora_request = lora_request  # kiln.engine.lora.LoRARequest: the adapter every choice runs under
        self.engine_ids = [f"{request_id}-{item.index}" for item in inputs]
        lora_name = lora_request.lora_name if lora_request is not None else None
        self.timers = [metrics.timer(lora_name) for _ in inputs]
        self.num_prompt_tokens = [len(item.prompt_token_ids) for item in inputs]
        self.num_cached_tokens = [0 for _ in inputs]
        self.finish_reasons: list[str | None] = [None for _ in inputs]
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False

    def start(self) -> None:
        """Submit every engine request now; a RequestError (bad prompt, over a limit) raises here,
        before any response has started, and leaves nothing queued."""
        streams = []
        try:
            for slot, item in enumerate(self.inputs):
                extra = {} if self.lora_request is None else {"lora_request": self.lora_request}
                streams.append(self.engine.generate(item.prompt_token_ids, item.params,
                                                    request_id=self.engine_ids[slot], **extra))
        except BaseException:
            for slot in range(len(streams)):
                self.engine.abort(self.engine_ids[slot])
            self._closed = True  # nothing ran: nothing to record
            raise
        self._tasks = [asyncio.create_task(self._pump(slot, stream)) for slot, stream in enumerate(streams)]

    async def _pump(self, slot: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for delta in stream:
                self._queue.put_nowait((slot, delta))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the consumer, which decides what the client sees
            self._queue.put_nowait((slot, exc))
        else:
            self._queue.put_nowait((slot, _DONE))

    async def deltas(self) -> AsyncIterator[tuple[int, Any]]:
        """Yield ``(slot, StreamDelta)`` as the engine produces them; ``slot`` indexes ``inputs``."""
        remaining = len(self._tasks)
        try:
            while remaining:
                slot, delta = await self._queue.get()
                if delta is _DONE:
                    remaining -= 1
                    continue
                if isinstance(delta, BaseException):
                    raise delta
                self._observe(slot, delta)
                yield slot, delta
        finally:
            await self.close()

    def _observe(self, slot: int, delta: Any) -> None:
        self.num_prompt_tokens[slot] = (
            getattr(delta, "num_prompt_tokens", None) or self.num_prompt_tokens[slot]
        )
        self.num_cached_tokens[slot] = getattr(delta, "num_cached_tokens", 0) or 0
        self.timers[slot].on_tokens(len(delta.new_token_ids), getattr(delta, "queue_time", None))
        if delta.finish_reason is not None and self.finish_reasons[slot] is None:
            self.finish_reasons[slot] = delta.finish_reason
            self.timers[slot].finish(delta.finish_reason, self.num_prompt_tokens[slot])

    def abort(self) -> None:
        """Abort every unfinished engine request (the client left, or a drain timed out)."""
        for slot, engine_id in enumerate(self.engine_ids):
            if self.finish_reasons[slot] is None:
                try:
                    self.engine.abort(engine_id)
                except Exception:  # an id the engine already forgot is not an error here
                    log.debug("abort of %s failed", engine_id, exc_info=True)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Everything synchronous first: when a client disconnects, this runs inside an
        # already-cancelled scope where any await raises CancelledError at once.
        self.abort()
        for task in self._tasks:
            task.cancel()
        for slot, timer in enumerate(self.timers):
            if self.finish_reasons[slot] is None:
                self.finish_reasons[slot] = "abort"
                timer.finish("abort", self.num_prompt_tokens[slot])
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
