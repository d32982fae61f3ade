"""Tool calls read back per model family, streamed or whole; tools and calls rendered into prompts."""

from __future__ import annotations

import json

import pytest
from kiln.engine.structured.tool_format import detect_tool_call_format
from kiln.serving.chat import render_chat
from kiln.serving.constraints import ToolPlan, tool_plan
from kiln.serving.protocol import ChatCompletionRequest
from kiln.serving.tool_calls import AutoToolStream, parse_auto, read_calls

ARGS = {"city": "Paris", "days": 2}
CASES = [  # (format, model output, content expected)
    ("hermes", f'Let me check.\n<tool_call>\n{{"name": "get", "arguments": {json.dumps(ARGS)}}}\n</tool_call>',
     "Let me check."),
    ("hermes", f'<tool_call>{{"name": "get", "arguments": {json.dumps(ARGS)}}}', None),  # no closing tag (EOS)
    ("mistral", f'[TOOL_CALLS][{{"name": "get", "arguments": {json.dumps(ARGS)}}}]', None),
    ("mistral", f'[{{"name": "get", "arguments": {json.dumps(ARGS)}}}]', None),  # marker skipped as special
    ("mistral", f'[TOOL_CALLS]get[ARGS]{json.dumps(ARGS)}', None),  # v11 templates: name, then [ARGS]
    ("mistral", f'Checking. [TOOL_CALLS]get[ARGS] {json.dumps(ARGS)}', "Checking."),
    ("llama3_json", f'<|python_tag|>{{"name": "get", "parameters": {json.dumps(ARGS)}}}', None),
    ("llama3_json", f'{{"name": "get", "parameters": {json.dumps(json.dumps(ARGS))}}}', None),  # args as a string
    ("json", f' [{{"name": "get", "arguments": {json.dumps(ARGS)}}}]', None),
]


def plan(fmt: str, parallel: bool = True) -> ToolPlan:
    return ToolPlan("auto", [], fmt, parallel, None, {"get", "put"})


@pytest.mark.parametrize(("fmt", "text", "content"), CASES)
def test_auto_calls_whole_and_streamed(fmt, text, content):
    got_content, calls = parse_auto(text, plan(fmt))
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get", ARGS)]
    assert calls[0].id.startswith("call_") and len(calls[0].id) == 29
    for step in (1, 4):  # streamed in pieces: content as it comes, the call at the end, nothing twice
        stream = AutoToolStream(plan(fmt))
        sent = "".join(stream.feed(text[i:i + step]) for i in range(0, len(text), step))
        rest, streamed = stream.finish()
        assert (sent + rest).strip() == (content or "")
        assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]


def test_mistral_named_calls_in_parallel_and_refusals():
    text = f'[TOOL_CALLS]get[ARGS]{json.dumps(ARGS)}[TOOL_CALLS]put[ARGS]{{"city": "Rome"}}'
    _, calls = parse_auto(text, plan("mistral"))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get", ARGS), ("put", {"city": "Rome"})]
    assert [c.name for c in parse_auto(text, plan("mistral", parallel=False))[1]] == ["get"]
    for bad in ('[TOOL_CALLS]nope[ARGS]{"a": 1}', '[TOOL_CALLS]get[ARGS]{"a": '):  # unknown tool; cut short
        assert parse_auto(bad, plan("mistral")) == (bad, [])


def test_text_that_is_not_a_call_stays_content():
    for fmt, text in [("hermes", '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>'),
                      ("hermes", "I would use <tool_call> here but"), ("json", "Plain answer [1, 2]"),
                      ("llama3_json", '{"name": "get", "parameters": [1]}'), ("json", "[not json")]:
        content, calls = parse_auto(text, plan(fmt))
        assert (content, calls) == (text, [])
        stream = AutoToolStream(plan(fmt))
        sent = "".join(stream.feed(ch) for ch in text)
        assert sent + stream.finish()[0] == text


def test_streamed_content_waits_only_for_a_possible_marker():
    stream = AutoToolStream(plan("hermes"))
    assert stream.feed("Hello <tool") == "Hello "  # '<tool' may begin '<tool_call>'
    assert stream.feed("s are fun") == "<tools are fun"


def test_parallel_calls_and_constrained_output():
    two = '<tool_call>{"name": "get", "arguments": {}}</tool_call><tool_call>{"name": "put", "arguments": {}}</tool_call>'
    assert [c.name for c in parse_auto(two, plan("hermes"))[1]] == ["get", "put"]
    assert [c.name for c in parse_auto(two, plan("hermes", parallel=False))[1]] == ["get"]
    required = ToolPlan("required", [], "hermes", True, None, {"get"})
    assert read_calls('[{"name": "get", "arguments": {"a": 1}}]', "stop", required)[1][0].arguments == '{"a": 1}'
    # Cut short by max_tokens before any call was complete: no calls, the text stays content so the client
    # sees what came (test_tool_call_blocks_unit has the calls completed before a cut).
    assert read_calls('[{"name": "get", "argu', "length", required) == ('[{"name": "get", "argu', [])
    named = ToolPlan("named", [], "hermes", True, "get", {"get"})
    assert read_calls('{"a":1}', "stop", named)[1][0].arguments == '{"a":1}'  # exactly as streamed


def test_tool_call_format_from_templates():
    assert detect_tool_call_format(None) == "json"
    assert detect_tool_call_format("{{ messages }}") == "json"
    assert detect_tool_call_format("{% if tools %}<tool_call>{{ tools }}{% endif %}") == "hermes"
    assert detect_tool_call_format("{% if tools %}[TOOL_CALLS]{% endif %}") == "mistral"
    assert detect_tool_call_format("{% if tools %}Environment: ipython <|python_tag|>{% endif %}") == "llama3_json"


def chat(tools=True, **extra) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}], **extra}
    if tools:
        body["tools"] = [{"type": "function", "function": {"name": "get", "description": "weather",
                                                           "parameters": {"type": "object"}}}]
    return ChatCompletionRequest.model_validate(body)


class Tokenizer:
    """Renders the template's inputs instead of tokens, to see what the template was given."""

    def __init__(self, template: str) -> None:
        self.chat_template = template
        self.seen: dict = {}

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, **kwargs):
        self.seen = {"messages": messages, **kwargs}
        return "x"

    def encode(self, text, add_special_tokens):
        return [1]


def test_native_templates_get_tools_and_calls_as_objects():
    tokenizer = Tokenizer("{% for t in tools %}<tool_call>{% endfor %}")
    req = chat()
    render_chat(req, tokenizer, tool_plan(req, "hermes"))
    assert tokenizer.seen["tools"][0]["function"]["name"] == "get"
    assistant, tool = tokenizer.seen["messages"][1:]
    assert assistant["tool_calls"][0]["function"] == {"name": "get", "arguments": {"city": "Paris"}}
    assert tool == {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}


def test_templates_without_tools_get_kiln_json_format():
    tokenizer = Tokenizer("{{ messages }}")
    req = chat()
    render_chat(req, tokenizer, tool_plan(req, "json"))
    system, _, assistant, _ = tokenizer.seen["messages"]
    assert "tools" not in tokenizer.seen and system["role"] == "system" and '"name": "get"' in system["content"]
    assert json.loads(assistant["content"]) == [{"name": "get", "arguments": {"city": "Paris"}}]
    render_chat(chat(tools=False), tokenizer, None)  # history with calls, no tools offered now
    assert [m["role"] for m in tokenizer.seen["messages"]] == ["user", "assistant", "tool"]
