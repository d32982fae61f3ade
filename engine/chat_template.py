"""A chat template rendered as transformers renders it, without importing transformers.

transformers' ``apply_chat_template(..., tokenize=False)`` (5.x, ``utils/chat_template_utils.py``) picks the
template (:func:`pick_template`), turns the messages into plain dicts without ``None`` values, copies a
message's reasoning under the names templates read, and renders in a sandboxed jinja environment with its own
``tojson``, ``raise_exception``, ``strftime_now``, ``dict`` and ``namespace`` and the ``{% generation %}`` tag,
the tokenizer's special tokens given as variables. This module does the same steps; the tests hold its output
equal to transformers' on the templates kiln meets (``tests/engine/test_light_tokenizer.py``). Importing
transformers costs 0.8 s of a start that must be ready in 2 (docs/performance.md).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

# The names a message's reasoning is passed under; templates read the first (transformers' _REASONING_FIELDS).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def pick_template(chat_template: str | dict[str, str] | None, name: str | None = None,
                  tools: list | None = None) -> str:
    """The template to render: a named one of several (``tool_use`` when tools are given, else ``default``),
    or the one there is (transformers' ``get_chat_template``)."""
    if isinstance(chat_template, dict):
        if name is not None and name in chat_template:
            return chat_template[name]
        if name is None:
            if tools is not None and "tool_use" in chat_template:
                return chat_template["tool_use"]
            if "default" in chat_template:
                return chat_template["default"]
            raise ValueError("This model has multiple chat templates with no default specified; name one of "
                             f"{sorted(chat_template)}")
        return name
    if name is not None:
        return name
    if chat_template is None:
        raise ValueError("this tokenizer has no chat template")
    return chat_template


def plain(value: Any) -> Any:
    """What a template may see: JSON types only, anything else a placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    np = sys.modules.get("numpy")  # a numpy value comes only from a caller that imported numpy
    if np is not None and isinstance(value, np.generic):
        return plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _to_dicts(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _to_dicts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_dicts(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_dicts(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _to_dicts(value.model_dump())
    return value


def normalize(conversation: Any) -> list[dict]:
    """Messages as dicts, a key whose value is None dropped (templates render a missing key right, None not)."""
    messages = _to_dicts(getattr(conversation, "messages", conversation))
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
        out.append({k: v for k, v in message.items() if v is not None})
    return out


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    aliased = []
    for message in chat:
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


@lru_cache(maxsize=32)
def compile_template(source: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: its body, as is (transformers tracks the span for
        assistant masks, which serving never asks for)."""
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's Namespace signature)
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f),
                       dict=TemplateDict(), namespace=TemplateNamespace)
    return env.from_string(source)


def render(source: str, conversation: Any, special_tokens: Mapping[str, Any], tools: list | None = None,
           documents: list | None = None, add_generation_prompt: bool = False, **kwargs: Any) -> str:
    """One conversation through the template ``source``, as transformers' ``apply_chat_template(...,
    tokenize=False)`` renders it (``special_tokens``: the tokenizer's ``special_tokens_map``)."""
    for tool in tools or ():
        if not isinstance(tool, dict):
            raise ValueError("Tools should be JSON schemas (dicts)")
    for document in documents or ():
        if not isinstance(document, dict):
            raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    chat = plain(normalize(conversation))  # normalize refused anything but dicts; plain keeps dicts dicts
    variables = plain({**special_tokens, **kwargs})
    return compile_template(source).render(messages=_alias_reasoning(chat), tools=plain(tools),
                                           documents=plain(documents), add_generation_prompt=add_generation_prompt,
                                           **variables)
