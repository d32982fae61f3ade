"""Which tool-call format a checkpoint's model family emits, read from its chat template.

The builder records the result in the artifact (``engine.json`` ``chat.tool_call_format``);
``kiln serve --model DIR`` reads it from the tokenizer's template at load. Formats, named as
vLLM's tool parsers are:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen 2/2.5/3);
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``;
- ``llama3_json``: ``{"name": ..., "parameters": {...}}``, maybe after ``<|python_tag|>`` (Llama 3.1+);
- ``json``: a template that does not render tools (SmolLM2, ChatML toys): kiln describes the
  tools in a system message and the model answers ``[{"name": ..., "arguments": {...}}]``.
"""

from __future__ import annotations

FORMATS = ("hermes", "mistral", "llama3_json", "json")

# Markers in the template, most specific first.
_MARKERS = (("[TOOL_CALLS]", "mistral"), ("<tool_call>", "hermes"), ("<|python_tag|>", "llama3_json"),
            ("ipython", "llama3_json"))


def detect_tool_call_format(chat_template: str | None) -> str:
    """The format for ``chat_template`` (``json`` when it renders no tools or is unknown)."""
    text = chat_template or ""
    if "tools" not in text:
        return "json"
    for marker, name in _MARKERS:
        if marker in text:
            return name
    return "json"
