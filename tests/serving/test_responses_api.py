"""OpenAI's Responses API through the official `openai` SDK against a live `kiln serve` of a random-weight
model: greedy text equals the chat endpoint's (and the Messages API's) for the same prompt, streamed or
not; forced function calls carry arguments valid for their schema; text.format constrains; stored
responses continue with previous_response_id (reading the prefix cache), and are got and deleted."""

from __future__ import annotations

import json
from typing import Literal

import anthropic
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

M = "tiny"
SYSTEM = "You are terse."
ASK = "Tell me a story about a lighthouse."
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER,
          "strict": True},
         {"type": "function", "name": "get_time", "parameters": None}]


class Ticket(BaseModel):
    priority: Literal["low", "high"]
    urgent: bool


@pytest.fixture(scope="module")
def srv(start_server):
    # One pinned kernel (--tactics aten): on 'auto' a table timed in the background swaps in between requests,
    # and logprobs compared across requests would then come from different kernels.
    s = start_server("--max-seq-len", "1024", "--max-input-len", "900", "--num-kv-blocks", "512",
                     "--responses-store-size", "4", "--tactics", "aten")
    s.wait_ready()
    return s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_greedy_text_is_the_same_in_chat_messages_and_responses(client, srv):
    chat = client.chat.completions.create(model=M, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}])
    messages = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0).messages.create(
        model=M, system=SYSTEM, messages=[{"role": "user", "content": ASK}], max_tokens=12,
        extra_body={"temperature": 0})
    got = client.responses.create(model=M, instructions=SYSTEM, input=ASK, max_output_tokens=12, temperature=0)
    text = chat.choices[0].message.content
    assert got.output_text == messages.content[0].text == text and text
    assert got.object == "response" and got.id.startswith("resp_") and got.model == M
    assert got.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert got.usage.input_tokens == chat.usage.prompt_tokens
    assert got.usage.output_tokens == chat.usage.completion_tokens
    stream = client.responses.create(model=M, instructions=SYSTEM, input=ASK, max_output_tokens=12, temperature=0,
                                     stream=True)
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert events[-1].response.output_text == text


def test_the_sdk_stream_helper_accumulates_the_events(client):
    # Cut at max_output_tokens, as OpenAI ends it: response.incomplete (the helper's final response is a completed one).
    with client.responses.stream(model=M, input=ASK, max_output_tokens=10, temperature=0) as stream:
        events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert deltas == events[-1].response.output_text and events[-1].response.output[0].type == "message"


@pytest.mark.parametrize("choice", [{"type": "function", "name": "get_weather"}, "required"])
def test_forced_function_calls_streamed_or_not(client, choice):
    got = client.responses.create(model=M, input=ASK, max_output_tokens=120, tools=TOOLS, tool_choice=choice,
                                  parallel_tool_calls=False)
    calls = [item for item in got.output if item.type == "function_call"]
    assert got.status == "completed" and len(calls) == 1 and calls[0].call_id
    if calls[0].name == "get_weather":
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    with client.responses.stream(model=M, input=ASK, max_output_tokens=120, tools=TOOLS, tool_choice=choice,
                                 parallel_tool_calls=False) as stream:
        arguments = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    calls = [item for item in final.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].arguments == arguments and isinstance(json.loads(arguments), dict)


def test_a_function_result_continues_the_conversation(client):
    first = client.responses.create(model=M, input=ASK, max_output_tokens=120, tools=TOOLS,
                                    tool_choice={"type": "function", "name": "get_weather"})
    call = next(item for item in first.output if item.type == "function_call")
    out = client.responses.create(model=M, max_output_tokens=6, tools=TOOLS, tool_choice="none", input=[
        {"role": "user", "content": [{"type": "input_text", "text": ASK}]},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "12 C"}])
    assert [item.type for item in out.output] == ["message"]


def test_text_format_json_schema_and_parse(client):
    out = client.responses.create(model=M, input=ASK, max_output_tokens=80, text={"format": {
        "type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}})
    jsonschema.validate(json.loads(out.output_text), WEATHER)
    parsed = client.responses.parse(model=M, input=ASK, max_output_tokens=80, text_format=Ticket)
    assert isinstance(parsed.output_parsed, Ticket)
    obj = client.responses.create(model=M, input=ASK, max_output_tokens=6, text={"format": {"type": "json_object"}})
    assert obj.output_text.startswith("{")


def test_previous_response_id_continues_from_the_prefix_cache(client):
    first = client.responses.create(model=M, instructions=SYSTEM, input=ASK * 3, max_output_tokens=8, temperature=0)
    follow = client.responses.create(model=M, instructions=SYSTEM, previous_response_id=first.id,
                                     input="And then?", max_output_tokens=8, temperature=0)
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert follow.usage.input_tokens_details.cached_tokens >= 16
    # The same conversation sent whole renders the same prompt.
    whole = client.responses.create(model=M, instructions=SYSTEM, max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": ASK * 3}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"}])
    assert whole.usage.input_tokens == follow.usage.input_tokens and whole.output_text == follow.output_text
    # The SDK's responses.input_tokens.count renders the prompt the same way, stored conversation, tools and all.
    counted = client.responses.input_tokens.count(model=M, instructions=SYSTEM, previous_response_id=first.id,
                                                  input="And then?")
    assert counted.object == "response.input_tokens" and counted.input_tokens == follow.usage.input_tokens
    with_tools = client.responses.input_tokens.count(model=M, input=ASK, tools=TOOLS)
    assert with_tools.input_tokens > client.responses.input_tokens.count(model=M, input=ASK).input_tokens
    with pytest.raises(openai.BadRequestError, match="input"):
        client.responses.input_tokens.count(model=M, input=[{"type": "input_image", "image_url": "x"}])


def test_stored_responses_are_got_deleted_and_bounded(client, srv):
    made = client.responses.create(model=M, input=ASK, max_output_tokens=4)
    assert client.responses.retrieve(made.id).output_text == made.output_text
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError, match="no response"):
        client.responses.retrieve(made.id)
    # The SDK's responses.input_items.list: what it was asked, paged newest first as OpenAI pages.
    asked = client.responses.create(model=M, max_output_tokens=2, input=[
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}])
    listed = list(client.responses.input_items.list(asked.id, limit=2))  # the SDK follows has_more/after
    assert [item.content[0].text for item in listed] == ["c", "b", "a"] and len({i.id for i in listed}) == 3
    page = client.responses.input_items.list(asked.id, order="asc", limit=1)
    assert page.data[0].content[0].text == "a" and page.has_more and page.data[0].role == "user"
    with pytest.raises(openai.BadRequestError, match="limit"):
        client.responses.input_items.list(asked.id, limit=500)
    unstored = client.responses.create(model=M, input=ASK, max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(unstored.id)
    ids = [client.responses.create(model=M, input=ASK, max_output_tokens=2).id for _ in range(5)]
    with pytest.raises(openai.NotFoundError):  # --responses-store-size 4: the oldest went first
        client.responses.retrieve(ids[0])
    assert client.responses.retrieve(ids[-1]).id == ids[-1]
    missing = httpx.post(f"{srv.url}/v1/responses", json={"model": M, "input": "x", "previous_response_id": "resp_0"})
    assert missing.status_code == 400, missing.text  # OpenAI's: a 400 its clients read to resend the conversation
    assert missing.json()["error"] | {"message": ""} == {"message": "", "type": "invalid_request_error",
                                                         "param": "previous_response_id",
                                                         "code": "previous_response_not_found"}
    assert missing.json()["error"]["param"] == "previous_response_id"


def test_logprobs_are_chats_for_the_same_greedy_tokens_streamed_or_not(client):
    chat = client.chat.completions.create(model=M, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                                          messages=[{"role": "user", "content": ASK}])
    # Tokens exactly; logprobs to 1e-4: a later request reads the prompt's blocks from the prefix cache, so its
    # last prefill row is computed in a smaller GEMM than the first request's (same kernel, other blocking).
    want = [(lp.token, pytest.approx(lp.logprob, abs=1e-4), [t.token for t in lp.top_logprobs])
            for lp in chat.choices[0].logprobs.content]
    asked = {"model": M, "input": ASK, "max_output_tokens": 6, "temperature": 0, "store": False,
             "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    got = client.responses.create(**asked)
    part = got.output[0].content[0]
    assert [(lp.token, lp.logprob, [t.token for t in lp.top_logprobs]) for lp in part.logprobs] == want
    assert len(want) == got.usage.output_tokens and got.top_logprobs == 2
    with client.responses.stream(**asked) as stream:
        events = list(stream)
    deltas = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    final = events[-1].response  # response.completed, or response.incomplete at max_output_tokens
    assert deltas == [w[0] for w in want]
    assert [lp.logprob for lp in final.output[0].content[0].logprobs] == [w[1] for w in want]
    plain = client.responses.create(model=M, input=ASK, max_output_tokens=6, temperature=0, store=False,
                                    top_logprobs=2)  # top_logprobs without the include: none, as OpenAI
    assert plain.output[0].content[0].logprobs == []


@pytest.mark.parametrize("truncation", ["auto", "disabled", None])
def test_truncation_is_echoed_as_asked(client, truncation):
    """The Response echoes the truncation asked (OpenAI's default, disabled, when none is), created, streamed and
    stored alike. Under auto a single input item over the engine's max_input_len is still a 400 naming input: the
    last exchange is never dropped."""
    asked = {"model": M, "input": ASK, "max_output_tokens": 2, **({"truncation": truncation} if truncation else {})}
    want = truncation or "disabled"
    made = client.responses.create(**asked)
    assert made.truncation == want and client.responses.retrieve(made.id).truncation == want
    events = list(client.responses.create(**asked, stream=True))
    assert [events[0].response.truncation, events[-1].response.truncation] == [want, want]
    with pytest.raises(openai.BadRequestError, match="max_input_len") as err:
        client.responses.create(**{**asked, "input": "word " * 2000})
    assert err.value.body["param"] == "input"


def _exchange(k: int) -> list[dict]:
    """One turn of a long conversation: a question, a tool call and its output, an answer (about 150 tokens)."""
    call = f"call_{k}"
    return [{"role": "user", "content": f"Question {k}: " + "tell me more " * 30},
            {"type": "function_call", "call_id": call, "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": call, "output": f"{k} o'clock"},
            {"role": "assistant", "content": f"Answer {k}: " + "there is more " * 20}]


def test_truncation_auto_drops_the_oldest_turns_until_the_input_fits(client, srv):
    """OpenAI's truncation "auto": a conversation over max_input_len (900 here) loses its oldest whole turns after
    the instructions, the fewest that make it fit; disabled refuses it, naming input."""
    items = [item for k in range(8) for item in _exchange(k)] + [{"role": "user", "content": "And now?"}]
    asked = {"model": M, "instructions": SYSTEM, "input": items, "tools": TOOLS, "max_output_tokens": 4}
    with pytest.raises(openai.BadRequestError, match="max_input_len") as err:
        client.responses.create(**asked)
    assert err.value.body["param"] == "input"

    def count(kept: list[dict]) -> int:
        body = {key: asked[key] for key in ("model", "instructions", "tools")} | {"input": kept}
        answer = httpx.post(f"{srv.url}/v1/responses/input_tokens", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.json()["input_tokens"]

    # The fewest whole turns dropped from the front: the longest suffix of turns that fits with the output's room.
    suffixes = [items[4 * k:] for k in range(9)]
    want = next(n for n in map(count, suffixes) if n + 4 <= 900)
    made = client.responses.create(**asked, truncation="auto")
    assert made.truncation == "auto" and made.status in ("completed", "incomplete")
    assert made.usage.input_tokens == want and 4 * 150 < want <= 896
    follow = client.responses.create(model=M, previous_response_id=made.id, input="Once more?", max_output_tokens=2,
                                     truncation="auto")
    assert follow.usage.input_tokens <= 898  # the stored conversation keeps every item; each request is cut anew
    stored = httpx.get(f"{srv.url}/v1/responses/{made.id}/input_items", params={"limit": 100}, timeout=30).json()
    assert len(stored["data"]) == len(items)
