"""AsyncLLM: the engine's step loop in a background thread, one async stream per request.

The loop thread owns the ``LLMEngine``; the event loop only validates requests
(synchronously, so a bad request raises in the caller) and posts commands
(add, abort) to a queue the thread drains before every step. Each step's
tokens are handed back to the event loop with ``call_soon_threadsafe``. Torch
releases the GIL inside its kernels, so the event loop stays responsive while
a step runs.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from kiln.engine.config import EngineConfig
from kiln.engine.errors import RequestError, RequestFailedError
from kiln.engine.llm_engine import LLMEngine, StepUpdate
from kiln.engine.lora.request import LoRARequest
from kiln.engine.outputs import EngineStats, StreamDelta
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.sequence import Request
from kiln.engine.thread_governor import ThreadGovernor


class EngineDeadError(RuntimeError):
    """The step loop failed; every open stream gets this error."""


class AsyncLLM:
    def __init__(self, model: str | Path | None = None, *, engine_config: EngineConfig | None = None,
                 **kwargs: Any) -> None:
        if engine_config is None:
            if model is None:
                raise TypeError("AsyncLLM() needs a model directory")
            engine_config = EngineConfig(model=str(model), **kwargs)
        self.engine_config = engine_config
        self.engine = LLMEngine(engine_config)
        self.tokenizer = self.engine.tokenizer
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._wakeup = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._error: BaseException | None = None

    @classmethod
    def from_artifact(cls, artifact_dir: str | Path, **overrides: Any) -> AsyncLLM:
        from kiln.engine.artifact import artifact_engine_config

        return cls(engine_config=artifact_engine_config(artifact_dir, **overrides))

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kiln-engine-loop", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
            self._settle_leftovers()  # queued between the loop's last look and the join
        for rid in list(self._streams):
            self._end_stream(rid, "abort")
        self.engine.shutdown()

    async def __aenter__(self) -> AsyncLLM:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    @property
    def thread_governor(self) -> ThreadGovernor | None:
        """The engine's thread governor (``EngineConfig.thread_governor``), a between-steps hook; or None."""
        return self.engine.between_steps.find(ThreadGovernor)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._error is None

    # -- requests ---------------------------------------------------------------------------
    def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                 request_id: str | None = None, lora_request: LoRARequest | None = None) -> AsyncIterator[StreamDelta]:
        """Validate and queue at once (RequestError raises here); iterate the result for deltas. An adapter not
        in host memory is read here: a server loads it first (``await add_lora``) to keep its loop free."""
        if self._thread is None or self._loop is None:
            raise RuntimeError("AsyncLLM is not started: await engine.start() or use `async with`")
        if self._error is not None:
            raise EngineDeadError(f"the engine loop failed: {self._error!r}")
        if request_id is not None and request_id in self._streams:
            raise RequestError("request_id", f"request_id {request_id!r} is already in use")
        req = self.engine.make_request(prompt, params, request_id, lora_request)
        if req.request_id in self._streams:
            raise RequestError("request_id", f"request_id {req.request_id!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[req.request_id] = stream
        self._commands.put(("add", req))
        self._wakeup.set()
        return self._iterate(req.request_id, stream)

    async def _iterate(self, request_id: str, stream: asyncio.Queue) -> AsyncIterator[StreamDelta]:
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    finished = True
                    return
        finally:
            if not finished:  # the consumer went away: stop spending compute on it
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed before the next step and its stream ends with "abort"."""
        self._commands.put(("abort", request_id))
        self._wakeup.set()

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter into host memory in a worker thread (the event loop and the steps go on)."""
        return await asyncio.to_thread(self.engine.add_lora, lora_request)

    async def remove_lora(self, name: str) -> bool:
        """Unload an adapter on the step thread, between steps, resident in host memory or not; returns once
        its prefix blocks are dropped and its idle slots emptied (False: nothing was loaded under ``name``)."""
        if self._error is not None:
            raise EngineDeadError(f"the engine loop failed: {self._error!r}")
        if self._thread is None:  # not started: no step runs, so this thread may change the engine
            return self.engine.remove_lora(name)
        done = asyncio.get_running_loop().create_future()
        self._commands.put(("remove_lora", (name, done)))
        self._wakeup.set()
        return await done

    def list_loras(self) -> list[str]:
        return self.engine.list_loras()

    def lora_digest(self, name: str) -> str | None:
        return self.engine.lora_digest(name)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    # -- the loop thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_commands()
                if not self.engine.has_unfinished():
                    self.engine.check_ranks()  # a lost rank fails the loop even while idle (/health)
                    self.engine.between_steps.idle()
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                for update in self.engine.step():  # the between-steps hooks run around it
                    self._publish(update)
        except BaseException as e:  # noqa: BLE001 - every stream must learn the loop died
            self._error = e
            err = EngineDeadError(f"the engine loop failed: {e!r}")
            for rid in list(self._streams):
                self._post(rid, err)
        finally:
            for req in list(self.engine.requests.values()):
                self.engine.abort(req.request_id)
            self._settle_leftovers()

    def _queued(self) -> Iterator[tuple[str, Any]]:
        """The commands queued so far, each taken once."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _drain_commands(self) -> None:
        for kind, arg in self._queued():
            if kind == "add":
                self.engine.add(arg)
            elif kind == "remove_lora":
                name, done = arg
                self._settle(done, self.engine.remove_lora, name)
            elif kind == "abort":
                req = self.engine.abort(arg)
                if req is not None:  # with no token streamed yet, this is the request's first delta
                    queue_time = req.queue_time if req.first_token_time is None else None
                    self._post(arg, self._delta(req, [], req.abort_text, None, "abort", queue_time))

    def _settle_leftovers(self) -> None:
        """Commands the stopped loop will never take: an adapter's removal still runs (no step runs now) and its
        caller gets the answer (a pool unloads an engine while its adapter follower removes one of its adapters:
        that caller waited for good); requests and aborts need nothing, every stream is ended."""
        for kind, arg in self._queued():
            if kind == "remove_lora":
                name, done = arg
                self._settle(done, self.engine.remove_lora, name)

    def _settle(self, done: asyncio.Future, fn: Any, *args: Any) -> None:
        """Run ``fn`` here (the step thread) and hand its result or error to ``done`` on the event loop."""
        try:
            result: Any = fn(*args)
            setter = done.set_result
        except Exception as exc:  # noqa: BLE001 - the awaiting caller gets it
            result, setter = exc, done.set_exception
        assert self._loop is not None
        self._loop.call_soon_threadsafe(lambda: done.done() or setter(result))

    def _publish(self, u: StepUpdate) -> None:
        if u.error is not None:
            self._post(u.request.request_id, RequestFailedError(u.error))
            return
        reason = u.request.finish_reason if u.finished else None
        self._post(u.request.request_id,
                   self._delta(u.request, u.new_token_ids, u.text_delta, u.logprobs, reason, u.queue_time))

    @staticmethod
    def _delta(req: Request, ids: list[int], text: str, logprobs, reason: str | None,
               queue_time: float | None = None) -> StreamDelta:
        return StreamDelta(req.request_id, ids, text, reason, logprobs, req.num_prompt_tokens,
                           req.num_output_tokens, req.num_cached_tokens, queue_time,
                           *((req.prompt_logprobs, req.prompt_ranks) if queue_time is not None else (None, None)))

    def _post(self, request_id: str, item: StreamDelta | BaseException) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._deliver, request_id, item)

    def _deliver(self, request_id: str, item: StreamDelta | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        stream.put_nowait(item)
        if isinstance(item, BaseException) or item.finish_reason is not None:
            del self._streams[request_id]

    def _end_stream(self, request_id: str, reason: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put_nowait(StreamDelta(request_id, [], "", reason, None, 0, 0, 0))
