"""Request and response bodies of the OpenAI API subset kiln serves (pydantic v2).

Requests follow OpenAI's field names plus vLLM's usual sampling extensions
(``top_k``, ``min_p``, ``min_tokens``, ``ignore_eos``, ``repetition_penalty``,
``stop_token_ids``...). Unknown fields are refused (OpenAI answers
"Unrecognized request argument"), so a typo such as ``max_token`` is a 400
naming it instead of a silently ignored limit. Fields OpenAI accepts but kiln
cannot honour (``tools``, ``logit_bias``, JSON ``response_format``, ``suffix``,
``best_of > n``) are refused by :func:`check_supported` with a 400 naming the
field. Responses are built as plain dicts by the handlers; only their shape is
documented here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from kiln.serving.errors import APIError
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

MAX_N = 16
MAX_TOP_LOGPROBS = 20


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: StrictBool = False


class ResponseFormat(_Body):
    type: str
    json_schema: dict[str, Any] | None = None


class _SamplingFields(_Body):
    """Fields both endpoints share."""

    model: str
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    logit_bias: dict[str, float] | None = None
    seed: StrictInt | None = None
    # Accepted and ignored: they change nothing kiln computes.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM-style extensions.
    top_k: StrictInt | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    ignore_eos: StrictBool = False
    repetition_penalty: Annotated[float, Field(gt=0)] = 1.0
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt`` is text, token ids, or a batch of either."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    echo: StrictBool = False
    logprobs: Annotated[StrictInt, Field(ge=0, le=5)] | None = None
    suffix: str | None = None
    best_of: Annotated[StrictInt, Field(ge=1)] | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Clients echo back assistant messages with fields we ignore (refusal, annotations...).
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``, rendered through the tokenizer's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None


def check_supported(req: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuse valid OpenAI fields kiln does not implement, naming each one."""
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported by kiln; remove it", param="logit_bias")
    if req.stop_token_ids and any(t < 0 for t in req.stop_token_ids):
        raise APIError(400, "stop_token_ids must be non-negative token ids", param="stop_token_ids")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if any(not s for s in stops):
        raise APIError(400, "stop strings must be non-empty", param="stop")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise APIError(
                400, "suffix (fill-in-the-middle) is not supported by kiln; remove it", param="suffix"
            )
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of is not supported by kiln; use n instead", param="best_of")
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo together with logprobs (prompt logprobs) is not supported by kiln",
                           param="echo")
        return
    if req.tools or req.functions:
        param = "tools" if req.tools else "functions"
        raise APIError(400, f"{param} (tool calling) is not supported by kiln; remove it", param=param)
    if req.tool_choice not in (None, "none") or req.function_call not in (None, "none"):
        param = "tool_choice" if req.tool_choice not in (None, "none") else "function_call"
        raise APIError(400, f"{param} is not supported by kiln (no tool calling); remove it", param=param)
    if req.response_format is not None and req.response_format.type != "text":
        raise APIError(400, f"response_format type {req.response_format.type!r} is not supported by kiln; "
                       "only 'text' is", param="response_format")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise APIError(400, "set only one of max_tokens and max_completion_tokens", param="max_tokens")
    if req.chat_template_kwargs:
        raise APIError(400, "chat_template_kwargs is not supported by kiln; remove it",
                       param="chat_template_kwargs")
    for i, message in enumerate(req.messages):
        if isinstance(message.content, list):
            for part in message.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(
                        400,
                        f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}})"
                        " are supported by kiln",
                        param=f"messages[{i}].content",
                    )


def message_text(message: ChatMessage) -> str:
    """A message's content as one string (text parts joined with newlines)."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "\n".join(part["text"] for part in message.content)
