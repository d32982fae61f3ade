"""Reading tool calls back from a model's output, whole or as it streams.

``required`` and named tool_choices are grammar-constrained (:mod:`constraints`), so their
output parses by construction: a JSON array of ``{"name", "arguments"}`` or the named
function's arguments. ``auto`` output is free text in the format of the model's family
(``kiln.engine.structured.tool_format``): Hermes/Qwen ``<tool_call>{...}</tool_call>``,
Mistral ``[TOOL_CALLS][{...}]`` or
``[TOOL_CALLS]name[ARGS]{...}``, Llama 3 ``{"name": ..., "parameters": {...}}`` (after an
optional ``<|python_tag|>``) or kiln's ``json`` form ``[{"name": ..., "arguments": {...}}]``.
A call counts only when it names one of the request's tools and its arguments are a JSON
object; otherwise the text stays content. Ids are OpenAI-shaped (``call_`` + 24 hex digits).

:class:`AutoToolStream` streams content as it comes and holds back only what may be the
start of a tool call, so a client sees text deltas at once and tool calls when complete.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from kiln.serving.constraints import ToolPlan

_DECODER = json.JSONDecoder()
# Where a tool call may begin, per format; `json` and `llama3_json` also at a leading '{' or '['.
MARKERS = {"hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",), "llama3_json": ("<|python_tag|>",),
           "json": ()}
_LEADING_JSON = {"llama3_json": "{", "json": "[{", "mistral": "["}


@dataclass
class Call:
    name: str
    arguments: str  # JSON text of an object
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or "call_" + uuid.uuid4().hex[:24]

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call(obj: Any, plan: ToolPlan) -> Call | None:
    if not isinstance(obj, dict) or obj.get("name") not in plan.names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str) -> list[Any]:
    """Every JSON value in ``text`` one after another (separated by whitespace, ',' or ';')."""
    values, pos = [], 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,;":
            pos += 1
        if pos >= len(text):
            return values
        value, pos = _DECODER.raw_decode(text, pos)
        values.append(value)


def _calls_from_json(text: str, plan: ToolPlan) -> list[Call] | None:
    try:
        values = _json_values(text)
    except ValueError:
        return None
    items = [v for value in values for v in (value if isinstance(value, list) else [value])]
    calls = [_call(item, plan) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


def parse_constrained(text: str, plan: ToolPlan) -> list[Call] | None:
    """The calls of a grammar-constrained output (None if it was cut short, by max_tokens or a stop)."""
    if plan.mode == "named":
        try:
            args = json.loads(text)
        except ValueError:
            return None
        return [Call(plan.named or "", text)] if isinstance(args, dict) else None  # as it was streamed
    return _calls_from_json(text, plan)


def tool_section_start(text: str, fmt: str) -> int | None:
    """Where the tool-call part of ``text`` begins, if it has one."""
    found = [i for i in (text.find(m) for m in MARKERS.get(fmt, ())) if i >= 0]
    if found:
        return min(found)
    stripped = text.lstrip()
    if stripped and stripped[0] in _LEADING_JSON.get(fmt, ""):
        return len(text) - len(stripped)
    return None


# Mistral's later templates (v11 tokenizers: Mistral Small 3.2, Magistral, Devstral) write a call as
# `[TOOL_CALLS]name[ARGS]{...}`, one marker per call, instead of a JSON list after one marker.
_MISTRAL_NAMED = re.compile(r"\[TOOL_CALLS\]\s*([A-Za-z0-9_.:-]+)\s*\[ARGS\]\s*")


def _mistral_named_calls(body: str, plan: ToolPlan) -> list[Call] | None:
    calls = []
    for m in _MISTRAL_NAMED.finditer(body):
        try:
            args, _ = _DECODER.raw_decode(body, m.end())
        except ValueError:
            return None
        call = _call({"name": m.group(1), "arguments": args}, plan)
        if call is None:
            return None
        calls.append(call)
    return calls or None


def parse_auto(text: str, plan: ToolPlan) -> tuple[str | None, list[Call]]:
    """(content, calls) of free output; no calls leaves all of ``text`` as content."""
    start = tool_section_start(text, plan.format)
    if start is None:
        return text, []
    body = text[start:]
    if plan.format == "mistral" and _MISTRAL_NAMED.search(body):
        calls = _mistral_named_calls(body, plan)
    else:
        for marker in MARKERS.get(plan.format, ()):
            body = body.replace(marker, " ")
        if plan.format == "hermes":
            body = re.sub(r"</?tool_call>", " ", body)
        calls = _calls_from_json(body, plan)
    if not calls:
        return text, []
    if not plan.parallel:
        calls = calls[:1]
    content = text[:start].strip()
    return (content or None), calls


class AutoToolStream:
    """Content deltas of an ``auto`` choice as they arrive; the calls when it ends."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.emitted = 0  # characters of `text` already sent as content
        self.held = False  # a tool section began: nothing more is sent until the end

    def feed(self, delta: str) -> str:
        self.text += delta
        fmt = self.plan.format
        start = tool_section_start(self.text, fmt)
        self.held = self.held or start is not None
        if self.held:
            upto = (start or 0) if self.text[:start].strip() else self.emitted  # no whitespace-only content
        elif not self.text.strip() and _LEADING_JSON.get(fmt):
            upto = 0  # only whitespace so far: a JSON call may still follow
        else:
            upto = len(self.text) - _partial_marker(self.text, fmt)
        out = self.text[self.emitted:upto]
        self.emitted = max(self.emitted, upto)
        return out

    def finish(self) -> tuple[str, list[Call]]:
        """(content not sent yet, calls)."""
        _, calls = parse_auto(self.text, self.plan)
        if not calls:
            return self.text[self.emitted:], []
        start = tool_section_start(self.text, self.plan.format) or 0
        return self.text[self.emitted:start].rstrip(), calls


def _partial_marker(text: str, fmt: str) -> int:
    """Length of the longest end of ``text`` that begins a marker of ``fmt``."""
    best = 0
    for marker in MARKERS.get(fmt, ()):
        for n in range(min(len(marker) - 1, len(text)), 0, -1):
            if marker.startswith(text[-n:]):
                best = max(best, n)
                break
    return best


def read_calls(text: str, finish_reason: str | None, plan: ToolPlan) -> tuple[str, list[Call]]:
    """(content, calls) of a whole choice. A constrained output cut short (``length``) has no calls
    and stays content, so the client sees what was generated."""
    if plan.mode in ("required", "named"):
        calls = parse_constrained(text, plan) if finish_reason == "stop" else None
        return ("", calls) if calls else (text, [])
    content, calls = parse_auto(text, plan)
    return (content or ""), calls


def finish_reason_with(calls: list[Call], finish_reason: str | None) -> str | None:
    """OpenAI's ``tool_calls`` when a choice that ended normally made calls."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason
