"""Reading tool calls back from a model's output, whole or as it streams.

``required`` and named tool_choices are grammar-constrained (:mod:`constraints`), so their
output parses by construction: a JSON array of ``{"name", "arguments"}`` or the named
function's arguments. Cut short by ``max_tokens`` (``length``), the calls completed before the
cut are still calls (a small model often repeats its call until the limit); with none complete,
the text stays content.

``auto`` output is free text in the format of the model's family
(``kiln.engine.structured.tool_format``): Hermes/Qwen ``<tool_call>{...}</tool_call>``,
Mistral ``[TOOL_CALLS][{...}]`` or
``[TOOL_CALLS]name[ARGS]{...}``, Llama 3 ``{"name": ..., "parameters": {...}}`` (after an
optional ``<|python_tag|>``) or kiln's ``json`` form ``[{"name": ..., "arguments": {...}}]``.
It is read block by block, the same rule for every format: a block begins at the format's
marker (or, for the JSON forms, at the very start of the output) and holds JSON values, each a
call or a list of calls; a Hermes block ends at its ``</tool_call>`` (all of it calls, or none
counts), the others after their last call. A call counts only when it names one of the
request's tools and its arguments are a JSON object. Valid blocks become the calls; everything
else (text before, between and after them, and blocks that are not calls) stays content, as
vLLM's parsers keep the text around calls. Ids are OpenAI-shaped (``call_`` + 24 hex digits).

:class:`AutoToolStream` streams content as it comes and holds back only what may still become a
tool call: a marker's first characters, or a block not yet complete. Text that cannot be the
start of a call (``[1] First...`` where a JSON call could begin) goes out at once, and so does
the text after a block as soon as the block has ended. Calls are sent when the choice ends.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from kiln.serving.constraints import ToolPlan
from kiln.serving.partial_json import DECODER, WS, Values, skip, value_at

# Where a tool call may begin, per format; `json`, `llama3_json` and `mistral` also at the start of
# the output, with one of the characters in _LEADING_JSON.
MARKERS = {"hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",), "llama3_json": ("<|python_tag|>",),
           "json": ()}
_LEADING_JSON = {"llama3_json": "{", "json": "[{", "mistral": "["}
_HERMES_END = "</tool_call>"
_SEP = WS + ",;"  # what may separate calls in a block


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
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


def _calls_of(value: Any, plan: ToolPlan) -> list[Call] | None:
    """The calls of one JSON value (a call or a list of them), or None if any part is not one."""
    calls = [_call(item, plan) for item in (value if isinstance(value, list) else [value])]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


def _json_values(text: str) -> list[Any]:
    """Every JSON value in ``text`` one after another (separated by whitespace, ',' or ';')."""
    values, pos = [], 0
    while True:
        pos = skip(text, pos, _SEP)
        if pos >= len(text):
            return values
        value, pos = DECODER.raw_decode(text, pos)
        values.append(value)


def _calls_from_json(text: str, plan: ToolPlan) -> list[Call] | None:
    try:
        values = _json_values(text)
    except (ValueError, RecursionError):  # not JSON, or nested past what the decoder reads
        return None
    items = [v for value in values for v in (value if isinstance(value, list) else [value])]
    calls = [_call(item, plan) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


def _completed_calls(text: str, plan: ToolPlan) -> list[Call] | None:
    """The calls of a ``required`` array cut short, up to the last complete one."""
    pos = skip(text, 0, WS)
    if not text.startswith("[", pos):
        return None
    calls, pos = [], pos + 1
    while True:
        pos = skip(text, pos, _SEP)
        try:
            value, pos = DECODER.raw_decode(text, pos)
        except (ValueError, RecursionError):
            break
        call = _call(value, plan)
        if call is None:
            break
        calls.append(call)
    return calls or None


def parse_constrained(text: str, plan: ToolPlan, cut: bool = False) -> list[Call] | None:
    """The calls of a grammar-constrained output; None if it has none. ``cut``: it ended at
    max_tokens, so a ``required`` list keeps the calls completed before the cut."""
    if plan.mode == "named":
        try:
            args = json.loads(text)
        except (ValueError, RecursionError):
            return None
        return [Call(plan.named or "", text)] if isinstance(args, dict) else None  # as it was streamed
    calls = _calls_from_json(text, plan)
    if calls is None and cut:
        calls = _completed_calls(text, plan)
    return calls


def _take_calls(text: str, pos: int, plan: ToolPlan, first: str = "{[", final: bool = True,
                values: Values | None = None) -> tuple[int, list[Call], bool]:
    """The calls of the JSON values from ``pos`` on, while each is a call or a list of calls:
    (where the last ends, the calls, open). ``open``: the text so far ends where a further call may
    still come (never when ``final``)."""
    calls: list[Call] = []
    end, at = pos, skip(text, pos, WS)
    while at < len(text) and text[at] in (first if not calls else "{["):
        value = value_at(text, at, first if not calls else "{[", final, values)
        if value.open:
            return end, calls, True
        found = _calls_of(value.value, plan) if value.value is not None else None
        if found is None:
            return end, calls, False
        calls += found
        end, at = value.end, skip(text, value.end, _SEP)
    return end, calls, not final and at >= len(text)


# A block: None while undecided; else (where it ends, its calls), no calls if it is not one.
_Block = tuple[int, list[Call]] | None


def _hermes_block(text: str, at: int, plan: ToolPlan, final: bool, values: Values) -> _Block:
    body = at + len("<tool_call>")
    close, following = values.find(text, _HERMES_END, body), values.find(text, "<tool_call>", body)
    if close >= 0:
        end, calls, _ = _take_calls(text[:close], body, plan)
        if calls and not text[end:close].strip(_SEP):
            return close + len(_HERMES_END), calls
        if following < 0 or following > close:
            return close + len(_HERMES_END), []
        # That `</tool_call>` is a later block's: this one ends where that one begins.
    elif not final:  # a `</tool_call>` may still come, to make all of the block calls or none
        end, calls, still = _take_calls(text, body, plan, final=False, values=values)
        return None if calls or still else (end, [])
    bound = following if following >= 0 else len(text)
    end, calls, _ = _take_calls(text[:bound], body, plan)
    return end, calls


# Mistral's later templates (v11 tokenizers: Mistral Small 3.2, Magistral, Devstral) write a call as
# `[TOOL_CALLS]name[ARGS]{...}`, one marker per call, instead of a JSON list after one marker.
_MISTRAL_NAMED = re.compile(r"\s*([A-Za-z0-9_.:-]+)\s*\[ARGS\]\s*")
_MISTRAL_NAME = re.compile(r"\s*[A-Za-z0-9_.:-]+\s*")


def _mistral_block(text: str, at: int, plan: ToolPlan, final: bool, values: Values) -> _Block:
    body = at + len("[TOOL_CALLS]")
    named = _MISTRAL_NAMED.match(text, body)
    if named is None:
        name = _MISTRAL_NAME.match(text, body)
        if not final and name is not None and "[ARGS]".startswith(text[name.end():name.end() + 7]):
            return None  # `[TOOL_CALLS]name[AR` so far
        return _values_block(text, body, plan, final, values)
    start = named.end()
    if start >= len(text):
        return None if not final else (start, [])
    if text[start] != "{":
        return start, []
    args = value_at(text, start, "{", final, values)
    if args.open:
        return None
    call = _call({"name": named.group(1), "arguments": args.value}, plan) if args.value is not None else None
    return args.end, [call] if call else []


def _values_block(text: str, body: int, plan: ToolPlan, final: bool, values: Values) -> _Block:
    end, calls, still = _take_calls(text, body, plan, final=final, values=values)
    return None if still else (end, calls)


def _marker_block(text: str, at: int, plan: ToolPlan, final: bool, values: Values) -> _Block:
    if plan.format == "hermes":
        return _hermes_block(text, at, plan, final, values)
    if plan.format == "mistral":
        return _mistral_block(text, at, plan, final, values)
    return _values_block(text, at + len(MARKERS[plan.format][0]), plan, final, values)


class _Reader:
    """Splits an output into content and call blocks as far as its text so far decides; what it
    has decided stays decided as the text grows (the output only grows)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.markers = MARKERS.get(plan.format, ())
        self.leading = _LEADING_JSON.get(plan.format, "")  # a call may still begin the output
        self.pos = 0  # `text` before this is decided: `content` and `calls`
        self.search = 0  # where the next marker may be
        self.content = ""
        self.calls: list[Call] = []
        self.values = Values()

    def read(self, text: str, final: bool) -> str:
        """The content after ``self.content`` that no call can take any more (all of it when
        ``final``: the output is whole)."""
        upto = self.decide(text, final)  # first: it moves self.pos past the calls it decides
        return text[self.pos:upto]

    def decide(self, text: str, final: bool) -> int:
        """Where the content that no call can take any more ends: it is ``self.content`` and
        ``text[self.pos:]`` up to there."""
        if self.leading:
            end, calls, still = _take_calls(text, 0, self.plan, self.leading, final, self.values)
            if still:
                return self.pos
            self.leading = ""
            if calls:
                self.calls += calls
                self.pos = self.search = end
        while True:
            found = [(i, m) for i, m in ((text.find(m, self.search), m) for m in self.markers) if i >= 0]
            if not found:
                upto = len(text) if final else max(self.pos, len(text) - _partial_marker(text, self.plan.format))
                self.search = max(self.search, upto)
                return upto
            at, marker = min(found)
            block = _marker_block(text, at, self.plan, final, self.values)
            if block is None:
                return at
            end, calls = block
            if not calls:  # the marker is text
                self.search = at + len(marker)
                continue
            self.content += text[self.pos:at]
            self.calls += calls
            self.pos = self.search = end


def parse_auto(text: str, plan: ToolPlan) -> tuple[str | None, list[Call]]:
    """(content, calls) of free output; no calls leaves all of ``text`` as content."""
    reader = _Reader(plan)
    rest = reader.read(text, final=True)
    if not reader.calls:
        return text, []
    content = (reader.content + rest).strip()
    return (content or None), (reader.calls if plan.parallel else reader.calls[:1])


class AutoToolStream:
    """Content deltas of an ``auto`` choice as they arrive; the calls when it ends."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.reader = _Reader(plan)
        self.sent = 0  # characters of the content already sent
        self.blank = 0  # characters of the content known to be whitespace while none is sent

    def feed(self, delta: str) -> str:
        """The content to send for ``delta``, in time proportional to ``delta`` (amortized): nothing already
        read or sent is read or copied again."""
        text, self.text = self.text, ""
        text += delta  # in place: ``text`` holds the only reference
        self.text = text
        upto = self.reader.decide(text, final=False)  # first: it may add to reader.content
        head, pos = self.reader.content, self.reader.pos

        def content(start: int) -> str:  # the content from ``start`` to ``upto``
            return head[start:] + text[pos + max(0, start - len(head)):upto]

        total = len(head) + upto - pos
        if self.sent + self.blank >= total:
            return ""
        if not self.sent and not content(self.blank).strip():
            self.blank = total
            return ""  # no whitespace-only content: a call may follow
        out = content(self.sent)
        self.sent, self.blank = total, 0
        return out

    def finish(self) -> tuple[str, list[Call]]:
        """(content not sent yet, calls)."""
        rest = self.reader.read(self.text, final=True)
        rest = (self.reader.content + rest)[self.sent:]
        calls = self.reader.calls
        if not calls:
            return rest, []
        rest = rest.rstrip() if self.sent else rest.strip()
        return rest, (calls if self.plan.parallel else calls[:1])


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
    """(content, calls) of a whole choice. A constrained output cut short by max_tokens
    (``length``) keeps the calls completed before the cut; with none, or cut any other way, it
    has no calls and stays content, so the client sees what was generated."""
    if plan.mode in ("required", "named"):
        calls = parse_constrained(text, plan, cut=finish_reason == "length") \
            if finish_reason in ("stop", "length") else None
        return ("", calls) if calls else (text, [])
    content, calls = parse_auto(text, plan)
    return (content or ""), calls


def finish_reason_with(calls: list[Call], finish_reason: str | None) -> str | None:
    """OpenAI's ``tool_calls`` when a choice that ended normally made calls."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason
