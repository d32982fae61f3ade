"""A chat stream's chunk bodies as the Responses API's server-sent events.

The sequence is the one the OpenAI SDK's stream helper accumulates: ``response.created`` and
``response.in_progress``; per output item ``response.output_item.added``, then for a message (or
reasoning) ``response.content_part.added``, its ``response.output_text.delta`` (or
``response.reasoning_text.delta``) events, ``...done`` and ``response.content_part.done``, for a
function call its ``response.function_call_arguments.delta`` events and ``...done``; then
``response.output_item.done``; last ``response.completed`` (or ``response.incomplete`` when cut at
``max_output_tokens``) carrying the whole Response, the same body a non-streamed request gets.
Every event has its ``sequence_number``. A failure after the stream started is an ``error`` event, then
``response.failed`` carrying the Response as it stood (``status: "failed"``, its ``error``, the output so far);
a failed response is stored as it stood (``GET`` returns it); a follow-up continues from its input, not its partial
output.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from kiln.serving.responses_translate import count_reasoning, output_item, output_items, response_body

_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


class _Writer:
    """Numbers and renders events; tracks the one output item open."""

    def __init__(self, response_id: str) -> None:
        self.response_id = response_id
        self.seq = 0
        self.message: dict[str, Any] = {"content": "", "reasoning_content": None, "tool_calls": [], "logprobs": []}
        self.pending: list[dict[str, Any]] = []  # logprobs not yet sent with a text delta
        self.open: str | None = None  # "reasoning" | "message" | "function_call"
        self.index = -1  # the open item's output_index
        self.item_id = ""  # the open item's id

    def event(self, kind: str, **body: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **body}
        self.seq += 1
        return f"event: {kind}\ndata: {_encode(data)}\n\n"

    def _item(self, kind: str, status: str) -> dict[str, Any]:
        """The open item as it stands, from the message so far."""
        message = {**self.message, "tool_calls": self.message["tool_calls"][-1:]}
        return output_item(kind, self.response_id, message, status)

    def start(self, kind: str) -> list[str]:
        out = self.stop()
        self.open, self.index = kind, self.index + 1
        item = self._item(kind, "in_progress")
        if kind != "function_call":  # its part comes with content_part.added, as OpenAI (and vLLM) send it
            item["content"] = []
        self.item_id = item["id"]
        out.append(self.event("response.output_item.added", output_index=self.index, item=item))
        if kind != "function_call":
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else \
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=self.index,
                                  content_index=0, part=part))
        return out

    def delta(self, kind: str, piece: str) -> list[str]:
        out = self.start(kind) if self.open != kind else []
        where = {"item_id": self.item_id, "output_index": self.index}
        if kind == "function_call":
            self.message["tool_calls"][-1]["function"]["arguments"] += piece
            out.append(self.event("response.function_call_arguments.delta", **where, delta=piece))
        elif kind == "reasoning":
            self.message["reasoning_content"] = (self.message["reasoning_content"] or "") + piece
            out.append(self.event("response.reasoning_text.delta", **where, content_index=0, delta=piece))
        else:
            self.message["content"] += piece
            logprobs, self.pending = self.pending, []
            out.append(self.event("response.output_text.delta", **where, content_index=0, delta=piece,
                                  logprobs=logprobs))
        return out

    def stop(self, status: str = "completed") -> list[str]:
        """Close the open item: ``completed``, or ``incomplete`` when the response was cut in it."""
        if self.open is None:
            return []
        kind, self.open = self.open, None
        item = self._item(kind, status)
        where = {"item_id": item["id"], "output_index": self.index}
        out = []
        if kind == "function_call":
            out.append(self.event("response.function_call_arguments.done", **where, name=item["name"],
                                  arguments=item["arguments"]))
        else:
            part = item["content"][0]
            done = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
            extra = {} if kind == "reasoning" else {"logprobs": part["logprobs"]}
            out.append(self.event(done, **where, content_index=0, text=part["text"], **extra))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        out.append(self.event("response.output_item.done", output_index=self.index, item=item))
        return out


def _deltas(writer: _Writer, delta: dict[str, Any]) -> list[str]:
    out: list[str] = []
    if delta.get("reasoning_content"):
        out += writer.delta("reasoning", delta["reasoning_content"])
    if delta.get("content"):
        out += writer.delta("message", delta["content"])
    for call in delta.get("tool_calls") or ():
        function = call.get("function") or {}
        if call.get("id") is not None:
            writer.message["tool_calls"].append({"id": call["id"], "type": "function",
                                                 "function": {"name": function.get("name"), "arguments": ""}})
            out += writer.start("function_call")
        if function.get("arguments"):
            out += writer.delta("function_call", function["arguments"])
    return out


def _failed(writer: _Writer, req: Any, created_at: int, failure: dict[str, Any],
            finished: Callable[[dict[str, Any], dict[str, Any] | None], None]) -> list[str]:
    """The ``error`` event, then ``response.failed`` with the output as it stood (its last item incomplete), which
    ``finished`` gets (to store) with no reply: a follow-up continues from this response's input."""
    code = "invalid_prompt" if failure.get("type") == "invalid_request_error" else "server_error"
    message = dict(writer.message)
    if message["content"] == "" and message["tool_calls"]:
        message["content"] = None
    output = output_items(writer.response_id, message, False) if writer.index >= 0 else []
    body = response_body(req, writer.response_id, created_at, "failed", output)
    body["error"] = {"code": code, "message": failure["message"]}
    finished(body, None)
    return [writer.event("error", code=failure.get("code") or code, message=failure["message"],
                         param=failure.get("param")),
            writer.event("response.failed", response=body)]


async def response_events(chunks: AsyncIterator[dict[str, Any]], req: Any, response_id: str, created_at: int,
                          finished: Callable[[dict[str, Any], dict[str, Any] | None], None],
                          tokenizer: Any = None) -> AsyncIterator[str]:
    """The Responses API's events for one chat stream; ``finished(response, message)`` gets the final
    Response and the reply as a chat message (to store) before the last event; a failed one, None for the reply."""
    writer = _Writer(response_id)
    head = response_body(req, response_id, created_at)
    yield writer.event("response.created", response=head)
    yield writer.event("response.in_progress", response=head)
    finish = None
    async for chunk in chunks:
        if "error" in chunk:
            for line in _failed(writer, req, created_at, chunk["error"], finished):
                yield line
            return
        if chunk["choices"]:
            choice = chunk["choices"][0]
            logprobs = (choice.get("logprobs") or {}).get("content") or []
            writer.message["logprobs"] += logprobs
            writer.pending += logprobs
            for line in _deltas(writer, choice["delta"]):
                yield line
            finish = choice["finish_reason"] or finish
            continue
        done = finish != "length"
        for line in writer.stop("completed" if done else "incomplete"):  # the last chunk: the totals
            yield line
        message = writer.message
        if message["content"] == "" and message["tool_calls"]:
            message["content"] = None
        body = response_body(req, response_id, created_at, "completed" if done else "incomplete",
                             output_items(response_id, message, done), chunk["usage"])
        count_reasoning(body, message, tokenizer)
        finished(body, message)
        yield writer.event("response.completed" if done else "response.incomplete", response=body)
