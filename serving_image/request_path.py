"""The one request path every generating endpoint runs, whichever dialect asked.

Chat and completions requests come here as they are; the Messages and Responses APIs first
translate theirs into a chat request (:mod:`anthropic_translate`, :mod:`responses_translate`) and
render what comes back (:mod:`anthropic_stream`, :mod:`responses_stream`): nothing here knows
which dialect asked. The steps: refuse unless ready, check the model name (404), tokenize and
check the engine's limits (400), admit (429 when full), then generate. The engine validates at
submission (``Generation.start``), before any response starts, so its errors are proper 400s;
only a failure after that (the engine loop dying) reaches a client as an error event inside the
stream.

Disconnects: for a non-streamed request a watcher task waits on the ASGI ``http.disconnect``
message; for a stream, Starlette cancels the body iterator when the client goes. Either way the
request's :class:`Generation` is closed, which aborts its engine requests so their KV blocks are
freed within a step, and its admission slots are released.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from kiln.engine.errors import RequestError, RequestFailedError
from kiln.serving.chat import with_template_defaults
from kiln.serving.constraints import compile_constraint, output_constraint
from kiln.serving.dialect_timing import timed_stream, translating
from kiln.serving.errors import (
    APIError,
    engine_dead_error,
    engine_died,
    from_validation_error,
    parse_json_body,
)
from kiln.serving.inputs import chat_inputs, completion_inputs
from kiln.serving.openai_bodies import Builder
from kiln.serving.protocol import ChatCompletionRequest, CompletionRequest, check_supported
from kiln.serving.reasoning import Reasoning, reasoning_parser
from kiln.serving.request_fanout import Generation
from kiln.serving.response_stream import chunks, collect, events
from pydantic import BaseModel, ValidationError

log = logging.getLogger("kiln.serving")

MAX_BODY_BYTES = 16 * 2**20
INLINE_BYTES = 64 * 2**10  # bodies up to this size are parsed and tokenized on the event loop


@dataclass
class Dialect:
    """How a translated request's answer goes back: ``body`` renders the chat completion body, ``stream``
    the chat chunk bodies as the dialect's own SSE events; ``request_id`` is the id its reply carries."""

    request_id: str
    body: Callable[[dict[str, Any]], dict[str, Any]]
    stream: Callable[[AsyncIterator[dict[str, Any]]], AsyncIterator[str]]
    endpoint: str  # its path, the label of kiln:dialect_translation_seconds_total
    request_seconds: float = 0.0  # CPU time its request's translation took (kiln.serving.dialect_timing.costed)


class ClientGone(Exception):
    """The client disconnected before a response started."""


class SSEResponse(StreamingResponse):
    """A text/event-stream response that always runs ``on_close``, however the stream ends."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]],
                 request_id: str) -> None:
        super().__init__(content, media_type="text/event-stream", headers={
            "Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": request_id})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(RuntimeError):  # the iterator may still be running if cancelled mid-step
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self._on_close()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work``; if the client disconnects first, cancel it and raise :class:`ClientGone`."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task in done and not task.cancelled():
        return task.result()
    raise ClientGone


async def parse_request(raw: bytes, model_cls: type[BaseModel], translate: Callable[[Any], Any] | None = None) -> Any:
    """``raw`` validated as ``model_cls`` (then ``translate``d): a 400 naming the field if it is not. A big body
    takes a while to parse: off the event loop (probes and other streams go on)."""
    def parse() -> Any:
        try:
            req = model_cls.model_validate(parse_json_body(raw))
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        return translate(req) if translate is not None else req

    return parse() if len(raw) <= INLINE_BYTES else await asyncio.to_thread(parse)


def validated(cls: type[BaseModel], value: dict[str, Any], param: str) -> Any:
    """``value`` (a part of a body: a block, an item) validated as ``cls``; a 400 naming the field under ``param``."""
    try:
        return cls.model_validate(value)
    except ValidationError as exc:
        err = from_validation_error(exc)
        full = f"{param}.{err.param}" if err.param else param
        message = f"{param}.{err.message}" if err.param and err.message.startswith(err.param) else f"{param}: {err.message}"
        raise APIError(400, message, param=full) from None


def in_terms_of(exc: APIError, names: list[tuple[str, Any]]) -> APIError:
    """``exc`` (raised about the translated chat request) naming the dialect's own fields: the first
    ``(pattern, replacement)`` of ``names`` (a replacement: a string or a function of the match, as
    ``re.sub`` takes) that matches the start of ``param`` rewrites it, and every mention
    of it in the message (``messages`` -> ``input``, ``tools[0].function.parameters`` -> ``tools[0].input_schema``);
    the message's mentions of the other fields are rewritten too (``response_format and tool_choice both
    constrain...``), but for a name that is also a plain word (``messages``), which only the param's own rewrites."""
    matched = None
    for pattern, own in names:
        if exc.param and re.match(pattern, exc.param):
            exc.param, matched = re.sub(pattern, own, exc.param, count=1), pattern
            break
    for pattern, own in names:
        if pattern == matched or re.search(r"[_.\[]", pattern):
            exc.message = re.sub(rf"(?<![\w.])(?:{pattern})(?!\w)", own, exc.message)
    return exc


def resolve_model(ctx: Any, model: str) -> Any:
    """The LoRA adapter ``model`` names (None: the base model); a 404 for a name this server does not serve."""
    lora = ctx.loras.get(model) if model not in ctx.model_names else None  # "model": an adapter's name
    if model not in ctx.model_names and lora is None:
        raise APIError(404, f"The model {model!r} does not exist on this server; it serves "
                       f"{ctx.served_model_name!r} (see GET /v1/models)", param="model", code="model_not_found")
    return lora


async def serving_context(request: Request, model: str | None, why: str) -> Any:
    """The serving context whose engine answers for ``model`` (``state``, ``loras``...), for an endpoint that does
    not generate: this server's own (``model`` may be None; a 404 for a name it does not serve); in an engine
    pool (docs/pools.md) the engine ``model`` names, or the engine of the adapter it names, loaded as a request
    for it would load it (404 naming the pool's models, 503 when it cannot be placed; None: a 400 saying ``why``
    the endpoint needs the engine)."""
    ctx = request.app.state.kiln
    ctx.state.check_accepting()
    if ctx.pool is None:
        if model is not None:
            resolve_model(ctx, model)
        return ctx
    if model is None:
        raise APIError(400, f"this server is an engine pool: name the engine in model (the pool serves "
                       f"{ctx.pool.served_names()}); {why}", param="model")
    serving = await ctx.serving_for(model)
    serving.state.check_accepting()
    return serving


async def _admitted_inputs(ctx: Any, req: Any, kind: str, lora: Any, inline: bool) -> tuple[Any, ...]:
    """(admission, inputs, constraint, plan): slots taken first, so a flood of big bodies is refused before it
    costs anything; then the adapter loaded, the constraint compiled and the prompt tokenized."""
    state = ctx.state
    engine = state.engine
    constraint, plan = output_constraint(req, (state.engine_info or {}).get("tool_call_format", "json"))
    make_inputs = chat_inputs if kind == "chat" else completion_inputs
    admission = counting_rejections(ctx, state.admit, req.num_prompts() * req.n)
    try:
        if lora is not None:  # read into host memory off the event loop if it is not there (docs/lora.md)
            await ctx.loras.ensure_loaded(lora)
        if constraint is not None:  # off the event loop and the engine thread; a 400 if it cannot compile
            await compile_constraint(engine, constraint)
        inputs = (make_inputs(req, engine, constraint, plan) if inline
                  else await asyncio.to_thread(make_inputs, req, engine, constraint, plan))
    except BaseException:
        admission.release()
        raise
    return admission, inputs, constraint, plan


def _translation_counter(ctx: Any, dialect: Dialect | None) -> Any:
    """The dialect's ``kiln:dialect_translation_seconds`` series, its request's translation counted (None: chat)."""
    if dialect is None:
        return None
    counter = ctx.metrics.dialect_seconds.labels(**ctx.metrics.labels, endpoint=dialect.endpoint)
    counter.inc(dialect.request_seconds)
    return counter


def _builder(req: CompletionRequest | ChatCompletionRequest, kind: str, request_id: str, engine: Any) -> Builder:
    """The OpenAI bodies of ``req``'s answer, with the logprobs it asked for."""
    if isinstance(req, ChatCompletionRequest):
        top_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        top_logprobs = req.logprobs
    return Builder(kind, request_id, req.model, engine.tokenizer, top_logprobs, req.prompt_logprobs)


def _reasoning(name: str | None, req: Any, inputs: list, engine: Any, constraint: Any) -> Reasoning | None:
    """How the chat output splits into thinking and answer (``--reasoning-parser``; None: off); a continued final
    message (``continue_final_message``) goes on with the answer."""
    parser = reasoning_parser(name)
    return parser.for_request(inputs[0].prompt_token_ids, engine.tokenizer, constraint,
                              getattr(req, "continue_final_message", False)) if parser else None


async def generate(request: Request, req: CompletionRequest | ChatCompletionRequest, kind: str,
                   dialect: Dialect | None = None, inline: bool = True) -> Response:
    """Run ``req`` (``kind``: "chat" or "completion") and answer it, in ``dialect`` when one translated it."""
    ctx = await request.app.state.kiln.serving_for(req.model)  # this server, or a pool's engine (docs/pools.md)
    state = ctx.state
    lora = resolve_model(ctx, req.model)
    check_supported(req)
    if kind == "chat":
        with_template_defaults(req, ctx.config.default_chat_template_kwargs)
    engine = state.engine
    admission, inputs, constraint, plan = await _admitted_inputs(ctx, req, kind, lora, inline)
    request_id = dialect.request_id if dialect is not None else (
        ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex)
    gen = Generation(engine, ctx.metrics, request_id, inputs, lora)
    state.generations.add(gen)
    reasoning = _reasoning(ctx.config.reasoning_parser if kind == "chat" else None, req, inputs, engine, constraint)
    builder = _builder(req, kind, request_id, engine)

    async def cleanup() -> None:
        await gen.close()
        admission.release()
        state.generations.discard(gen)

    handed_off = False
    translation = _translation_counter(ctx, dialect)
    try:
        gen.start()
        if req.stream:
            options = req.stream_options
            if dialect is not None:  # the dialects report the prompt's usage first and the totals last
                stream = timed_stream(translation, dialect.stream,
                                      chunks(builder, gen, True, False, plan, reasoning, first_usage=True))
            else:
                stream = events(builder, gen, bool(options and options.include_usage),
                                bool(options and options.continuous_usage_stats), plan, reasoning)
            handed_off = True
            return SSEResponse(stream, on_close=cleanup, request_id=request_id)
        body = await _unless_disconnected(request, collect(builder, gen, plan, reasoning))
        if dialect is not None:
            with translating(translation):
                body = dialect.body(body)
        return JSONResponse(body, headers={"X-Request-Id": request_id})
    except RequestError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    except RequestFailedError as exc:  # this request failed alone; the engine serves the others
        raise APIError(500, f"Generation failed: {exc}; the server log has the details",
                       type="server_error") from None
    except ClientGone:
        log.info("client left before %s started; aborted", request_id)
        return Response(status_code=499)
    except Exception as exc:
        if not engine_died(engine):
            raise
        # The group broke mid-request (a rank died): an expected failure, answered as /health says it.
        log.error("%s failed: the engine's step loop failed: %s", request_id, exc)
        raise engine_dead_error() from None
    finally:
        if not handed_off:
            await cleanup()


async def read_body(request: Request, timeout: float) -> bytes:
    """The body, refused with 413 past MAX_BODY_BYTES before it is all in memory, and with 408
    when it takes over ``timeout`` seconds to arrive (a slow sender holds a connection)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large()
    chunks_, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise _too_large()
                chunks_.append(chunk)
    except TimeoutError:
        raise APIError(408, f"The request body did not arrive within {timeout:g}s; send it at once",
                       code="request_timeout", headers={"Connection": "close"}) from None
    return b"".join(chunks_)


def _too_large() -> APIError:
    return APIError(413, f"The request body is over {MAX_BODY_BYTES // 2**20} MiB; send a shorter prompt",
                    code="request_too_large")


def counting_rejections(ctx: Any, check: Callable[..., Any], *args: Any) -> Any:
    try:
        return check(*args)
    except APIError as exc:
        if exc.code in ("queue_full", "draining", "not_ready"):
            ctx.metrics.rejected(exc.code)
        raise
