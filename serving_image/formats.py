"""Request bodies for constrained output: ``response_format``, vLLM's ``structured_outputs`` and
``guided_*`` extras, ``tools`` / ``tool_choice``, and tool calls in chat history.

Shapes are OpenAI's (``response_format``, ``tools``) and vLLM's (``structured_outputs``); what
each means for the engine is :mod:`kiln.serving.constraints`. Counts are bounded here; the
sizes and depths of schemas by the engine's limits (``kiln.engine.structured.params``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

MAX_TOOLS = 128  # OpenAI's limit on `tools`

# OpenAI's rule for function and response-format names.
Name = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class JSONSchemaFormat(_Body):
    name: Name
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsBody(_Body):
    """vLLM's ``structured_outputs``: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None


class FunctionDefinition(_Body):
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: Name


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str


class ToolCall(BaseModel):
    """A tool call in an assistant message of the history (as the client got it back)."""

    model_config = ConfigDict(extra="allow")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class GuidedFields(_Body):
    """vLLM's older per-field names for ``structured_outputs``, still sent by many clients."""

    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsBody | None = None
    response_format: ResponseFormat | None = None
