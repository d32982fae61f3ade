"""What a request constrains its output to, and the limits on it (the one home of each).

``StructuredOutputsParams`` is vLLM's shape: exactly one of ``json`` (a JSON Schema),
``json_object`` (any JSON object), ``regex``, ``choice`` (one of these strings) or
``grammar`` (llguidance's Lark dialect). ``strict`` decides what happens to a JSON Schema
keyword the grammar engine cannot enforce: ``True`` (OpenAI's ``strict: true``) refuses the
schema, ``False`` ignores the keyword and enforces the rest. ``param`` is the request field the
constraint came from (``response_format.json_schema``, ``tools[2].function.parameters``...),
so that every refusal names what the client sent.

The limits bound the work one request can cause before admission (the grammar compile) and
per token (the mask): they are checked here, on the caller's thread, before the engine sees
the request. docs/serving-limits.md lists them. The compile's own limits (time, pool, grammar
size) are enforced where compiles run (``kiln.engine.structured.pool``); their values live here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kiln.engine.errors import RequestError

MAX_GRAMMAR_BYTES = 64 * 1024  # a schema, regex or Lark grammar, serialized (all tools' schemas together)
MAX_SCHEMA_DEPTH = 24  # nesting of a schema document's objects and arrays
MAX_CHOICE_STRINGS = 256
MAX_CHOICE_CHARS = 1024
GRAMMAR_COMPILE_TIMEOUT_S = 5.0  # wall time of one compile; it is stopped there and the server answers 400
GRAMMAR_COMPILE_THREADS = 2  # compiles running at once, in the compiler's own pool (never the server's)
GRAMMAR_COMPILE_QUEUE = 8  # compiles waiting for one of those threads; past it the server answers 429
GRAMMAR_MAX_SYMBOLS = 50_000  # llguidance's max_grammar_size (a 64 KiB schema of 100 tools needs ~10k)
COMPILE_ENV = {"timeout_s": "KILN_GRAMMAR_COMPILE_TIMEOUT_S", "threads": "KILN_GRAMMAR_COMPILE_THREADS",
               "queue": "KILN_GRAMMAR_COMPILE_QUEUE"}

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(eq=False)
class StructuredOutputsParams:
    json: dict[str, Any] | bool | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    strict: bool = False
    param: str = "structured_outputs"
    compiled: Any = field(default=None, repr=False)  # set by GrammarCompiler.compile (one compile per request)

    def __post_init__(self) -> None:
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as exc:
                raise RequestError(self.param, f"{self.param} is not valid JSON: {exc}") from None
        given = [k for k in KINDS if (self.json_object if k == "json_object" else getattr(self, k) is not None)]
        if len(given) != 1:
            raise RequestError(self.param, f"{self.param} must set exactly one of {', '.join(KINDS)}; "
                                           f"got {', '.join(given) or 'none'}")
        self.check_limits()

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if (self.json_object if k == "json_object" else getattr(self, k) is not None))

    def check_limits(self) -> None:
        """Refuse a constraint over the size, depth or count limits, naming ``param``."""
        kind = self.kind
        if kind == "json":
            if not isinstance(self.json, dict | bool):
                raise RequestError(self.param, f"{self.param} must be a JSON Schema object, "
                                               f"got {type(self.json).__name__}")
            depth = json_depth(self.json)
            if depth > MAX_SCHEMA_DEPTH:
                raise RequestError(self.param, f"{self.param} nests {depth} levels deep; this server allows "
                                               f"{MAX_SCHEMA_DEPTH}: flatten the schema or use $defs and $ref")
        if kind == "choice":
            if not self.choice or len(self.choice) > MAX_CHOICE_STRINGS:
                raise RequestError(self.param, f"{self.param} must hold 1 to {MAX_CHOICE_STRINGS} strings")
            if not all(isinstance(c, str) and 0 < len(c) <= MAX_CHOICE_CHARS for c in self.choice):
                raise RequestError(self.param, f"{self.param} must hold non-empty strings of at most "
                                               f"{MAX_CHOICE_CHARS} characters")
        size = len(self.key())
        if size > MAX_GRAMMAR_BYTES:
            raise RequestError(self.param, f"{self.param} is {size} bytes; this server compiles at most "
                                           f"{MAX_GRAMMAR_BYTES} bytes of schema or grammar per request: shorten it")

    def key(self) -> str:
        """A canonical text of the constraint: the compile cache's key."""
        kind = self.kind
        value = {"json": self.json, "json_object": True, "regex": self.regex, "choice": self.choice,
                 "grammar": self.grammar}[kind]
        return json.dumps([kind, self.strict, value], sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class CompileSettings:
    timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S
    threads: int = GRAMMAR_COMPILE_THREADS
    queue: int = GRAMMAR_COMPILE_QUEUE


def compile_settings(environ: Mapping[str, str] = os.environ) -> CompileSettings:
    """The compile limits, each overridable by its ``$KILN_GRAMMAR_COMPILE_*`` variable (COMPILE_ENV)."""
    values: dict[str, Any] = {}
    for name, var in COMPILE_ENV.items():
        text = environ.get(var)
        if text is None:
            continue
        try:
            value = float(text) if name == "timeout_s" else int(text)
        except ValueError:
            value = -1
        if name == "timeout_s" and not value > 0:
            raise ValueError(f"${var} must be a positive number of seconds, got {text!r}")
        least = 1 if name == "threads" else 0
        if value < least:
            raise ValueError(f"${var} must be an integer of at least {least}, got {text!r}")
        values[name] = value
    return CompileSettings(**values)


def json_depth(value: Any) -> int:
    """Nesting depth of objects and arrays in a JSON value, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest
