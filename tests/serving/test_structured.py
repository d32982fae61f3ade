"""Structured outputs, tool calling and stream options through the official `openai` client against a
live `kiln serve` of a random-weight model: whatever the model's weights, constrained output parses
and validates, tool calls carry valid arguments, streamed or not."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

M = "tiny"  # conftest.MODEL_NAME

# Bounded strings and numbers: a random model ends inside max_tokens.
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
                                                                         "maximum": 99},
                   "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}},
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]  # no parameters: arguments are {}
ASK = [{"role": "user", "content": "Tell me a story about a lighthouse."}]  # asks for no JSON at all


class Ticket(BaseModel):
    priority: Literal["low", "high"]
    urgent: bool
    count: int = Field(ge=0, le=9)


@pytest.fixture(scope="module")
def srv(start_server):
    # Room for kiln's tools prompt in the toy tokenizer (~350 tokens for TOOLS).
    s = start_server("--max-seq-len", "1024", "--max-input-len", "900", "--num-kv-blocks", "512")
    s.wait_ready()
    return s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)


def schema_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": strict}}


def test_json_schema_strict_non_streamed_and_streamed(client):
    out = client.chat.completions.create(model=M, messages=ASK, max_tokens=120, n=2, temperature=1.0, seed=3,
                                         response_format=schema_format(PERSON))
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    stream = client.chat.completions.create(model=M, messages=ASK, max_tokens=120, stream=True,
                                            response_format=schema_format(PERSON, strict=False))
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_parse_with_a_pydantic_model(client):
    out = client.chat.completions.parse(model=M, messages=ASK, max_tokens=80, response_format=Ticket)
    ticket = out.choices[0].message.parsed
    assert isinstance(ticket, Ticket) and 0 <= ticket.count <= 9


def test_json_object_and_completions_constraints(client, srv):
    out = client.completions.create(model=M, prompt="Once upon a time", max_tokens=120,
                                    extra_body={"response_format": schema_format(PERSON)})
    jsonschema.validate(json.loads(out.choices[0].text), PERSON)
    for extra, check in [({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
                         ({"guided_regex": "[a-c]{2}-[0-9]"}, lambda t: len(t) == 4 and t[2] == "-"),
                         ({"guided_json": WEATHER}, lambda t: jsonschema.validate(json.loads(t), WEATHER) is None)]:
        text = client.completions.create(model=M, prompt="Answer:", max_tokens=40, extra_body=extra).choices[0].text
        assert check(text), (extra, text)
    # Any JSON object: a random model may not close it, so ask for a short one and check the prefix.
    out = client.chat.completions.create(model=M, messages=ASK, max_tokens=8, response_format={"type": "json_object"})
    assert out.choices[0].message.content.startswith("{")


def test_tool_choice_required_and_named(client):
    for choice, names in [("required", {"get_weather", "get_time"}),
                          ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"})]:
        out = client.chat.completions.create(model=M, messages=ASK, max_tokens=120, tools=TOOLS, tool_choice=choice,
                                             parallel_tool_calls=False, temperature=1.0, seed=1)
        message = out.choices[0].message
        assert out.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) == 1
        call = message.tool_calls[0]
        assert call.id.startswith("call_") and call.type == "function" and call.function.name in names
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, WEATHER if call.function.name == "get_weather" else {"const": {}})

        stream = client.chat.completions.create(model=M, messages=ASK, max_tokens=120, tools=TOOLS,
                                                tool_choice=choice, stream=True, temperature=1.0, seed=2,
                                                parallel_tool_calls=False)  # a random model's array would not end
        calls: dict[int, dict] = {}
        reasons = []
        for chunk in stream:
            for choice_delta in chunk.choices:
                reasons.append(choice_delta.finish_reason)
                for d in choice_delta.delta.tool_calls or []:
                    entry = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
                    entry["arguments"] += d.function.arguments or ""
        assert reasons[-1] == "tool_calls" and calls
        for entry in calls.values():
            assert entry["id"].startswith("call_") and entry["name"] in names
            jsonschema.validate(json.loads(entry["arguments"]),
                                WEATHER if entry["name"] == "get_weather" else {"const": {}})


def test_a_tool_result_continues_the_conversation(client):
    first = client.chat.completions.create(model=M, messages=ASK, max_tokens=120, tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 12}'}]
    out = client.chat.completions.create(model=M, messages=history, max_tokens=8, tools=TOOLS)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert out.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt


def test_continuous_usage_stats(client):
    stream = client.chat.completions.create(model=M, messages=ASK, max_tokens=6, stream=True, n=2,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    per_choice: dict[int, list[int]] = {}
    for chunk in chunks[:-1]:
        assert chunk.usage is not None and chunk.usage.prompt_tokens > 0
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        per_choice.setdefault(chunk.choices[0].index, []).append(chunk.usage.completion_tokens)
    for counts in per_choice.values():
        assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 6
    plain = client.completions.create(model=M, prompt="hi", max_tokens=3, stream=True,
                                      stream_options={"include_usage": False, "continuous_usage_stats": True})
    assert all(chunk.usage is None for chunk in plain)


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": schema_format({"type": "object", "properties": {"a": {"type": "wat"}}})},
     "response_format.json_schema"),
    ({"response_format": schema_format({"type": "string", "format": "not-a-format"})}, "response_format.json_schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}],
      "tool_choice": "required"}, "tools"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"response_format": schema_format({"type": "object", "description": "x" * 70000})},
     "response_format.json_schema"),
])
def test_constraints_the_engine_cannot_compile_are_400s(srv, body, param):
    response = httpx.post(f"{srv.url}/v1/chat/completions", timeout=30,
                          json={"model": M, "messages": ASK, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param and param.split("[")[0] in response.json()["error"]["message"]
    assert "Traceback" not in srv.log()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm_request_shape(srv, path):
    """The bodies guidellm (0.8) streams: continuous usage, stop: null, ignore_eos, max_completion_tokens."""
    body = {"model": M, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "stop": None, "ignore_eos": True}
    if path.endswith("chat/completions"):
        body.update(messages=ASK, max_completion_tokens=7)
    else:
        body.update(prompt="The lighthouse keeper", max_tokens=7)
    events = []
    with httpx.stream("POST", f"{srv.url}{path}", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    assert all("error" not in e and e["usage"] is not None for e in events)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 7
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]][-1] == "length"
