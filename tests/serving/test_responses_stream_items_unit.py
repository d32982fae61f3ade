"""The Responses API's streamed items as OpenAI sends them: ``response.output_item.added`` opens a message (or
reasoning) item with no content (its part comes with ``response.content_part.added``, so the SDK's snapshot
holds one part), each ``response.output_item.done`` says the status the final Response gives that item (the
item cut at ``max_output_tokens`` is ``incomplete``), and a ``function_call_output`` must answer a call."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from kiln.serving.errors import APIError
from kiln.serving.openai_bodies import Builder
from kiln.serving.responses_protocol import ResponsesRequest
from kiln.serving.responses_store import ResponseStore
from kiln.serving.responses_stream import response_events
from kiln.serving.responses_translate import to_chat, to_response
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

CALL = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def _chunks(pieces, finish):
    builder = Builder("chat", "chatcmpl-x", "tiny", None, None)
    usage = Builder.usage(7, len(pieces), 0)
    out = [builder.chunk(0, text="", role=True, include_usage=True, usage=usage)]
    out += [builder.chunk(0, include_usage=True, usage=usage, **piece) for piece in pieces]
    out.append(builder.chunk(0, text=None, finish_reason=finish, include_usage=True, usage=usage))
    return [*out, builder.usage_chunk(usage)]


def _events(pieces, finish):
    async def lines():
        async def chunks():
            for chunk in _chunks(pieces, finish):
                yield chunk
        req = ResponsesRequest(model="tiny", input="hi")
        return [line async for line in response_events(chunks(), req, "resp_ab12", 1, lambda b, m: None)]

    return [json.loads(line.split("\n")[1].removeprefix("data: ")) for line in asyncio.run(lines())]


def test_an_added_message_item_has_no_content_yet_and_the_sdk_snapshot_one_part():
    events = _events([{"reasoning": "hm"}, {"text": "Hello"}, {"text": " there"}], "stop")
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [(item["type"], item["content"]) for item in added] == [("reasoning", []), ("message", [])]
    state = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    adapter = TypeAdapter(ResponseStreamEvent)
    for body in events[:-1]:
        state.handle_event(adapter.validate_python(body))
    snapshot = state._ResponseStreamState__current_snapshot
    message = next(item for item in snapshot.output if item.type == "message")
    assert [(part.type, part.text) for part in message.content] == [("output_text", "Hello there")]


@pytest.mark.parametrize(("pieces", "finish", "statuses"), [
    ([{"text": "abc"}], "length", ["incomplete"]),
    ([{"reasoning": "hm"}, {"text": "abc"}], "length", ["completed", "incomplete"]),
    ([{"reasoning": "hm"}, {"text": "abc"}], "stop", ["completed", "completed"]),
    ([{"text": "abc"}, {"tool_calls": [CALL]}], "length", ["completed", "incomplete"]),
])
def test_each_item_done_says_the_status_the_final_response_gives_it(pieces, finish, statuses):
    events = _events(pieces, finish)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    final = events[-1]["response"]["output"]
    assert [item["status"] for item in done] == [item["status"] for item in final] == statuses
    assert done == final
    message = {"role": "assistant", "content": "".join(p.get("text", "") for p in pieces) or None,
               "reasoning_content": "".join(p.get("reasoning", "") for p in pieces) or None,
               "tool_calls": [{"id": c["id"], "type": "function", "function": c["function"]}
                              for p in pieces for c in p.get("tool_calls", ())] or None}
    chat = {"choices": [{"message": message, "finish_reason": finish}], "usage": Builder.usage(7, 2, 0)}
    whole = to_response(ResponsesRequest(model="tiny", input="hi"), "resp_ab12", chat)
    assert [item["status"] for item in whole["output"]] == statuses


def _translate(input_, previous=None, store=None):
    body = {"model": "m", "input": input_, **({"previous_response_id": previous} if previous else {})}
    return to_chat(ResponsesRequest.model_validate(body), store or ResponseStore(max_entries=4, ttl_s=60))


def test_a_function_call_output_must_answer_a_call_before_it():
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
    for input_, param in (([{"role": "user", "content": "hi"},
                            {"type": "function_call_output", "call_id": "call_x", "output": "r"}], "input[1].call_id"),
                          ([{"type": "function_call_output", "call_id": "call_1", "output": "r"}, call],
                           "input[0].call_id")):
        with pytest.raises(APIError) as err:
            _translate(input_)
        assert err.value.status == 400 and err.value.param == param and "no tool call found" in err.value.message
    answered = [call, {"type": "function_call_output", "call_id": "call_1", "output": "r"}]
    assert len(_translate(answered).chat.messages) == 2
    store = ResponseStore(max_entries=4, ttl_s=60)  # a call the stored response made is answered in the follow-up
    store.put("resp_1", {}, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}])
    answer = [{"type": "function_call_output", "call_id": "call_9", "output": "r"}]
    assert _translate(answer, "resp_1", store).sources == ["previous_response_id"] * 2 + ["input[0]"]
    with pytest.raises(APIError) as err:
        _translate([{**answer[0], "call_id": "call_8"}], "resp_1", store)
    assert err.value.param == "input[0].call_id"


def test_a_function_call_must_be_answered_in_the_input_that_follows_it():
    """OpenAI's other 400 ("No tool output found for function call ..."): a call, in input or made by the
    response previous_response_id names, left without its function_call_output."""
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
    with pytest.raises(APIError) as err:
        _translate([{"role": "user", "content": "hi"}, call, {"role": "user", "content": "and?"}])
    assert (err.value.param, "no tool output found" in err.value.message) == ("input[1]", True)
    second = {**call, "call_id": "call_2"}  # calls of one turn share a message: each is named as its own item
    with pytest.raises(APIError) as err:
        _translate([{"role": "user", "content": "hi"}, call, second,
                    {"type": "function_call_output", "call_id": "call_1", "output": "r"}])
    assert err.value.param == "input[2]" and "'call_2'" in err.value.message
    store = ResponseStore(max_entries=4, ttl_s=60)
    store.put("resp_1", {}, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}])
    with pytest.raises(APIError) as err:
        _translate("thanks", "resp_1", store)
    assert err.value.param == "previous_response_id" and "'call_9'" in err.value.message
