"""Tool calls read block by block (issue 31): valid calls kept wherever they are, every other part of
the output content; text that cannot begin a call streams at once; a required/named call list cut by
max_tokens keeps the calls completed before the cut."""

from __future__ import annotations

import json

import pytest
from kiln.serving.constraints import ToolPlan
from kiln.serving.response_stream import _ChoiceStream
from kiln.serving.tool_calls import AutoToolStream, finish_reason_with, parse_auto, read_calls

ARGS = {"city": "Paris", "days": 2}
GET = json.dumps({"name": "get", "arguments": ARGS})
PUT = json.dumps({"name": "put", "arguments": {"city": "Rome"}})
GET_P = json.dumps({"name": "get", "parameters": ARGS})  # Llama 3's key
PUT_P = json.dumps({"name": "put", "parameters": {"city": "Rome"}})
NOPE = json.dumps({"name": "nope", "arguments": {}})


def plan(fmt: str, parallel: bool = True) -> ToolPlan:
    return ToolPlan("auto", [], fmt, parallel, None, {"get", "put"})


# (format, model output, content, the calls' names, whether the content after the last call streams
# before the end: an unclosed Hermes block waits for a `</tool_call>` that would make it one block)
BLOCKS = [
    ("hermes", f"Let me check.\n<tool_call>\n{GET}\n</tool_call>\nI will report back.",
     "Let me check.\n\nI will report back.", ["get"], True),
    ("hermes", f"<tool_call>{GET}</tool_call>\nThen:\n<tool_call>{PUT}</tool_call>\nDone.", "Then:\n\nDone.",
     ["get", "put"], True),
    ("hermes", f"<tool_call>{NOPE}</tool_call>\n<tool_call>{GET}</tool_call>", f"<tool_call>{NOPE}</tool_call>",
     ["get"], True),  # a block that is not a call stays content; the valid one is kept
    ("hermes", f"<tool_call>{GET}\nDone.", "Done.", ["get"], False),  # no closing tag
    ("mistral", f"[TOOL_CALLS][{GET}] I asked for the weather.", "I asked for the weather.", ["get"], True),
    ("mistral", f"[TOOL_CALLS]get[ARGS]{json.dumps(ARGS)}\nWaiting for the result.", "Waiting for the result.",
     ["get"], True),
    ("mistral", f'Sure.[TOOL_CALLS]get[ARGS]{json.dumps(ARGS)}[TOOL_CALLS]put[ARGS]{{"city": "Rome"}} Both asked.',
     "Sure. Both asked.", ["get", "put"], True),
    ("mistral", f"[{GET}]\nDone.", "Done.", ["get"], True),  # [TOOL_CALLS] skipped as a special token
    ("llama3_json", f"<|python_tag|>{GET_P}\nDone.", "Done.", ["get"], True),
    ("llama3_json", f"{GET_P}; {PUT_P}\nDone.", "Done.", ["get", "put"], True),
    ("json", f"[{GET}, {PUT}]\nI called both.", "I called both.", ["get", "put"], True),
    ("json", f"[{GET}] [1] is the first source.", "[1] is the first source.", ["get"], True),
]


@pytest.mark.parametrize(("fmt", "text", "content", "names", "early"), BLOCKS)
def test_calls_followed_by_text_whole_and_streamed(fmt, text, content, names, early):
    got_content, calls = parse_auto(text, plan(fmt))
    assert (got_content, [c.name for c in calls]) == (content, names)
    assert all(json.loads(c.arguments) for c in calls)
    for step in (1, 3, 7):
        stream = AutoToolStream(plan(fmt))
        sent = "".join(stream.feed(text[i:i + step]) for i in range(0, len(text), step))
        rest, streamed = stream.finish()
        assert (sent + rest).strip() == content
        assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
        if early:  # the text after the calls came as it was generated, not at the end
            assert content.splitlines()[-1] in sent


@pytest.mark.parametrize(("fmt", "pieces", "held"), [
    ("mistral", ["[", "1", "]", " First", " point.\n", "[2] Second", " point."], 3),
    ("json", [" ", "[", "1", "]", " First", " point.\n", "[2] Second", " point."], 4),
    ("json", ["[", "Click", " here](https://x.y)", " to see."], 2),
    ("llama3_json", ["{", "x", "}", " is a set."], 3),
    ("llama3_json", ["{", '"a"', ": 1}", " is an object."], 3),  # JSON, but not a call
])
def test_text_that_cannot_begin_a_call_streams_at_once(fmt, pieces, held):
    stream = AutoToolStream(plan(fmt))
    outs = [stream.feed(p) for p in pieces]
    assert "".join(outs[:held]) == "".join(pieces[:held])  # out as soon as it cannot be a call
    assert outs[held:] == pieces[held:]  # then every delta as it comes
    assert stream.finish() == ("", [])


def test_required_calls_cut_by_max_tokens_keep_the_completed_ones():
    required = ToolPlan("required", [], "hermes", True, None, {"get", "put"})
    text = ('[{"name": "get", "arguments": {"a": 1}}, {"name": "put", "arguments": {}}, '
            '{"name": "get", "arguments": {"a": 1}}, {"name": "get", "argu')  # repeating until the limit
    content, calls = read_calls(text, "length", required)
    assert content == ""
    assert [(c.name, c.arguments) for c in calls] == [("get", '{"a": 1}'), ("put", "{}"), ("get", '{"a": 1}')]
    assert finish_reason_with(calls, "length") == "length"
    stream = _ChoiceStream(required)  # streamed: the calls come when the choice ends
    assert all(stream.content(text[i:i + 5]) == (None, None) for i in range(0, len(text), 5))
    content, deltas, reason = stream.finish("length")
    assert content is None and reason == "length"
    assert [(d["index"], d["function"]["name"]) for d in deltas] == [(0, "get"), (1, "put"), (2, "get")]
    single = ToolPlan("required", [], "hermes", False, None, {"get"})  # one call, then whitespace to the limit
    content, calls = read_calls('[{"name": "get", "arguments": {}}]\n\n\n', "length", single)
    assert (content, [c.name for c in calls]) == ("", ["get"])
    # Nothing completed before the cut: the text stays content, as before.
    assert read_calls('[{"name": "get", "argu', "length", required) == ('[{"name": "get", "argu', [])


def test_named_call_cut_by_max_tokens_after_its_arguments():
    named = ToolPlan("named", [], "hermes", True, "get", {"get"})
    content, calls = read_calls('{"a": 1}\n\n\n', "length", named)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get", {"a": 1})]
    assert finish_reason_with(calls, "length") == "length"
    assert read_calls('{"a": ', "length", named) == ('{"a": ', [])  # arguments never completed


@pytest.mark.parametrize("fmt", ["hermes", "mistral", "llama3_json", "json"])
def test_malformed_output_is_content_never_an_error(fmt):
    for text in ["[" * 50_000, "<tool_call>" + "[" * 50_000 + "</tool_call>", "[TOOL_CALLS]" + "{\"a\":" * 30_000,
                 "<|python_tag|>" + "{" * 50_000, '[TOOL_CALLS]get[ARGS]{"a": [1, 2}']:
        assert parse_auto(text, plan(fmt)) == (text, [])
        stream = AutoToolStream(plan(fmt))
        sent = "".join(stream.feed(text[i:i + 4096]) for i in range(0, len(text), 4096))
        assert sent + stream.finish()[0] == text


@pytest.mark.parametrize("fmt, head, tail", [
    ("hermes", '<tool_call>{"name": "get", "arguments": {"q": "', '"}}</tool_call>'),
    ("json", '[{"name": "get", "arguments": {"q": "', '"}}]'),
    ("mistral", '[TOOL_CALLS]get[ARGS]{"q": "', '"}'),
])
def test_streamed_auto_parsing_is_linear_in_the_output(fmt, head, tail):
    """A 64 k-character argument streamed 4 characters at a time (issue 38, Med 7): each delta is read from
    where the last one stopped, inside a string too, so the whole stream costs about one parse of it. Quadratic
    parsing took seconds for 16 k characters, on the event loop that serves every other stream."""
    import time

    from kiln.serving.constraints import ToolPlan
    from kiln.serving.tool_calls import AutoToolStream

    body = "a\\u00e9b\\\"c " * 4600  # 64 k characters, escapes included
    text = head + body + tail
    stream = AutoToolStream(ToolPlan("auto", [], fmt, True, None, {"get"}))
    started = time.process_time()
    sent = "".join(stream.feed(text[i:i + 4]) for i in range(0, len(text), 4))
    rest, calls = stream.finish()
    elapsed = time.process_time() - started
    assert sent + rest == "" and len(calls) == 1 and json.loads(calls[0].arguments)["q"] == json.loads(f"\"{body}\"")
    assert elapsed < 3.0, f"{elapsed:.2f}s of CPU for 16 k deltas"
