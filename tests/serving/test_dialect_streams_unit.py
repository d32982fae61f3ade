"""The Messages and Responses renderers over chat chunk bodies made by the chat builder itself: the event
sequences each SDK accumulates, thinking then text then tool calls, stop sequences held back and cut."""

from __future__ import annotations

import asyncio
import json

import anthropic
import openai
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from kiln.serving.anthropic_stream import message_events
from kiln.serving.anthropic_translate import to_message
from kiln.serving.openai_bodies import Builder, ChoiceText
from kiln.serving.responses_protocol import ResponsesRequest
from kiln.serving.responses_stream import response_events
from kiln.serving.responses_translate import to_response
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter


def _chunks(pieces, finish="stop", prompt=7, cached=0):
    """Chat chunk bodies: ``pieces`` are dicts of reasoning / text / tool_calls per chunk."""
    builder = Builder("chat", "chatcmpl-x", "tiny", None, None)
    out, num = [], 0

    def usage():
        return Builder.usage(prompt, num, cached)

    out.append(builder.chunk(0, text="", role=True, include_usage=True, usage=usage()))
    for piece in pieces:
        num += 1
        out.append(builder.chunk(0, include_usage=True, usage=usage(), **piece))
    out.append(builder.chunk(0, text=None, finish_reason=finish, include_usage=True, usage=usage()))
    out.append(builder.usage_chunk(usage()))
    return out


async def _aiter(items):
    for item in items:
        yield item


def _sse(lines):
    events = []
    for line in lines:
        name, data = line.split("\n")[:2]
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


def _run(gen):
    async def take():
        return [line async for line in gen]

    return asyncio.run(take())


CALL = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":'}}
MORE = {"index": 0, "function": {"arguments": ' "Paris"}'}}
PIECES = [{"reasoning": "Let me"}, {"reasoning": " think."}, {"text": "Hello"}, {"text": " there"},
          {"tool_calls": [CALL]}, {"tool_calls": [MORE]}]


def test_messages_events_accumulate_into_the_message_the_sdk_builds():
    events = _sse(_run(message_events(_aiter(_chunks(PIECES, "tool_calls", cached=3)), "msg_1", "tiny", None)))
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    assert [b["content_block"]["type"] for n, b in events if n == "content_block_start"] == ["thinking", "text", "tool_use"]
    assert names.count("content_block_stop") == 3
    message, bufs = None, {}
    adapter = TypeAdapter(anthropic.types.RawMessageStreamEvent)
    for name, body in events:
        if name != "ping":
            message = accumulate_event(event=adapter.validate_python(body), current_snapshot=message, json_bufs=bufs)
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[0].thinking == "Let me think." and message.content[1].text == "Hello there"
    assert message.content[2].input == {"city": "Paris"} and message.stop_reason == "tool_use"
    assert message.usage.input_tokens == 4 and message.usage.cache_read_input_tokens == 3


def test_messages_stream_holds_back_and_cuts_the_stop_sequence():
    pieces = [{"text": "one two E"}, {"text": "N"}, {"text": "D"}]
    events = _sse(_run(message_events(_aiter(_chunks(pieces)), "msg_1", "tiny", ["END", "ENOUGH"])))
    text = "".join(b["delta"]["text"] for n, b in events if n == "content_block_delta")
    assert text == "one two "
    delta = next(b for n, b in events if n == "message_delta")["delta"]
    assert delta == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


def test_messages_stream_error_is_an_error_event():
    chunks = _chunks([{"text": "partial"}])[:2] + [{"error": {"message": "engine died", "type": "server_error"}}]
    events = _sse(_run(message_events(_aiter(chunks), "msg_1", "tiny", None)))
    assert events[-1] == ("error", {"type": "error", "error": {"type": "api_error", "message": "engine died"}})


def _responses(pieces, finish="stop"):
    req = ResponsesRequest(model="tiny", input="hi")
    stored = []
    lines = _run(response_events(_aiter(_chunks(pieces, finish)), req, "resp_ab12", 1, lambda b, m: stored.append(b)))
    return _sse(lines), stored


def test_responses_events_accumulate_in_the_openai_stream_helper():
    events, stored = _responses(PIECES, "tool_calls")
    assert [b["sequence_number"] for _, b in events] == list(range(len(events)))
    assert events[0][0] == "response.created" and events[-1][0] == "response.completed"
    adapter = TypeAdapter(ResponseStreamEvent)
    state = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    for _, body in events:
        state.handle_event(adapter.validate_python(body))
    final = adapter.validate_python(events[-1][1]).response
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Hello there"
    assert final.output[0].content[0].text == "Let me think."
    assert json.loads(final.output[2].arguments) == {"city": "Paris"}
    assert stored == [events[-1][1]["response"]]


def test_responses_cut_at_max_output_tokens_is_incomplete():
    events, _ = _responses([{"text": "abc"}], "length")
    name, body = events[-1]
    assert name == "response.incomplete"
    assert body["response"]["status"] == "incomplete"
    assert body["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_the_response_store_is_bounded_by_count_size_and_time(monkeypatch):
    from kiln.serving import responses_store
    from kiln.serving.responses_store import ResponseStore

    now = [100.0]
    monkeypatch.setattr(responses_store.time, "monotonic", lambda: now[0])
    store = ResponseStore(max_entries=3, ttl_s=10, max_chars=100)
    turn = [{"role": "user", "content": "x" * 40}]
    for rid in ("a", "b", "c"):
        store.put(rid, {"id": rid}, turn)
    assert store.get("a") is None and len(store) == 2  # 3 x 40 characters > 100: the oldest went first
    store.get("b")  # used: "c" is now the least recently used
    store.put("d", {"id": "d"}, turn)
    assert store.get("c") is None and store.get("b") is not None and store.get("d") is not None
    now[0] += 11
    assert store.get("b") is None and store.get("d") is None and len(store) == 0  # expired
    counted = ResponseStore(max_entries=2, ttl_s=10)
    for rid in ("x", "y", "z"):
        counted.put(rid, {"id": rid}, [{"role": "user", "content": "short"}])
    assert counted.get("x") is None and counted.get("z") is not None
    kept_none = ResponseStore(max_entries=0, ttl_s=10)
    kept_none.put("e", {}, turn)
    assert kept_none.get("e") is None


def test_input_items_are_the_request_s_input_with_ids_and_pages_as_openai_lists():
    from kiln.serving.errors import APIError
    from kiln.serving.responses_protocol import ResponsesRequest
    from kiln.serving.responses_store import page_of
    from kiln.serving.responses_translate import input_items

    (only,) = input_items(ResponsesRequest.model_validate({"model": "m", "input": "hi"}))
    assert only["type"] == "message" and only["id"].startswith("msg_") and only["status"] == "completed"
    assert only["role"] == "user" and only["content"] == [{"type": "input_text", "text": "hi"}]
    items = input_items(ResponsesRequest.model_validate({"model": "m", "input": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "id": "msg_mine"},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "c"}]}))
    assert [i["type"] for i in items] == ["message", "message", "function_call", "function_call_output"]
    assert items[1]["id"] == "msg_mine" and items[1]["content"][0]["type"] == "output_text"  # the client's id kept
    assert items[2]["id"].startswith("fc_") and items[3]["id"].startswith("fco_")
    ids = [i["id"] for i in items]
    first = page_of(items, {"limit": "3"})  # newest first by default
    assert [i["id"] for i in first["data"]] == ids[::-1][:3] and first["has_more"] and first["last_id"] == ids[1]
    rest = page_of(items, {"limit": "3", "after": first["last_id"]})
    assert [i["id"] for i in rest["data"]] == ids[:1] and not rest["has_more"]
    assert [i["id"] for i in page_of(items, {"order": "asc", "before": ids[2]})["data"]] == ids[:2]
    assert page_of([], {})["data"] == [] and page_of([], {})["first_id"] is None
    for query, param in (({"limit": "0"}, "limit"), ({"limit": "x"}, "limit"), ({"order": "up"}, "order"),
                         ({"after": "nope"}, "after")):
        with pytest.raises(APIError) as err:
            page_of(items, query)
        assert err.value.status == 400 and err.value.param == param


def test_a_chat_message_is_named_as_the_responses_field_it_came_from():
    """Items and chat messages are not one to one (instructions and a stored conversation come first, the calls of
    one turn share a message): an error about messages[i] names the field that message came from."""
    from kiln.serving.errors import APIError
    from kiln.serving.request_path import in_terms_of
    from kiln.serving.responses_protocol import ResponsesRequest
    from kiln.serving.responses_store import ResponseStore
    from kiln.serving.responses_translate import source_names, to_chat

    store = ResponseStore(max_entries=2, ttl_s=60)
    store.put("resp_1", {}, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    run = to_chat(ResponsesRequest.model_validate({"model": "m", "instructions": "be terse",
                                                   "previous_response_id": "resp_1", "input": [
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "x"},
        {"type": "function_call_output", "call_id": "c2", "output": "y"},
        {"role": "user", "content": "more"}]}), store)
    assert run.sources == ["instructions", "previous_response_id", "previous_response_id", "input[1]", "input[3]",
                           "input[4]", "input[5]"]
    assert len(run.chat.messages) == len(run.sources)
    err = in_terms_of(APIError(400, "messages[6].content: too long", param="messages[6].content"),
                      source_names(run.sources))
    assert (err.param, err.message) == ("input[5].content", "input[5].content: too long")


def _logprob(token, value, k=1):
    entry = {"token": token, "logprob": value, "bytes": list(token.encode())}
    return {**entry, "top_logprobs": [entry] * k}


def test_a_responses_stream_that_fails_ends_with_error_and_response_failed():
    chunks = _chunks([{"text": "partial"}])[:3] + [{"error": {"message": "engine died", "type": "server_error",
                                                              "code": "engine_dead", "param": None}}]
    req = ResponsesRequest(model="tiny", input="hi")
    stored = []
    events = _sse(_run(response_events(_aiter(chunks), req, "resp_ab12", 1, lambda b, m: stored.append((b, m)))))
    adapter = TypeAdapter(ResponseStreamEvent)
    parsed = [adapter.validate_python(body) for _, body in events]
    assert [e.type for e in parsed[-2:]] == ["error", "response.failed"]
    assert parsed[-2].code == "engine_dead" and parsed[-2].message == "engine died"
    failed = parsed[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error" and failed.error.message == "engine died"
    assert failed.output_text == "partial" and failed.output[0].status == "incomplete"
    assert [b["sequence_number"] for _, b in events] == list(range(len(events)))
    # kept as it stood (GET finds it), with no reply: a follow-up continues from its input
    assert stored == [(events[-1][1]["response"], None)]
    state = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    for event in parsed:
        state.handle_event(event)


def test_responses_stream_carries_each_text_deltas_logprobs_and_the_whole_list_last():
    first, second, third = _logprob("Hel", -0.5, 2), _logprob("lo", -0.25, 2), _logprob(" there", -1.0, 2)
    chunks = _chunks([{"text": "Hello"}, {"text": " there"}])
    chunks[1]["choices"][0]["logprobs"] = {"content": [first, second], "refusal": None}
    chunks[2]["choices"][0]["logprobs"] = {"content": [third], "refusal": None}
    req = ResponsesRequest(model="tiny", input="hi", include=["message.output_text.logprobs"], top_logprobs=2)
    events = _sse(_run(response_events(_aiter(chunks), req, "resp_ab12", 1, lambda b, m: None)))
    deltas = [b for n, b in events if n == "response.output_text.delta"]
    assert [d["logprobs"] for d in deltas] == [[first, second], [third]]
    done = next(b for n, b in events if n == "response.output_text.done")
    assert done["logprobs"] == [first, second, third]
    final = TypeAdapter(ResponseStreamEvent).validate_python(events[-1][1]).response
    part = final.output[0].content[0]
    assert [lp.token for lp in part.logprobs] == ["Hel", "lo", " there"] and len(part.logprobs[0].top_logprobs) == 2
    assert final.top_logprobs == 2


def _whole(pieces, finish):
    """The non-streamed chat body for the same pieces (a reasoning parser's split, the calls read)."""
    builder = Builder("chat", "chatcmpl-x", "tiny", None, None)
    thought = "".join(p.get("reasoning", "") for p in pieces)
    choice = ChoiceText(text="".join(p.get("text", "") for p in pieces), finish_reason=finish,
                        reasoning=thought if any("reasoning" in p for p in pieces) else None,
                        tool_calls=[{"id": "call_1", "type": "function",
                                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
                        if any("tool_calls" in p for p in pieces) else None)
    return builder.response([choice], Builder.usage(7, len(pieces), 0))


@pytest.mark.parametrize(("pieces", "finish", "blocks", "items"), [
    ([{"reasoning": "Let me"}, {"reasoning": " think"}], "length", ["thinking"], ["reasoning"]),
    ([], "stop", [], ["message"]),
    ([{"reasoning": "Hm."}, {"text": "Hi"}], "stop", ["thinking", "text"], ["reasoning", "message"]),
    ([{"tool_calls": [CALL]}, {"tool_calls": [MORE]}], "tool_calls", ["tool_use"], ["function_call"]),
])
def test_a_reply_has_the_same_blocks_and_items_streamed_or_not_and_none_empty(pieces, finish, blocks, items):
    """An answer that is all thinking (cut off before it ended) has no empty text block or message item:
    Anthropic refuses an empty text block sent back, and the stream never opens one."""
    whole = _whole(pieces, finish)
    if any("reasoning" in p for p in pieces) and not any("text" in p for p in pieces):
        assert whole["choices"][0]["message"]["content"] is None  # as vLLM's reasoning parsers give it
    message = to_message(whole, "msg_1", None)
    assert [b["type"] for b in message["content"]] == blocks
    assert all(b["text"] for b in message["content"] if b["type"] == "text")
    events = _sse(_run(message_events(_aiter(_chunks(pieces, finish)), "msg_1", "tiny", None)))
    streamed = [b["content_block"]["type"] for n, b in events if n == "content_block_start"]
    assert streamed == blocks
    response = to_response(ResponsesRequest(model="tiny", input="hi"), "resp_ab12", whole)
    assert [item["type"] for item in response["output"]] == items
    events, _ = _responses(pieces, finish)
    assert [item["type"] for item in events[-1][1]["response"]["output"]] == items
