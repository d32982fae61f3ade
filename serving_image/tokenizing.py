"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: text or a conversation as the served model's token ids,
and ids back as text, without generating (what clients use to count, truncate and budget a prompt).

``/tokenize`` takes ``prompt`` (``add_special_tokens``, default true: what the model's encoding adds, such as
its BOS, as ``/v1/completions`` encodes a prompt) or ``messages``, rendered exactly as
``/v1/chat/completions`` renders them (``add_generation_prompt``, ``tools``, ``chat_template_kwargs`` over the
server's defaults; the template writes the special tokens, so ``add_special_tokens`` may only be false there).
It answers ``{"count", "max_model_len", "tokens"}`` and, with ``return_token_strs``, ``token_strs``.
``/detokenize`` takes ``tokens`` (each in the model's vocabulary) and answers ``{"prompt"}``. ``model`` may be
left out on a single-engine server (a 404 when it names another); an engine pool needs it, since each of its
engines has its own tokenizer. The API key protects both, as it does ``/v1/*``; a big body is tokenized off
the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Request
from kiln.serving.chat import chat_prompt_ids
from kiln.serving.errors import APIError, from_validation_error, parse_json_body
from kiln.serving.formats import MAX_TOOLS, Tool
from kiln.serving.inputs import vocabulary_size
from kiln.serving.protocol import (
    MAX_MESSAGES,
    ChatCompletionRequest,
    ChatMessage,
    TemplateKwargs,
    _Body,
)
from kiln.serving.request_path import INLINE_BYTES, read_body, serving_context
from pydantic import Field, StrictBool, StrictInt, ValidationError

router = APIRouter()
WHY = "each engine has its own tokenizer"


class TokenizeCompletionRequest(_Body):
    model: str | None = None
    prompt: str
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(_Body):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    chat_template_kwargs: TemplateKwargs | None = None
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0)]]


def _parse(raw: bytes, cls: Any = None) -> Any:
    body = parse_json_body(raw)
    if cls is None:
        cls = TokenizeChatRequest if isinstance(body, dict) and "messages" in body else TokenizeCompletionRequest
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


async def _request(request: Request, cls: Any = None) -> tuple[Any, Any, bool]:
    """(the parsed body, the serving context of its model, whether it is small enough to handle inline)."""
    ctx = request.app.state.kiln
    ctx.state.check_accepting()
    raw = await read_body(request, ctx.config.body_read_timeout)
    inline = len(raw) <= INLINE_BYTES
    req = _parse(raw, cls) if inline else await asyncio.to_thread(_parse, raw, cls)
    return req, await serving_context(request, req.model, WHY), inline


def _chat_ids(req: TokenizeChatRequest, serving: Any, tokenizer: Any) -> list[int]:
    if req.add_special_tokens:
        raise APIError(400, "add_special_tokens: the chat template writes the special tokens of a conversation; "
                       "leave it out (false) with messages", param="add_special_tokens")
    chat = ChatCompletionRequest.model_construct(
        model=req.model or "", messages=req.messages, tools=req.tools, add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        chat_template_kwargs=req.chat_template_kwargs)  # each field validated already, as the request's
    return chat_prompt_ids(chat, tokenizer, serving.state.engine_info, serving.config.default_chat_template_kwargs)


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    req, serving, inline = await _request(request)
    engine = serving.state.engine  # read before anything yields: in a pool an eviction clears it

    def ids_of() -> list[int]:
        if isinstance(req, TokenizeChatRequest):
            return _chat_ids(req, serving, engine.tokenizer)
        return engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)

    ids = ids_of() if inline else await asyncio.to_thread(ids_of)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": engine.engine_config.max_seq_len, "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = engine.tokenizer.convert_ids_to_tokens(ids)
    return out


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    req, serving, inline = await _request(request, DetokenizeRequest)
    engine = serving.state.engine
    vocab = vocabulary_size(engine)
    bad = next((i for i, t in enumerate(req.tokens) if t >= vocab), None)
    if bad is not None:
        raise APIError(400, f"tokens[{bad}] = {req.tokens[bad]} is not in the model's vocabulary "
                       f"(ids 0-{vocab - 1})", param=f"tokens[{bad}]")
    decode = engine.tokenizer.decode
    return {"prompt": decode(req.tokens) if inline else await asyncio.to_thread(decode, req.tokens)}
