"""Request and response bodies of the OpenAI API subset kiln serves (pydantic v2).

Requests follow OpenAI's field names plus vLLM's usual sampling extensions
(``top_k``, ``min_p``, ``min_tokens``, ``ignore_eos``, ``repetition_penalty``,
``stop_token_ids``...). Unknown fields are refused (OpenAI answers
"Unrecognized request argument"), so a typo such as ``max_token`` is a 400
naming it instead of a silently ignored limit. Every count and length a client
controls is bounded here (the limits below and the engine's in
``kiln.engine.sampling_params``; docs/serving-limits.md lists them), and
prompts x n is checked as the body is parsed, before anything is tokenized.
Token ids are checked against the model's vocabulary by the engine when the
request is submitted, still before anything runs. Fields OpenAI accepts but
kiln cannot honour (``suffix``, ``best_of > n``, the deprecated ``functions``)
are refused by :func:`check_supported` with a 400 naming the field. Constrained
output (``response_format``, ``structured_outputs``, ``tools``) is
:mod:`kiln.serving.constraints`. Responses are built as plain dicts by the handlers; only their shape is
documented here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from kiln.engine.sampling_params import (
    LOGIT_BIAS_RANGE,
    MAX_CACHE_SALT_CHARS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SEED_MAX,
    SEED_MIN,
)
from kiln.serving.errors import APIError
from kiln.serving.formats import MAX_TOOLS, GuidedFields, Tool, ToolCall, ToolChoice
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictInt, model_validator

from kiln.chat_options import MAX_TEMPLATE_KWARGS, TEMPLATE_VARIABLE_PATTERN

# Server limits on one request (the engine's own per-request limits come from
# sampling_params). Each bounds work done before admission or per token.
MAX_N = 16
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions `logprobs`
MAX_PROMPTS = 64  # prompts in one /v1/completions batch
MAX_CHOICES = 64  # prompts x n: engine requests one HTTP request may start
MAX_MESSAGES = 2048
MAX_ALLOWED_TOKEN_IDS = 1 << 17  # a whole vocabulary of the largest common models

TemplateVariable = Annotated[str, Field(pattern=TEMPLATE_VARIABLE_PATTERN)]
TemplateKwargs = Annotated[dict[TemplateVariable, Any], Field(max_length=MAX_TEMPLATE_KWARGS)]
# OpenAI's reasoning efforts (Anthropic's are among them): the chat template's reasoning_effort (kiln.serving.chat).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]

TokenId = Annotated[StrictInt, Field(ge=0)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: usage on every chunk (with include_usage)


class _SamplingFields(GuidedFields):
    """Fields both endpoints share (constrained output: :class:`GuidedFields`)."""

    model: str
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    logit_bias: Annotated[
        dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")],
             Annotated[float, Field(ge=-LOGIT_BIAS_RANGE, le=LOGIT_BIAS_RANGE)]],
        Field(max_length=MAX_LOGIT_BIAS),
    ] | None = None
    seed: Annotated[StrictInt, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    # Accepted and ignored: they change nothing kiln computes.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM-style extensions.
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    ignore_eos: StrictBool = False
    repetition_penalty: Annotated[float, Field(gt=0, le=100)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    # vLLM's: each prompt token's logprob, rank and the k most likely there (not with stream, as vLLM).
    prompt_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # vLLM's: salts the prefix cache, so only requests with the same salt (a tenant's) share cached blocks.
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None

    def num_prompts(self) -> int:
        return 1

    @model_validator(mode="after")
    def _bounded_choices(self) -> _SamplingFields:
        """prompts x n, checked right after parsing, before anything is tokenized."""
        if self.num_prompts() * self.n > MAX_CHOICES:  # an APIError passes through pydantic unchanged
            raise APIError(400, f"{self.num_prompts()} prompts x n={self.n} asks for "
                           f"{self.num_prompts() * self.n} generations; this server allows at most "
                           f"{MAX_CHOICES} per request: lower n or split the prompts over several requests",
                           param="n", code="too_many_choices")
        return self


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt`` is text, token ids, or a batch of either."""

    prompt: (str | list[StrictInt] | Annotated[list[str], Field(max_length=MAX_PROMPTS)]
             | Annotated[list[list[StrictInt]], Field(max_length=MAX_PROMPTS)])
    echo: StrictBool = False
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    suffix: str | None = None
    best_of: Annotated[StrictInt, Field(ge=1)] | None = None

    def num_prompts(self) -> int:
        """How many prompts ``prompt`` holds (a list of ids is one prompt)."""
        if isinstance(self.prompt, str) or not self.prompt or isinstance(self.prompt[0], int):
            return 1
        return len(self.prompt)


class ChatMessage(BaseModel):
    # Clients echo back assistant messages with fields we ignore (refusal, annotations...).
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    # An assistant turn's thinking, as a reasoning parser returned it (vLLM reads `reasoning`, older clients echo
    # `reasoning_content`): templates that show the current turn's thinking (Qwen3's, in a tool loop) read it.
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``, rendered through the tokenizer's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    # vLLM's (and transformers'): the reply continues the final (assistant) message, rendered without its end of turn.
    continue_final_message: StrictBool = False
    # vLLM's: more variables for the chat template ({"enable_thinking": false}); kiln.serving.chat renders them.
    chat_template_kwargs: TemplateKwargs | None = None
    reasoning_effort: ReasoningEffort | None = None  # OpenAI's: the template's reasoning_effort (gpt-oss reads it)
    # Not a field: set for a Responses request with truncation "auto" (kiln.serving.truncation drops old turns).
    _truncate_middle: bool = PrivateAttr(default=False)


def check_supported(req: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuse valid OpenAI fields kiln does not implement, naming each one."""
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(400, "prompt_logprobs are not available with stream: true (as on vLLM); send stream: false, "
                       "or echo with logprobs on /v1/completions, which streams them", param="prompt_logprobs")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise APIError(
                400, "suffix (fill-in-the-middle) is not supported by kiln; remove it", param="suffix"
            )
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of is not supported by kiln; use n instead", param="best_of")
        return
    if req.functions or req.function_call is not None:
        param = "functions" if req.functions else "function_call"
        raise APIError(400, f"{param} is OpenAI's deprecated form of tool calling; send tools and "
                       "tool_choice instead", param=param)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise APIError(400, "set only one of max_tokens and max_completion_tokens", param="max_tokens")
    check_messages(req.messages)
    check_continuation(req.add_generation_prompt, req.continue_final_message, req.messages)


def check_continuation(add_generation_prompt: bool, continue_final_message: bool, messages: list[ChatMessage]) -> None:
    """vLLM's rule: a reply continues the final message, or opens a new turn, not both; and continues only text."""
    if not continue_final_message:
        return
    if add_generation_prompt:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true: the reply either "
                       "continues the final message or opens a new turn; set add_generation_prompt: false",
                       param="continue_final_message")
    if not message_text(messages[-1]).strip():
        raise APIError(400, f"continue_final_message: messages[{len(messages) - 1}] has no text to continue; "
                       "end the conversation with the text the reply should continue", param="continue_final_message")


def check_messages(messages: list[ChatMessage]) -> None:
    """Refuse message content kiln cannot render: only text parts ({'type': 'text', 'text': ...})."""
    for i, message in enumerate(messages):
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
