"""From a request's ``response_format``, ``structured_outputs``, ``guided_*`` and ``tools`` to one
engine constraint (``StructuredOutputsParams``) plus, for chat, how tool calls are read back.

At most one source constrains a request; a second is a 400 naming it. ``tool_choice`` decides:

- ``none`` (the default without tools): tools are not shown to the model, output is text;
- ``auto`` (the default with tools): output is free; tool calls are parsed from it in the
  format of the model's family (``kiln.engine.structured.tool_format``, :mod:`tool_calls`);
- ``required``: the grammar forces ``[{"name": ..., "arguments": {...}}, ...]`` over the tools
  (one call unless ``parallel_tool_calls``), each call's arguments valid for its parameters;
- a named function: the grammar forces that function's arguments object.

A reply that continues the final assistant message (chat's ``continue_final_message``, a Messages API prefill) is
constrained as the whole output would be: its grammar starts past that message's text (:class:`ContinuedConstraint`),
so a prefill ``{`` goes on with the object's first key, never a second ``{``; a text the constraint cannot begin
with is a 400 naming the constraint. A forced tool call cannot continue a message (its call is the whole output):
``tool_choice`` ``required`` or a named function with a continued message is a 400 naming ``tool_choice``.

The constraint is compiled here (``compile_constraint``), in the grammar compiler's own bounded pool
(``kiln.engine.structured.pool``, never the event loop's default executor, so plain requests never wait
behind compiles) and stopped at ``GRAMMAR_COMPILE_TIMEOUT_S``: a schema the engine cannot compile, or not
within the limit, is a 400 before anything is queued; a full pool is a 429; the engine loop never compiles.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, fields
from typing import Any

from kiln.engine.errors import RequestError
from kiln.engine.structured.params import StructuredOutputsParams
from kiln.engine.structured.pool import GrammarBusy
from kiln.serving.errors import APIError
from kiln.serving.formats import NamedToolChoice, Tool
from kiln.serving.protocol import message_text

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


@dataclass(eq=False)
class ContinuedConstraint(StructuredOutputsParams):
    """A constraint on a reply that continues the final assistant message: its grammar starts past ``prefix``,
    that message's text (``compile_constraint`` makes each request's grammar state accept it first)."""

    prefix: str = ""


def continued_text(req: Any) -> str | None:
    """The text a reply to ``req`` continues (its final message's, as the rendering is cut after it), or None when
    the reply opens a new turn."""
    return message_text(req.messages[-1]).strip() if getattr(req, "continue_final_message", False) else None


class _ContinuingGrammar:
    """A compiled constraint whose every state starts past ``prefix_ids`` (what the prompt already holds)."""

    def __init__(self, compiled: Any, prefix_ids: list[int]) -> None:
        self.compiled = compiled
        self.prefix_ids = prefix_ids

    def new_state(self) -> Any:
        state = self.compiled.new_state()
        if not state.accept(self.prefix_ids):
            return None
        state.num_accepted = 0  # the prefix is the prompt's: never rolled back
        return state


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
    prefix = continued_text(req) if sources else None
    if prefix is None:
        return (sources[0][1] if sources else None), plan
    if sources[0][0] == "tool_choice":
        raise APIError(400, "tool_choice: a forced tool call is the whole reply, so it cannot continue the final "
                       "assistant message's text; let the model choose (tool_choice auto), or end the conversation "
                       "with a user message", param="tool_choice")
    spec = sources[0][1]
    return ContinuedConstraint(**{f.name: getattr(spec, f.name) for f in fields(spec)}, prefix=prefix), plan


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
    if isinstance(spec, ContinuedConstraint) and not isinstance(spec.compiled, _ContinuingGrammar):
        _continue_from_prefix(engine, spec)


def _continue_from_prefix(engine: Any, spec: ContinuedConstraint) -> None:
    """Make ``spec``'s grammar start past its prefix, or a 400 naming the constraint when the prefix cannot begin
    an output it allows."""
    continuing = next((c for ids in _prefix_ids(engine.tokenizer, spec.prefix)
                       if (c := _ContinuingGrammar(spec.compiled, ids)).new_state() is not None), None)
    if continuing is None:
        shown = spec.prefix if len(spec.prefix) <= 40 else spec.prefix[:37] + "..."
        raise APIError(400, f"{spec.param}: the reply continues the final assistant message, whose text {shown!r} "
                       "is not the start of an output this constraint allows; make that text the output's first "
                       "characters (a JSON object's is '{'), or leave the message out",
                       param=spec.param)
    spec.compiled = continuing  # the engine takes the compiled grammar from here (GrammarCompiler.submit)


def _prefix_ids(tokenizer: Any, prefix: str) -> Any:
    """Token ids spelling ``prefix``: as encoded alone, then, for a tokenizer that starts a text with a space
    (SentencePiece's '▁': Llama 2, Mistral v0), as encoded after a newline with the newline's ids cut off."""
    yield tokenizer.encode(prefix, add_special_tokens=False)
    lead = tokenizer.encode("\n", add_special_tokens=False)
    ids = tokenizer.encode("\n" + prefix, add_special_tokens=False)
    if ids[:len(lead)] == lead and tokenizer.decode(ids[len(lead):]) == prefix:
        yield ids[len(lead):]


def close_compiler(engine: Any) -> None:
    """Stop ``engine``'s grammar compile pool (its threads and checker processes), if it was ever made."""
    compiler = getattr(engine.engine, "__dict__", {}).get("grammar_compiler")  # a cached_property: not made here
    if compiler is not None:
        compiler.close()
