"""From a request's ``response_format``, ``structured_outputs``, ``guided_*`` and ``tools`` to one
engine constraint (``StructuredOutputsParams``) plus, for chat, how tool calls are read back.

At most one source constrains a request; a second is a 400 naming it. ``tool_choice`` decides:

- ``none`` (the default without tools): tools are not shown to the model, output is text;
- ``auto`` (the default with tools): output is free; tool calls are parsed from it in the
  format of the model's family (``kiln.engine.structured.tool_format``, :mod:`tool_calls`);
- ``required``: the grammar forces ``[{"name": ..., "arguments": {...}}, ...]`` over the tools
  (one call unless ``parallel_tool_calls``), each call's arguments valid for its parameters;
- a named function: the grammar forces that function's arguments object.

The constraint is compiled here (``compile_constraint``), in the grammar compiler's own bounded pool
(``kiln.engine.structured.pool``, never the event loop's default executor, so plain requests never wait
behind compiles) and stopped at ``GRAMMAR_COMPILE_TIMEOUT_S``: a schema the engine cannot compile, or not
within the limit, is a 400 before anything is queued; a full pool is a 429; the engine loop never compiles.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from kiln.engine.errors import RequestError
from kiln.engine.structured.params import StructuredOutputsParams
from kiln.engine.structured.pool import GrammarBusy
from kiln.serving.errors import APIError
from kiln.serving.formats import NamedToolChoice, Tool

# A function without `parameters` takes none: its arguments are `{}`.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass
class ToolPlan:
    """How a chat request's tools are shown to the model and read back from its output."""

    mode: str  # "auto" | "required" | "named"
    tools: list[Tool]
    format: str  # the model family's tool-call format (tool_format.FORMATS)
    parallel: bool = True
    named: str | None = None  # the function a named tool_choice forces
    names: set[str] = field(default_factory=set)


def _spec(param: str, **kwargs: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(param=param, **kwargs)
    except RequestError as exc:
        raise APIError(400, str(exc), param=exc.param) from None


def _sources(req: Any) -> list[tuple[str, StructuredOutputsParams]]:
    """Every constraint the request sets, with the field it came from."""
    found = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", _spec("response_format", json_object=True)))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(400, "response_format of type json_schema needs json_schema.schema (a JSON Schema)",
                           param="response_format.json_schema")
        found.append(("response_format", _spec("response_format.json_schema", json=fmt.json_schema.schema_,
                                                strict=bool(fmt.json_schema.strict))))
    so = req.structured_outputs
    if so is not None:
        found.append(("structured_outputs", _spec(
            "structured_outputs", json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
            json_object=bool(so.json_object))))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append((name, _spec(name, **{kind: value})))
    return found


def output_constraint(req: Any, tool_format: str = "json") -> tuple[StructuredOutputsParams | None,
                                                                      ToolPlan | None]:
    """The request's constraint and tool plan; a 400 naming the field for anything inconsistent."""
    sources = _sources(req)
    plan = tool_plan(req, tool_format) if hasattr(req, "tools") else None
    if plan is not None and plan.mode in ("required", "named"):
        sources.append(("tool_choice", tools_constraint(plan)))
    if len(sources) > 1:
        names = [name for name, _ in sources]
        raise APIError(400, f"{' and '.join(names)} both constrain the output; send only one of them",
                       param=names[1])
    return (sources[0][1] if sources else None), plan


def tool_plan(req: Any, tool_format: str) -> ToolPlan | None:
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools: list the functions the model may call",
                           param="tool_choice")
        return None
    names = [t.function.name for t in req.tools]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise APIError(400, f"tools name the function {dupes[0]!r} more than once; names must be unique",
                       param="tools")
    if choice == "none":
        return None
    parallel = req.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not in "
                           f"tools ({', '.join(names)})", param="tool_choice.function.name")
        return ToolPlan("named", req.tools, tool_format, parallel, choice.function.name, set(names))
    return ToolPlan(choice or "auto", req.tools, tool_format, parallel, None, set(names))


def parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else NO_PARAMETERS


def tools_constraint(plan: ToolPlan) -> StructuredOutputsParams:
    """The grammar of a ``required`` or named tool_choice."""
    if plan.mode == "named":
        index, tool = next((i, t) for i, t in enumerate(plan.tools) if t.function.name == plan.named)
        return _spec(f"tools[{index}].function.parameters", json=parameters(tool),
                     strict=bool(tool.function.strict))
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": parameters(t)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in plan.tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not plan.parallel:
        schema["maxItems"] = 1
    return _spec("tools", json=schema, strict=all(bool(t.function.strict) for t in plan.tools))


async def compile_constraint(engine: Any, spec: StructuredOutputsParams) -> None:
    """Compile ``spec`` for ``engine`` (an AsyncLLM) in the grammar compiler's pool; a 400 if it cannot be, or
    not within the time limit, a 429 if the pool is full. The engine then finds it compiled
    (``spec.compiled``); a constraint compiled before never reaches the pool."""
    compiler = engine.engine.grammar_compiler
    try:
        await asyncio.wrap_future(compiler.submit(spec))  # cancelled with the request while it waits
    except GrammarBusy as exc:
        raise APIError(429, str(exc), param=exc.param, code=exc.code,
                       headers={"Retry-After": str(exc.retry_after_s)}) from None
    except RequestError as exc:
        raise APIError(400, str(exc), param=exc.param) from None


def close_compiler(engine: Any) -> None:
    """Stop ``engine``'s grammar compile pool (its threads and checker processes), if it was ever made."""
    compiler = getattr(engine.engine, "__dict__", {}).get("grammar_compiler")  # a cached_property: not made here
    if compiler is not None:
        compiler.close()
