"""An assistant turn's earlier thinking reaches the chat template (as vLLM gives it: ``reasoning`` and
``reasoning_content``), from chat messages, Messages API thinking blocks and Responses API reasoning items; the
template decides what it shows (Qwen3's: a tool loop's current turn)."""

from __future__ import annotations

import pytest
from kiln.serving.anthropic_protocol import MessagesRequest
from kiln.serving.anthropic_translate import chat_messages
from kiln.serving.chat import render_chat
from kiln.serving.errors import APIError
from kiln.serving.protocol import ChatCompletionRequest
from kiln.serving.responses_translate import _item_messages, assistant_turn
from test_tool_calls_unit import Tokenizer

CALL = {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": '{"city": "Paris"}'}}


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_chat_history_thinking_reaches_the_template_under_both_names(field):
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, field: "need the weather", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}]})
    tokenizer = Tokenizer("{{ messages }}")
    render_chat(req, tokenizer)
    assistant = tokenizer.seen["messages"][1]
    assert assistant["reasoning"] == assistant["reasoning_content"] == "need the weather"
    assert "reasoning" not in tokenizer.seen["messages"][0]
    with pytest.raises(Exception, match="reasoning_content"):  # a string, as a reply gave it
        ChatCompletionRequest.model_validate({"model": "m", "messages": [
            {"role": "assistant", "content": "x", "reasoning_content": ["not", "text"]}]})


def test_messages_api_thinking_blocks_become_the_turn_s_reasoning():
    req = MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "need the weather", "signature": ""},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "tool_use", "id": "call_1", "name": "get", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "12 C"}]}]})
    user, assistant, tool = chat_messages(req)
    assert assistant["reasoning_content"] == "need the weather" and assistant["tool_calls"][0]["id"] == "call_1"
    assert "reasoning_content" not in user and tool["role"] == "tool"
    bad = req.model_copy(deep=True)
    bad.messages[1].content[0] = {"type": "thinking", "thinking": 7}
    with pytest.raises(APIError, match=r"messages\[1\].content\[0\].thinking must be a string"):
        chat_messages(bad)


def test_responses_reasoning_items_give_the_turn_they_begin_its_reasoning():
    items = [{"type": "message", "role": "user", "content": "Weather?"},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "need the weather"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "12 C"},
             {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "a summary"}]},
             {"type": "message", "role": "user", "content": "And Rome?"}]  # no assistant turn after rs_2
    (user, assistant, tool, again), sources = _item_messages(items)
    assert sources == ["input[0]", "input[2]", "input[3]", "input[5]"]  # the item each message begins with
    assert assistant["reasoning_content"] == "need the weather" and assistant["tool_calls"][0]["id"] == "call_1"
    assert all("reasoning_content" not in m for m in (user, tool, again))
    turn = assistant_turn({"content": None, "reasoning_content": "plan", "tool_calls": [CALL]})
    assert turn["reasoning_content"] == "plan"  # a previous_response_id follow-up keeps it for the template
    with pytest.raises(APIError, match=r"input\[0\].content: each reasoning_text part needs a text string"):
        _item_messages([{"type": "reasoning", "content": [{"type": "reasoning_text", "text": 3}]}])
