"""Anthropic's Messages API through the official `anthropic` SDK against a live `kiln serve` of a
random-weight model: greedy text equals the chat endpoint's for the same conversation, streamed or not;
forced tool calls carry input valid for the tool's schema; JSON-schema output parses; stop sequences,
usage (with prefix-cache reads) and count_tokens agree with what the chat endpoint reports."""

from __future__ import annotations

from typing import Literal

import anthropic
import jsonschema
import openai
import pytest
from pydantic import BaseModel

M = "tiny"
SYSTEM = "You are terse."
GREEDY = {"temperature": 0}  # the 2.x SDK passes sampling settings through extra_body
ASK = [{"role": "user", "content": "Tell me a story about a lighthouse."}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER},
         {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}]


class Ticket(BaseModel):
    priority: Literal["low", "high"]
    urgent: bool


@pytest.fixture(scope="module")
def srv(start_server):
    s = start_server("--max-seq-len", "1024", "--max-input-len", "900", "--num-kv-blocks", "512")
    s.wait_ready()
    return s


@pytest.fixture(scope="module")
def client(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def chat(srv):
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _chat_greedy(chat, max_tokens, **kw):
    return chat.chat.completions.create(model=M, messages=[{"role": "system", "content": SYSTEM}, *ASK],
                                        max_tokens=max_tokens, extra_body=GREEDY, **kw)


def test_greedy_text_equals_chat_streamed_or_not(client, chat):
    want = _chat_greedy(chat, 12)
    got = client.messages.create(model=M, system=SYSTEM, messages=ASK, max_tokens=12, extra_body=GREEDY)
    assert got.type == "message" and got.role == "assistant" and got.id.startswith("msg_")
    assert [b.type for b in got.content] == ["text"]
    assert got.content[0].text == want.choices[0].message.content
    assert got.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[want.choices[0].finish_reason]
    assert got.usage.input_tokens + got.usage.cache_read_input_tokens == want.usage.prompt_tokens
    assert got.usage.output_tokens == want.usage.completion_tokens
    with client.messages.stream(model=M, system=SYSTEM, messages=ASK, max_tokens=12, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == got.content[0].text == final.content[0].text
    assert final.stop_reason == got.stop_reason and final.usage.output_tokens == got.usage.output_tokens


def test_the_prefix_cache_shows_as_cache_reads(client):
    first = client.messages.create(model=M, system=SYSTEM * 20, messages=ASK, max_tokens=2, extra_body=GREEDY)
    again = client.messages.create(model=M, system=SYSTEM * 20, messages=ASK, max_tokens=2, extra_body=GREEDY)
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == total


def test_count_tokens_equals_the_prompt_the_reply_counts(client):
    for tools in (None, TOOLS):
        kw = {"tools": tools} if tools else {}
        counted = client.messages.count_tokens(model=M, system=SYSTEM, messages=ASK, **kw)
        got = client.messages.create(model=M, system=SYSTEM, messages=ASK, max_tokens=1, **kw)
        assert counted.input_tokens == got.usage.input_tokens + got.usage.cache_read_input_tokens


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_forced_tool_use_streamed_or_not(client, choice):
    got = client.messages.create(model=M, messages=ASK, max_tokens=120, tools=TOOLS, tool_choice=choice | {
        "disable_parallel_tool_use": True})
    assert got.stop_reason == "tool_use"
    uses = [b for b in got.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name in ("get_weather", "get_time")
    if uses[0].name == "get_weather":
        jsonschema.validate(uses[0].input, WEATHER)
    with client.messages.stream(model=M, messages=ASK, max_tokens=120, tools=TOOLS, tool_choice=choice | {
            "disable_parallel_tool_use": True}) as stream:
        final = stream.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and len(uses) == 1 and isinstance(uses[0].input, dict)
    assert uses[0].id.startswith("toolu_") and got.content[-1].id.startswith("toolu_")  # Anthropic's spelling


def test_a_tool_result_continues_and_none_means_no_call(client):
    first = client.messages.create(model=M, messages=ASK, max_tokens=120, tools=TOOLS,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    use = next(b for b in first.content if b.type == "tool_use")
    history = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "12 C"},
                                            {"type": "text", "text": "And tomorrow?"}]}]
    out = client.messages.create(model=M, messages=history, max_tokens=8, tools=TOOLS, tool_choice={"type": "none"})
    assert out.stop_reason in ("end_turn", "max_tokens") and [b.type for b in out.content] == ["text"]
    # A result that answers no call, or a call left unanswered, is Anthropic's 400, naming the block.
    stray = [*history[:-1], {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}]
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[2\]\.content\[0\]\.tool_use_id: 'toolu_x'"):
        client.messages.create(model=M, messages=stray, max_tokens=8)
    unanswered = [*history[:-1], {"role": "user", "content": "And tomorrow?"}]
    with pytest.raises(anthropic.BadRequestError, match=rf"messages\[2\]: tool_use ids '{use.id}' of messages\[1\]"):
        client.messages.create(model=M, messages=unanswered, max_tokens=8)


def test_json_schema_output_and_parse(client):
    schema = Ticket.model_json_schema()
    out = client.messages.create(model=M, messages=ASK, max_tokens=80,
                                 output_config={"format": {"type": "json_schema", "schema": schema}})
    Ticket.model_validate_json(out.content[0].text)
    parsed = client.messages.parse(model=M, messages=ASK, max_tokens=80, output_format=Ticket)
    assert isinstance(parsed.parsed_output, Ticket)


def test_stop_sequences_name_the_one_that_ended_it(client, chat):
    text = client.messages.create(model=M, messages=ASK, max_tokens=16, extra_body=GREEDY).content[0].text
    stop = text[4:6]
    assert len(stop) == 2, text
    got = client.messages.create(model=M, messages=ASK, max_tokens=16, extra_body=GREEDY, stop_sequences=[stop])
    assert got.stop_reason == "stop_sequence" and got.stop_sequence == stop
    assert got.content[0].text == text[: text.index(stop)]
    with client.messages.stream(model=M, messages=ASK, max_tokens=16, extra_body=GREEDY, stop_sequences=[stop]) as s:
        assert "".join(s.text_stream) == got.content[0].text
        assert s.get_final_message().stop_sequence == stop


def test_thinking_is_accepted_and_ignored_without_a_reasoning_parser(client):
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}):
        out = client.messages.create(model=M, messages=ASK, max_tokens=4, extra_body=GREEDY, thinking=thinking)
        assert [b.type for b in out.content] == ["text"]


PREFILL = [*ASK, {"role": "assistant", "content": "Once upon a time"}]


def test_a_final_assistant_message_is_continued_as_the_completions_endpoint_continues_its_rendering(srv, client, chat):
    """Anthropic's prefill: the reply continues the final assistant text. The conversation rendered up to that
    text (chat's continue_final_message, as /tokenize gives it) and run as a plain prompt answers the same tokens."""
    import httpx

    ids = httpx.post(f"{srv.url}/tokenize", json={"model": M, "messages": [{"role": "system", "content": SYSTEM},
                     *PREFILL], "add_generation_prompt": False, "continue_final_message": True}).json()["tokens"]
    text = chat.completions.create(model=M, prompt=ids, max_tokens=10, extra_body=GREEDY).choices[0].text
    got = client.messages.create(model=M, system=SYSTEM, messages=PREFILL, max_tokens=10, extra_body=GREEDY)
    assert got.content[0].text == text
    with client.messages.stream(model=M, system=SYSTEM, messages=PREFILL, max_tokens=10, extra_body=GREEDY) as s:
        assert "".join(s.text_stream) == text
    rendered = httpx.post(f"{srv.url}/detokenize", json={"model": M, "tokens": ids}).json()["prompt"]
    assert rendered.endswith("Once upon a time")  # no end of turn, no new assistant header after it
    keyed = httpx.post(f"{srv.url}/v1/prefix_cache/keys?endpoint=/v1/messages", json={
        "model": M, "system": SYSTEM, "messages": PREFILL, "max_tokens": 10}).json()["num_prompt_tokens"]
    counted = client.messages.count_tokens(model=M, system=SYSTEM, messages=PREFILL).input_tokens
    assert counted == keyed == len(ids)
    assert got.usage.input_tokens + (got.usage.cache_read_input_tokens or 0) == len(ids)


def test_prefill_edges_are_anthropics(client):
    empty = client.messages.create(model=M, messages=[*ASK, {"role": "assistant", "content": ""}], max_tokens=4,
                                   extra_body=GREEDY)
    assert empty.content[0].text == client.messages.create(model=M, messages=ASK, max_tokens=4,
                                                           extra_body=GREEDY).content[0].text
    with pytest.raises(anthropic.BadRequestError, match="trailing whitespace") as err:
        client.messages.create(model=M, messages=[*ASK, {"role": "assistant", "content": "Once "}], max_tokens=4)
    assert err.value.body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(("body", "says"), [
    ({"add_generation_prompt": True, "continue_final_message": True}, "cannot both be true"),
    ({"add_generation_prompt": False, "continue_final_message": True,
      "messages": [*ASK, {"role": "assistant", "content": " "}]}, "no text to continue"),
])
def test_chat_continue_final_message_misuse_is_a_400_naming_it(chat, body, says):
    extra = {"add_generation_prompt": body["add_generation_prompt"],
             "continue_final_message": body["continue_final_message"]}
    with pytest.raises(openai.BadRequestError, match=says) as err:
        chat.chat.completions.create(model=M, messages=body.get("messages", PREFILL), max_tokens=4, extra_body=extra)
    assert err.value.body["param"] == "continue_final_message"


TICKET_FORMAT = {"format": {"type": "json_schema", "schema": Ticket.model_json_schema()}}


@pytest.mark.parametrize("prefill", ["{", '{"priority": "'])
def test_a_prefill_is_continued_by_the_structured_output_it_begins(client, chat, prefill):
    """A prefill with output_config.format: the grammar goes on from the prefill's text, so the prefill and the reply
    make one object (the reply never opens a second '{'), streamed or not; chat's continue_final_message alike."""
    messages = [*ASK, {"role": "assistant", "content": prefill}]
    got = client.messages.create(model=M, messages=messages, max_tokens=80, output_config=TICKET_FORMAT,
                                 extra_body=GREEDY)
    Ticket.model_validate_json(prefill + got.content[0].text)
    with client.messages.stream(model=M, messages=messages, max_tokens=80, output_config=TICKET_FORMAT,
                                extra_body=GREEDY) as stream:
        assert "".join(stream.text_stream) == got.content[0].text
    reply = chat.chat.completions.create(model=M, messages=messages, max_tokens=80, response_format={
        "type": "json_schema", "json_schema": {"name": "ticket", "schema": Ticket.model_json_schema()}},
        extra_body={**GREEDY, "add_generation_prompt": False, "continue_final_message": True})
    Ticket.model_validate_json(prefill + reply.choices[0].message.content)


@pytest.mark.parametrize(("prefill", "fields", "param"), [
    ("Sure", {"output_config": TICKET_FORMAT}, "output_config.format"),  # no JSON object begins so
    ("{", {"tools": TOOLS, "tool_choice": {"type": "any"}}, "tool_choice"),  # a forced call is the whole reply
    ("{", {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_weather"}}, "tool_choice"),
])
def test_a_prefill_the_constraint_cannot_continue_is_a_400_naming_it(client, prefill, fields, param):
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=M, messages=[*ASK, {"role": "assistant", "content": prefill}], max_tokens=8,
                               **fields)
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert err.value.body["error"]["message"].startswith(f"{param}: "), err.value.body


@pytest.mark.parametrize(("fields", "says"), [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
     "messages[0].content[0].text: text content blocks must be non-empty"),
    ({"messages": [*ASK, {"role": "assistant", "content": "Hi."},
                   {"role": "user", "content": [{"type": "text", "text": "Go on."}, {"type": "text", "text": " \n"}]}]},
     "messages[2].content[1].text: text content blocks must contain non-whitespace text"),
    ({"messages": ASK, "system": [{"type": "text", "text": ""}]}, "system[0].text: text content blocks must be"),
    ({"messages": [{"role": "user", "content": ""}]}, "messages[0].content: all messages must have non-empty content"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content: all messages must have non-empty content"),
    ({"messages": [*ASK, {"role": "assistant", "content": "  "}]}, "messages[1]: final assistant content cannot end"),
])
def test_empty_text_is_anthropics_400_naming_the_field(client, fields, says):
    """As Anthropic's API: text blocks hold text, every message but a final assistant one holds content (a final
    assistant message that is blank is a prefill ending in whitespace); counting tokens refuses them alike."""
    for call in (client.messages.create, client.messages.count_tokens):
        with pytest.raises(anthropic.BadRequestError) as err:
            call(model=M, **({"max_tokens": 4} if call == client.messages.create else {}), **fields)
        assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
        assert err.value.body["error"]["message"].startswith(says), err.value.body
