"""Request bodies of OpenAI's Responses API (``POST /v1/responses``), pydantic v2.

Field names and shapes are OpenAI's. ``input`` items are read by type in :mod:`responses_translate`
(``ITEMS``), so that an error names the item's own field (``input[2].call_id``). Fields OpenAI takes
that change nothing kiln computes (``metadata``, ``user``, ``service_tier``, ``reasoning.summary``...)
are accepted and ignored; ones kiln cannot honour (``background: true``, hosted tools, images) are a 400
naming them. Unknown fields are refused, as on the other endpoints.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from kiln.serving.formats import MAX_TOOLS, JSONSchemaFormat, Name
from kiln.serving.protocol import MAX_LOGPROBS, MAX_MESSAGES, ReasoningEffort
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

MAX_PARTS = 4096  # content parts of one message
LOGPROBS_INCLUDE = "message.output_text.logprobs"  # include: the output text's logprobs (top_logprobs: how many)
# OpenAI's other include values: what they add is of hosted tools, images or encrypted reasoning, none of which kiln
# makes, so each adds nothing here; any other value is OpenAI's 400.
INCLUDES = (LOGPROBS_INCLUDE, "reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
            "web_search_call.action.sources", "message.input_image.image_url", "computer_call_output.output.image_url",
            "code_interpreter_call.outputs")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class _Item(BaseModel):
    model_config = ConfigDict(extra="allow")  # ids and statuses of items the client echoes back


class MessageItem(_Item):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_PARTS)]


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_PARTS)]


class FunctionTool(_Body):
    type: Literal["function"]
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class NamedFunction(_Body):
    type: Literal["function"]
    name: Name


class TextFormat(JSONSchemaFormat):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its fields inline."""

    type: Literal["text", "json_object", "json_schema"]
    name: Name | None = None  # type: ignore[assignment]


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted, ignored


class ReasoningConfig(_Body):
    effort: ReasoningEffort | None = None  # the chat template's reasoning_effort (kiln.serving.chat)
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(_Body):
    """``POST /v1/responses``."""

    model: str
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: str | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    store: StrictBool = True
    previous_response_id: str | None = None
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None  # {"include_obfuscation": ...}: accepted, ignored (no obfuscation here)
    background: StrictBool | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[Literal[INCLUDES]] | None = None  # type: ignore[valid-type]
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    reasoning: ReasoningConfig | None = None
    # Accepted and ignored: they change nothing kiln computes.
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    prompt_cache_retention: Literal["in-memory", "24h"] | None = None  # the prefix cache keeps what it can
    max_tool_calls: Annotated[StrictInt, Field(ge=1)] | None = None  # of hosted tools, which kiln has none of


class InputTokensRequest(ResponsesRequest):
    """``POST /v1/responses/input_tokens`` (the SDK's ``responses.input_tokens.count``): a Responses request's
    fields, what its prompt would hold; the generating ones (``max_output_tokens``, ``stream``...) change nothing."""

    personality: str | None = None  # accepted, ignored: the chat template is the model's
