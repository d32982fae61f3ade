"""``/v1/prefix_cache``: the engine's prefix-cache keys, for routers that place requests by cache hits.

``GET /v1/prefix_cache`` says how keys are made (scheme, block size, number of blocks);
``POST /v1/prefix_cache/keys`` returns the keys of a prompt (``prompt``: text or token ids)
or a conversation (``messages``, through the chat template as ``/v1/chat/completions``
renders it), exactly as the engine computes them: the blocks it could reuse for that
request, in order. With ``?endpoint=/v1/messages`` or ``?endpoint=/v1/responses`` the body is that
endpoint's own request, as a client sent it (a router forwards it unchanged): translated and rendered
as the endpoint renders it (system, tools, ``instructions``, a stored ``previous_response_id``'s
conversation on this replica), so the keys are the blocks that request would reuse. ``model`` an adapter's name roots them at the adapter version loaded now (its
content digest); ``cache_salt`` salts them as it salts a completion's. In an engine pool (docs/pools.md) ``model``
(the body's; GET's ``?model=NAME``, required there) picks the engine, loaded as a request would load it, and the
keys are rooted at that engine's version (``engine_version`` in the answer), so two engines of one pod never share
keys. A router that tokenizes itself computes the same keys with
:mod:`kiln.engine.prefix_hash` (or the dozen lines of Python in docs/prefix-routing.md).
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Request
from kiln.engine.errors import RequestError
from kiln.engine.limits import check_token_ids
from kiln.engine.prefix_hash import PREFIX_HASH_SCHEME, block_keys
from kiln.engine.sampling_params import MAX_CACHE_SALT_CHARS
from kiln.serving.anthropic_protocol import MessagesRequest
from kiln.serving.anthropic_translate import to_chat as messages_to_chat
from kiln.serving.chat import chat_prompt_ids, render_chat, with_template_defaults
from kiln.serving.errors import APIError, from_validation_error, parse_json_body
from kiln.serving.inputs import vocabulary_size
from kiln.serving.protocol import MAX_MESSAGES, ChatMessage, TemplateKwargs, _Body, check_continuation, check_messages
from kiln.serving.request_path import in_terms_of, parse_request, resolve_model, serving_context
from kiln.serving.responses_protocol import ResponsesRequest
from kiln.serving.responses_translate import to_chat as responses_to_chat
from kiln.serving.routes import _INLINE_BYTES, MESSAGES_NAMES, RESPONSES_NAMES, _store, read_body
from pydantic import Field, StrictBool, StrictInt, ValidationError

router = APIRouter()
WHY = "each engine has its own cache and keys (GET takes it as ?model=NAME)"


class KeysRequest(_Body):
    model: str
    prompt: str | list[Annotated[StrictInt, Field(ge=0)]] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: TemplateKwargs | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None


def _scheme(request: Request, serving: Any) -> dict[str, Any]:
    """How the keys are made; in a pool, also the engine's version they are rooted at (``engine_version``)."""
    engine = serving.state.engine
    stats = engine.stats()
    scheme = {"scheme": PREFIX_HASH_SCHEME, "hash": "sha256", "token_encoding": "uint32-le",
              "block_size": stats.block_size, "num_blocks": stats.num_total_blocks,
              "enabled": bool(engine.engine_config.enable_prefix_caching)}
    if request.app.state.kiln.pool is not None:
        scheme["engine_version"] = serving.version
    return scheme


@router.get("/v1/prefix_cache")
async def prefix_cache(request: Request, model: str | None = None) -> dict[str, Any]:
    return _scheme(request, await serving_context(request, model, WHY))


@router.post("/v1/prefix_cache/keys")
async def prefix_cache_keys(request: Request, endpoint: str | None = None) -> dict[str, Any]:
    ctx = request.app.state.kiln
    ctx.state.check_accepting()
    raw = await read_body(request, ctx.config.body_read_timeout)
    inline = len(raw) <= _INLINE_BYTES  # a big body parses and tokenizes off the event loop, as completions do
    if endpoint is not None:  # a Messages or Responses body, as its endpoint renders it
        req, names = await dialect_request(request, endpoint, raw)
    else:
        req = _parse(raw) if inline else await asyncio.to_thread(_parse, raw)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt (text or token ids) and messages", param="prompt")
    serving = await serving_context(request, req.model, WHY)
    # Read before anything yields to the loop: in a pool, an eviction meanwhile clears serving.state.engine.
    engine, info, scheme = serving.state.engine, serving.state.engine_info, _scheme(request, serving)
    adapter = await _adapter_root(serving, engine, req.model)
    defaults = serving.config.default_chat_template_kwargs
    if endpoint is not None:
        ids = await dialect_ids(engine, info, req, names, inline, defaults)
    else:
        if req.messages is not None:  # rendered as chat: with the server's template variables
            with_template_defaults(req, defaults)
        ids = _prompt_ids(req, engine) if inline else await asyncio.to_thread(_prompt_ids, req, engine)
    size = scheme["block_size"]
    keys = block_keys(ids, size, limit=max(0, len(ids) - 1) // size, adapter=adapter,  # last token: computed
                      cache_salt=req.cache_salt, engine=scheme.get("engine_version"))
    return {**scheme, "num_prompt_tokens": len(ids), "keys": [k.hex() for k in keys]}


async def dialect_request(request: Request, endpoint: str, raw: bytes) -> tuple[Any, list[tuple[str, str]]]:
    """(the chat request, the dialect's field names) for ``raw``, a body of ``endpoint`` (``/v1/messages``,
    ``/v1/responses``), translated as that endpoint does; errors name the dialect's own fields."""
    if endpoint == "/v1/messages":
        model, names, translate = MessagesRequest, MESSAGES_NAMES, messages_to_chat
    elif endpoint == "/v1/responses":
        store = _store(request)  # previous_response_id: the conversation this replica stored
        model, names, translate = ResponsesRequest, RESPONSES_NAMES, lambda r: responses_to_chat(r, store).chat
    else:
        raise APIError(400, f"endpoint {endpoint!r} is not one whose body this takes: give /v1/messages or "
                       "/v1/responses with that endpoint's body, or no endpoint with a prompt or messages",
                       param="endpoint")
    try:
        return await parse_request(raw, model, translate), names
    except APIError as exc:
        raise in_terms_of(exc, names) from None


async def dialect_ids(engine: Any, info: dict[str, Any] | None, chat: Any, names: list[tuple[str, str]],
                      inline: bool, defaults: dict[str, Any] | None) -> list[int]:
    """The prompt's ids of ``chat`` (a translated dialect request), rendered as its endpoint renders it on
    ``engine`` (whose ``engine_info`` is ``info``; ``defaults``: the server's template variables); errors name
    the dialect's own fields."""
    args = (chat, engine.tokenizer, info, defaults)
    try:
        return chat_prompt_ids(*args) if inline else await asyncio.to_thread(chat_prompt_ids, *args)
    except APIError as exc:
        raise in_terms_of(exc, names) from None


async def _adapter_root(ctx: Any, engine: Any, model: str) -> str | None:
    """The keys' root for ``model``: None for the base model; an adapter's keys are its own, rooted at the content
    digest of the version loaded now. A 404 for a model this server (this engine of a pool) does not serve."""
    lora = resolve_model(ctx, model)
    if lora is None:
        return None
    await ctx.loras.ensure_loaded(lora)
    adapter = engine.lora_digest(model)
    if adapter is None:
        raise APIError(503, f"the LoRA adapter {model!r} was unloaded meanwhile; retry", param="model",
                       code="lora_unavailable", headers={"Retry-After": "1"})
    return adapter


def _parse(raw: bytes) -> KeysRequest:
    try:
        return KeysRequest.model_validate(parse_json_body(raw))
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _prompt_ids(req: KeysRequest, engine: Any) -> list[int]:
    if req.messages is not None:
        check_messages(req.messages)
        check_continuation(req.add_generation_prompt, req.continue_final_message, req.messages)
        return render_chat(req, engine.tokenizer)  # type: ignore[arg-type]
    if isinstance(req.prompt, str):
        return engine.tokenizer.encode(req.prompt) if req.prompt else []
    ids = list(req.prompt or [])
    try:  # an id past the vocabulary is refused as completions refuses it (and would not pack into a key)
        check_token_ids(ids, vocabulary_size(engine))
    except RequestError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    return ids
