"""A chat stream's chunk bodies as the Messages API's server-sent events.

The sequence is Anthropic's: ``message_start`` (the message, empty, with the prompt's usage), a
``ping``, then per content block ``content_block_start``, its deltas (``thinking_delta``,
``text_delta``, or ``input_json_delta`` for a ``tool_use`` block) and ``content_block_stop``; then
``message_delta`` (``stop_reason``, ``stop_sequence``, the final usage) and ``message_stop``. A
failure after the stream started is an ``error`` event. A block opens when its first piece
arrives: thinking, then text, then one block per tool call, in the order the chat stream sends them.
With ``stop_sequences``, text that may still be the start of one is held back until the next piece
says (the chat output keeps the stop sequence; the reply names it and leaves it out).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from kiln.serving.anthropic_translate import STOP_REASONS, cut_stop_sequence, tool_use_id, usage
from kiln.serving.errors import APIError, anthropic_error_body

_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def event(name: str, body: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {_encode(body)}\n\n"


class _Blocks:
    """The content blocks of one streamed message: which is open, and its index."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking" | "text" | "tool_use"

    def start(self, kind: str, block: dict[str, Any]) -> list[str]:
        out = self.stop()
        self.index += 1
        self.open = kind
        return [*out, event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                    "content_block": block})]

    def delta(self, kind: str, delta: dict[str, Any], empty: dict[str, Any]) -> list[str]:
        out = self.start(kind, empty) if self.open != kind else []
        return [*out, event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                    "delta": delta})]

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"type": "content_block_stop", "index": self.index})]


class _Text:
    """Text deltas, holding back what may still begin a stop sequence."""

    def __init__(self, stops: list[str] | None) -> None:
        self.stops = stops or []
        self.held = ""

    def feed(self, text: str) -> str:
        if not self.stops:
            return text
        text = self.held + text
        keep = max((_partial(text, s) for s in self.stops), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """What is held back, once no more text can follow it (a tool call began): it ends no stop sequence."""
        rest, self.held = self.held, ""
        return rest

    def finish(self, finish_reason: str | None) -> tuple[str, str | None]:
        rest, self.held = self.held, ""
        return cut_stop_sequence(rest, finish_reason, self.stops)


def _partial(text: str, stop: str) -> int:
    for n in range(min(len(stop), len(text)), 0, -1):
        if stop.startswith(text[-n:]):
            return n
    return 0


async def message_events(chunks: AsyncIterator[dict[str, Any]], message_id: str, model: str,
                         stops: list[str] | None) -> AsyncIterator[str]:
    """The Messages API's events for one chat stream (``include_usage`` with usage on every chunk)."""
    blocks, text = _Blocks(), _Text(stops)
    started, finish, stop = False, None, None
    async for chunk in chunks:
        if "error" in chunk:  # the stream failed after it started
            failure = chunk["error"]
            yield event("error", anthropic_error_body(APIError(500, failure["message"], type=failure.get("type"))))
            return
        if not started and chunk.get("usage") is not None:
            started = True
            head = {"id": message_id, "type": "message", "role": "assistant", "content": [], "model": model,
                    "stop_reason": None, "stop_sequence": None, "usage": usage(chunk["usage"])}
            yield event("message_start", {"type": "message_start", "message": head})
            yield event("ping", {"type": "ping"})
        if not chunk["choices"]:  # the last chunk: the totals
            for line in blocks.stop():
                yield line
            reason = "stop_sequence" if stop is not None else STOP_REASONS.get(finish or "stop", "end_turn")
            yield event("message_delta", {"type": "message_delta", "usage": usage(chunk["usage"]),
                                          "delta": {"stop_reason": reason, "stop_sequence": stop}})
            yield event("message_stop", {"type": "message_stop"})
            return
        choice = chunk["choices"][0]
        for line in _deltas(blocks, text, choice["delta"]):
            yield line
        if choice["finish_reason"] is not None:
            finish = choice["finish_reason"]
            rest, stop = text.finish(finish)
            if rest:
                for line in blocks.delta("text", {"type": "text_delta", "text": rest}, {"type": "text", "text": ""}):
                    yield line


def _deltas(blocks: _Blocks, text: _Text, delta: dict[str, Any]) -> list[str]:
    out: list[str] = []
    if delta.get("reasoning_content"):
        out += blocks.delta("thinking", {"type": "thinking_delta", "thinking": delta["reasoning_content"]},
                            {"type": "thinking", "thinking": "", "signature": ""})
    piece = text.feed(delta.get("content") or "")
    if piece:
        out += blocks.delta("text", {"type": "text_delta", "text": piece}, {"type": "text", "text": ""})
    for call in delta.get("tool_calls") or ():
        function = call.get("function") or {}
        if call.get("id") is not None:
            if rest := text.flush():  # the text before the call, in its own block as the unstreamed reply has it
                out += blocks.delta("text", {"type": "text_delta", "text": rest}, {"type": "text", "text": ""})
            out += blocks.start("tool_use", {"type": "tool_use", "id": tool_use_id(call["id"]),
                                             "name": function.get("name"), "input": {}})
        if function.get("arguments"):
            out += blocks.delta("tool_use", {"type": "input_json_delta", "partial_json": function["arguments"]}, {})
    return out
