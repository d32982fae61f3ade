"""Messages API edge cases without a server: text held back for ``stop_sequences`` goes out before a tool call
begins (one text block, then the tool_use block, as the unstreamed reply has it), and a ``tool_result`` in the
first message is refused without naming a message before it that does not exist."""

from __future__ import annotations

import asyncio
import json

import anthropic
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from kiln.serving.anthropic_protocol import MessagesRequest
from kiln.serving.anthropic_stream import message_events
from kiln.serving.anthropic_translate import chat_messages, to_message
from kiln.serving.errors import APIError
from kiln.serving.openai_bodies import Builder
from pydantic import TypeAdapter

CALL = {"index": 0, "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "x"}'}}


def _events(pieces, finish, stops):
    builder = Builder("chat", "chatcmpl-x", "tiny", None, None)
    usage = Builder.usage(7, len(pieces), 0)
    chunks = [builder.chunk(0, text="", role=True, include_usage=True, usage=usage)]
    chunks += [builder.chunk(0, include_usage=True, usage=usage, **piece) for piece in pieces]
    chunks += [builder.chunk(0, text=None, finish_reason=finish, include_usage=True, usage=usage),
               builder.usage_chunk(usage)]

    async def lines():
        async def aiter():
            for chunk in chunks:
                yield chunk
        return [line async for line in message_events(aiter(), "msg_1", "tiny", stops)]

    return [json.loads(line.split("\n")[1].removeprefix("data: ")) for line in asyncio.run(lines())]


def test_held_back_text_goes_out_before_the_tool_call_that_follows_it():
    events = _events([{"text": "hello E"}, {"tool_calls": [CALL]}], "tool_calls", ["END"])
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["text", "tool_use"]
    message, bufs = None, {}
    adapter = TypeAdapter(anthropic.types.RawMessageStreamEvent)
    for body in events:
        if body["type"] != "ping":
            message = accumulate_event(event=adapter.validate_python(body), current_snapshot=message, json_bufs=bufs)
    chat = {"model": "tiny", "usage": Builder.usage(7, 2, 0), "choices": [{"finish_reason": "tool_calls", "message": {
        "content": "hello E", "tool_calls": [{"id": "call_1", "type": "function", "function": CALL["function"]}]}}]}
    whole = to_message(chat, "msg_1", ["END"])
    assert [b.model_dump(include={"type", "text", "input"}, exclude_none=True) for b in message.content] == \
        [{k: v for k, v in b.items() if k in ("type", "text", "input")} for b in whole["content"]]
    assert message.content[0].text == "hello E" and message.stop_reason == whole["stop_reason"] == "tool_use"


def test_a_tool_result_in_the_first_message_names_no_message_before_it():
    req = MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "r"}]}]})
    with pytest.raises(APIError) as err:
        chat_messages(req)
    assert err.value.param == "messages[0].content[0].tool_use_id" and "messages[-1]" not in err.value.message
