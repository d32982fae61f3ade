"""JSON read as it arrives: whether the value at a position of a growing output is whole, cut short, or
cannot be a tool call, so a call still coming is told apart from text that cannot be one
(:mod:`kiln.serving.tool_calls`). A value is read on from where it stopped, so a long call is read once,
not once a token: inside a string cut short too (a 16 k-character argument streamed a few characters at a
time is read in time linear in its length), and so are the searches a reader repeats (:meth:`Values.find`).
"""

from __future__ import annotations

import json
import re
from typing import Any

DECODER = json.JSONDecoder()
WS = " \t\r\n"


def skip(text: str, pos: int, chars: str) -> int:
    """The first position at or after ``pos`` whose character is not in ``chars``."""
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


_STRING_BODY = re.compile(r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*')  # whole characters
_ESCAPE_CUT = re.compile(r"(?:\\|\\u[0-9a-fA-F]{0,3})?\Z")  # an escape cut short at the end, or nothing
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CUT = re.compile(r"-?(?:0|[1-9][0-9]*)?(?:\.[0-9]*)?(?:[eE][+-]?[0-9]*)?\Z")
_WORDS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")  # what the decoder reads
_CLOSE = {"{": "}", "[": "]"}


class PartialValue:
    """The JSON value at ``at`` of an output that grows: ``open`` (cut short, and may still be a
    call or a list of calls), or else ``value``/``end`` (None when it is not JSON, or cannot be
    a call: it does not start with one of ``first``, or a top-level list holds more than objects).
    :meth:`read` goes on from where it stopped, so a long call is read once, not once a token."""

    def __init__(self, at: int, first: str) -> None:
        self.at, self.first = at, first
        self.i, self.stack, self.expect, self.closable = at, [], "value", False  # closable: just opened
        self.string_at: int | None = None  # inside a string cut short: where its whole characters end
        self.open = True
        self.value: Any = None
        self.end = 0

    def read(self, text: str, final: bool) -> PartialValue:
        if self.open:
            whole = self._scan(text)
            if whole is not None or final:  # not JSON by kiln's reading: the decoder has the last word
                self.open = False
                try:
                    self.value, self.end = DECODER.raw_decode(text, self.at)
                except (ValueError, RecursionError):  # RecursionError: nested past what it reads
                    self.value = None
        return self

    def _scan(self, text: str) -> bool | None:
        """True when the value is whole, False when it cannot become a call, None while cut short."""
        n = len(text)
        while True:
            i = skip(text, self.i, WS)
            if i >= n:
                return None
            c, stack = text[i], self.stack
            if (self.expect == "next" or self.closable) and stack and c == _CLOSE[stack[-1]]:
                stack.pop()
                self.i, self.expect, self.closable = i + 1, "next", False
                if not stack:
                    return True
                continue
            self.closable = False
            if self.expect == "next":
                if c != ",":
                    return False
                self.i, self.expect = i + 1, "key" if stack[-1] == "{" else "value"
            elif self.expect == "colon":
                if c != ":":
                    return False
                self.i, self.expect = i + 1, "value"
            elif self.expect == "key" or c == '"':
                end = self._string(text, i)
                if end is None or end is False:
                    return end
                self.i, self.expect = end, "colon" if self.expect == "key" else "next"
            else:
                allowed = self.first if not stack else "{" if stack == ["["] else None
                if allowed is not None and c not in allowed:
                    return False
                if c in "{[":
                    stack.append(c)
                    self.i, self.expect, self.closable = i + 1, "key" if c == "{" else "value", True
                elif _NUMBER_CUT.match(text, i):  # a number up to the end: more digits may come
                    return None
                elif number := _NUMBER.match(text, i):
                    self.i, self.expect = number.end(), "next"
                elif word := next((w for w in _WORDS if text.startswith(w, i)), None):
                    self.i, self.expect = i + len(word), "next"
                else:
                    return None if any(w.startswith(text[i:]) for w in _WORDS) else False


    def _string(self, text: str, i: int) -> int | bool | None:
        """Where the string opening at ``i`` ends, None while cut short (read on from there next time), False
        when it is not a JSON string."""
        if text[i] != '"':
            return False
        k = _STRING_BODY.match(text, self.string_at or i + 1).end()
        if k < len(text) and text[k] == '"':
            self.string_at = None
            return k + 1
        if _ESCAPE_CUT.match(text, k):
            self.string_at = k
            return None
        return False


class Values(dict[int, PartialValue]):
    """A reader's values by where they begin (the text before a position never changes as it grows), and
    how far each of its searches got."""

    def __init__(self) -> None:
        super().__init__()
        self.searched: dict[tuple[str, int], int] = {}

    def find(self, text: str, needle: str, start: int) -> int:
        """``text.find(needle, start)``, searching only the text added since the last call that missed."""
        key = (needle, start)
        at = text.find(needle, self.searched.get(key, start))
        self.searched[key] = at if at >= 0 else max(start, len(text) - len(needle) + 1)
        return at


def value_at(text: str, at: int, first: str, final: bool, values: Values | None) -> PartialValue:
    value = values.get(at) if values is not None else None
    if value is None:
        value = PartialValue(at, first)
        if values is not None:
            values[at] = value
    return value.read(text, final)
