"""``/v1/prefix_cache``: the engine's prefix-cache keys, for routers that place requests by cache hits.

``GET /v1/prefix_cache`` says how keys are made (scheme, block size, pool size);
``POST /v1/prefix_cache/keys`` returns the keys of a prompt (``prompt``: text or token ids)
or a conversation (``messages``, through the chat template as ``/v1/chat/completions``
renders it), exactly as the engine computes them: the blocks it could reuse for that
request, in order. ``model`` an adapter's name roots them at the adapter version loaded now (its
content digest); ``cache_salt`` salts them as it salts a completion's. A router that tokenizes itself computes the same keys with
:mod:`kiln.engine.prefix_hash` (or the ten lines in docs/prefix-routing.md).
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Request
from kiln.engine.prefix_hash import PREFIX_HASH_SCHEME, block_keys
from kiln.engine.sampling_params import MAX_CACHE_SALT_CHARS
from kiln.serving.errors import APIError, from_validation_error, parse_json_body
from kiln.serving.inputs import render_chat
from kiln.serving.protocol import MAX_MESSAGES, ChatMessage, _Body, check_messages
from kiln.serving.routes import _INLINE_BYTES, read_body
from pydantic import Field, StrictBool, StrictInt, ValidationError

router = APIRouter()


class KeysRequest(_Body):
    model: str
    prompt: str | list[Annotated[StrictInt, Field(ge=0)]] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_generation_prompt: StrictBool = True
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None


def _engine(request: Request) -> Any:
    state = request.app.state.kiln.state
    state.check_accepting()
    return state.engine


def _scheme(engine: Any) -> dict[str, Any]:
    stats = engine.stats()
    return {"scheme": PREFIX_HASH_SCHEME, "hash": "sha256", "token_encoding": "uint32-le",
            "block_size": stats.block_size, "num_blocks": stats.num_total_blocks,
            "enabled": bool(engine.engine_config.enable_prefix_caching)}


@router.get("/v1/prefix_cache")
async def prefix_cache(request: Request) -> dict[str, Any]:
    return _scheme(_engine(request))


@router.post("/v1/prefix_cache/keys")
async def prefix_cache_keys(request: Request) -> dict[str, Any]:
    ctx = request.app.state.kiln
    engine = _engine(request)
    raw = await read_body(request, ctx.config.body_read_timeout)
    inline = len(raw) <= _INLINE_BYTES  # a big body parses and tokenizes off the event loop, as completions do
    req = _parse(raw) if inline else await asyncio.to_thread(_parse, raw)
    lora = ctx.loras.get(req.model) if req.model not in ctx.model_names else None
    if req.model not in ctx.model_names and lora is None:
        raise APIError(404, f"The model {req.model!r} does not exist on this server; it serves "
                       f"{ctx.served_model_name!r}", param="model", code="model_not_found")
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt (text or token ids) and messages", param="prompt")
    adapter = None  # an adapter's keys are its own: rooted at the content digest of the version loaded now
    if lora is not None:
        await ctx.loras.ensure_loaded(lora)
        adapter = engine.lora_digest(req.model)
        if adapter is None:
            raise APIError(503, f"the LoRA adapter {req.model!r} was unloaded meanwhile; retry", param="model",
                           code="lora_unavailable", headers={"Retry-After": "1"})
    ids = _prompt_ids(req, engine) if inline else await asyncio.to_thread(_prompt_ids, req, engine)
    scheme = _scheme(engine)
    size = scheme["block_size"]
    keys = block_keys(ids, size, limit=max(0, len(ids) - 1) // size, adapter=adapter,  # last token: computed
                      cache_salt=req.cache_salt)
    return {**scheme, "num_prompt_tokens": len(ids), "keys": [k.hex() for k in keys]}


def _parse(raw: bytes) -> KeysRequest:
    try:
        return KeysRequest.model_validate(parse_json_body(raw))
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _prompt_ids(req: KeysRequest, engine: Any) -> list[int]:
    if req.messages is not None:
        check_messages(req.messages)
        return render_chat(req, engine.tokenizer)  # type: ignore[arg-type]
    if isinstance(req.prompt, str):
        return engine.tokenizer.encode(req.prompt) if req.prompt else []
    return list(req.prompt or [])
