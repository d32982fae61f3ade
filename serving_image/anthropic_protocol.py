"""Request bodies of Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``), pydantic v2.

Field names and shapes are Anthropic's. Unknown fields are refused with a 400 naming them, as on the
OpenAI endpoints. ``cache_control`` is accepted everywhere Anthropic takes it (blocks, tools, the request's
top level) and means nothing here:
kiln's prefix cache reuses every shared prefix without being asked. Content kiln cannot read (images,
documents, server tools) is refused by :mod:`anthropic_translate`, naming the block. Counts and sizes
are bounded as the chat endpoint bounds them (docs/serving-limits.md).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from kiln.engine.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from kiln.serving.formats import MAX_TOOLS, Name
from kiln.serving.protocol import MAX_MESSAGES
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

MAX_BLOCKS = 4096  # content blocks in one message


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Block(BaseModel):
    model_config = ConfigDict(extra="allow")  # citations, cache_control...: accepted, ignored

    type: str


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_BLOCKS)] | None = None
    is_error: StrictBool | None = None


BLOCKS: dict[str, type[_Block]] = {"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock}


class Message(_Body):
    role: Literal["user", "assistant"]
    # Blocks are read by type in anthropic_translate (BLOCKS), so an error names the block's own field.
    content: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_BLOCKS)]


class Tool(_Body):
    name: Name
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: Name | None = None
    disable_parallel_tool_use: StrictBool | None = None


class Thinking(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    display: str | None = None


class OutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # the template's reasoning_effort


class Metadata(_Body):
    user_id: str | None = None


class CountTokensRequest(_Body):
    """``POST /v1/messages/count_tokens``: what the prompt would hold."""

    model: str
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: str | Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS)] | None = None
    tools: Annotated[list[Tool | dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None  # the top-level marker (automatic caching): means nothing here
    inference_geo: str | None = None  # accepted, ignored: this server runs where it runs
    speed: Literal["standard", "fast"] | None = None  # accepted, ignored: one speed here


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: Annotated[StrictInt, Field(ge=1)]
    stop_sequences: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]],
                              Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: StrictBool = False
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    metadata: Metadata | None = None
    service_tier: str | None = None  # accepted, ignored: one tier here
