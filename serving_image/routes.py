"""The generating endpoints, in three dialects over one request path (:mod:`request_path`).

- OpenAI's ``POST /v1/completions`` and ``POST /v1/chat/completions``, as they are;
- Anthropic's ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (:mod:`anthropic_translate`,
  :mod:`anthropic_stream`; errors in Anthropic's shape, :mod:`anthropic_errors`);
- OpenAI's ``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}`` and ``GET .../{id}/input_items``
  (:mod:`responses_translate`, :mod:`responses_stream`, the store :mod:`responses_store`).

Each handler reads the body (bounded in size and time), parses its dialect, translates it into the chat
request kiln runs, and hands that to :func:`request_path.generate` with the dialect's renderers. The
requests each endpoint receives are counted on ``/metrics`` (``kiln:endpoint_requests_total``).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request, Response
from kiln.serving.anthropic_errors import AnthropicRoute
from kiln.serving.anthropic_protocol import CountTokensRequest, MessagesRequest
from kiln.serving.anthropic_stream import message_events
from kiln.serving.anthropic_translate import to_chat as messages_to_chat
from kiln.serving.anthropic_translate import to_message
from kiln.serving.chat import chat_prompt_ids
from kiln.serving.dialect_timing import costed
from kiln.serving.errors import APIError
from kiln.serving.protocol import ChatCompletionRequest, CompletionRequest
from kiln.serving.request_path import (
    INLINE_BYTES,
    MAX_BODY_BYTES,
    Dialect,
    counting_rejections,
    generate,
    in_terms_of,
    parse_request,
    read_body,
    resolve_model,
)
from kiln.serving.responses_protocol import InputTokensRequest, ResponsesRequest
from kiln.serving.responses_store import ResponseStore, page_of
from kiln.serving.responses_stream import response_events
from kiln.serving.responses_translate import assistant_turn, input_items, not_stored, source_names, to_response
from kiln.serving.responses_translate import to_chat as responses_to_chat

__all__ = ["MAX_BODY_BYTES", "read_body", "router"]
_INLINE_BYTES = INLINE_BYTES  # prefix.py's name for it

# What a refusal of the translated chat request names, in each dialect's own fields.
_TOOL_CHOICE = (r"tool_choice\.function\.name", "tool_choice.name")
MESSAGES_NAMES = [(r"response_format(\.json_schema)?", "output_config.format"),
                  (r"tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"), _TOOL_CHOICE]
RESPONSES_NAMES = [(r"messages", "input"), (r"max_tokens", "max_output_tokens"),
                   (r"response_format(\.json_schema)?", "text.format"),
                   (r"tools\[(\d+)\]\.function\.parameters", r"tools[\1].parameters"), _TOOL_CHOICE]

router = APIRouter()
messages_router = APIRouter(route_class=AnthropicRoute)
responses_router = APIRouter()


async def _body(request: Request, endpoint: str) -> bytes:
    """The raw body of a generating request, once the server takes requests (counted by endpoint)."""
    ctx = request.app.state.kiln
    ctx.metrics.received(endpoint)
    counting_rejections(ctx, ctx.state.check_accepting)
    return await read_body(request, ctx.config.body_read_timeout)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    raw = await _body(request, "/v1/completions")
    req = await parse_request(raw, CompletionRequest)
    return await generate(request, req, "completion", inline=len(raw) <= INLINE_BYTES)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    raw = await _body(request, "/v1/chat/completions")
    req = await parse_request(raw, ChatCompletionRequest)
    return await generate(request, req, "chat", inline=len(raw) <= INLINE_BYTES)


@messages_router.post("/v1/messages")
async def messages(request: Request) -> Response:
    raw = await _body(request, "/v1/messages")
    try:
        spent = [0.0]
        req, chat = await parse_request(raw, MessagesRequest, costed(spent, lambda r: (r, messages_to_chat(r))))
        message_id = "msg_" + uuid.uuid4().hex
        stops = req.stop_sequences
        dialect = Dialect(message_id, lambda body: to_message(body, message_id, stops),
                          lambda chunks: message_events(chunks, message_id, req.model, stops), "/v1/messages", spent[0])
        return await generate(request, chat, "chat", dialect, inline=len(raw) <= INLINE_BYTES)
    except APIError as exc:
        raise in_terms_of(exc, MESSAGES_NAMES) from None


@messages_router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict[str, Any]:
    """The prompt's tokens as ``/v1/messages`` would render it (system, tools and all)."""
    raw = await _body(request, "/v1/messages/count_tokens")
    return {"input_tokens": await _prompt_tokens(request, raw, CountTokensRequest, messages_to_chat, MESSAGES_NAMES)}


async def _prompt_tokens(request: Request, raw: bytes, model: Any, to_chat: Any, names: list[tuple[str, str]]) -> int:
    """How many tokens the prompt of ``raw`` (a ``model`` body, ``to_chat`` translating it) would hold on the engine
    its model names; errors in the dialect's ``names``."""
    try:
        chat = await parse_request(raw, model, to_chat)
        ctx = await request.app.state.kiln.serving_for(chat.model)  # this server, or a pool's engine
        resolve_model(ctx, chat.model)
    except APIError as exc:
        raise in_terms_of(exc, names) from None
    state, defaults = ctx.state, ctx.config.default_chat_template_kwargs
    return len(chat_prompt_ids(chat, state.engine.tokenizer, state.engine_info, defaults))


def _store(request: Request) -> ResponseStore:
    """This process's stored responses (made on first use, sized by ``--responses-store-size/-ttl``)."""
    app_state = request.app.state
    store = getattr(app_state, "responses_store", None)
    if store is None:
        config = app_state.kiln.config
        store = app_state.responses_store = ResponseStore(config.responses_store_size, config.responses_store_ttl)
    return store


@responses_router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    raw = await _body(request, "/v1/responses")
    store = _store(request)
    run = None
    try:
        spent = [0.0]
        req, run = await parse_request(raw, ResponsesRequest, costed(spent, lambda r: (r, responses_to_chat(r, store))))
        dialect = await _responses_dialect(request, req, run, store)
        dialect.request_seconds = spent[0]
        return await generate(request, run.chat, "chat", dialect, inline=len(raw) <= INLINE_BYTES)
    except APIError as exc:  # messages[i] named as the field it came from (source_names), then the rest
        raise in_terms_of(exc, [*source_names(run.sources if run else []), *RESPONSES_NAMES]) from None


async def _responses_dialect(request: Request, req: ResponsesRequest, run: Any, store: ResponseStore) -> Dialect:
    """How a Response goes back, and into the store (``store: true``) with the conversation it ends."""
    response_id, created = "resp_" + uuid.uuid4().hex, int(time.time())
    tokenizer = (await request.app.state.kiln.serving_for(run.chat.model)).state.engine.tokenizer

    def keep(body: dict[str, Any], message: dict[str, Any] | None) -> None:
        """Store the Response; a failed one (``message`` None) with its input only, so a follow-up retries it."""
        if req.store:
            store.put(response_id, body, [*run.conversation, *([assistant_turn(message)] if message else [])],
                      input_items(req))

    def whole(chat: dict[str, Any]) -> dict[str, Any]:
        body = to_response(req, response_id, chat, tokenizer)
        keep(body, chat["choices"][0]["message"])
        return body

    return Dialect(response_id, whole,
                   lambda chunks: response_events(chunks, req, response_id, created, keep, tokenizer), "/v1/responses")


@responses_router.post("/v1/responses/input_tokens")
async def count_input_tokens(request: Request) -> dict[str, Any]:
    """The prompt's tokens as ``POST /v1/responses`` would render it (instructions, the stored conversation a
    ``previous_response_id`` continues, tools and all)."""
    raw = await _body(request, "/v1/responses/input_tokens")
    count = await _prompt_tokens(request, raw, InputTokensRequest, lambda r: responses_to_chat(r, _store(request)).chat,
                                 RESPONSES_NAMES)
    return {"object": "response.input_tokens", "input_tokens": count}


@responses_router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> dict[str, Any]:
    if request.query_params.get("stream", "false").lower() not in ("false", "0"):
        raise APIError(400, "stream: a stored response is returned whole here (its events are not replayed); "
                       "GET it without stream=true", param="stream")
    stored = _store(request).get(response_id)
    if stored is None:
        raise not_stored(response_id, "response_id")
    return stored.response


@responses_router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request) -> dict[str, Any]:
    """The stored response's input items (the SDK's ``responses.input_items.list``), newest first unless
    ``order=asc``; ``include`` adds nothing here (no item of a text model's input carries what it names)."""
    stored = _store(request).get(response_id)
    if stored is None:
        raise not_stored(response_id, "response_id")
    return page_of(stored.input_items, request.query_params)


@responses_router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    if not _store(request).delete(response_id):
        raise not_stored(response_id, "response_id")
    return {"id": response_id, "object": "response", "deleted": True}


router.include_router(messages_router)
router.include_router(responses_router)
