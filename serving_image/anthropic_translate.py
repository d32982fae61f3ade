"""A Messages API request as the chat request kiln runs, and the chat answer as a Messages API reply.

Request: ``system`` becomes the system message; each message's blocks become chat messages in
order (``tool_result`` blocks become ``tool`` messages ahead of the user's text, as chat templates
expect them right after the assistant's calls; ``tool_use`` blocks become the assistant's
``tool_calls``; an assistant turn's ``thinking`` blocks become its ``reasoning_content``, which thinking templates
show or drop: Qwen3's shows the current turn's in a tool loop; ``redacted_thinking`` holds no text and is dropped).
``tools`` / ``tool_choice`` map onto chat's (``any`` is ``required``, ``tool`` a named choice,
``disable_parallel_tool_use`` is ``parallel_tool_calls: false``), ``output_config.format`` onto
``response_format``, ``stop_sequences`` onto ``stop``, ``thinking`` onto the chat template's
``enable_thinking`` (``disabled``: false, else true; a template that does not read it is unchanged),
``output_config.effort`` onto ``reasoning_effort``. A final assistant message is a prefill: chat's
``continue_final_message`` renders the conversation up to its text, which the reply continues (a structured
output's grammar starting past it: :mod:`constraints`). As Anthropic's API, a text block holds non-whitespace text
and every message but a final assistant one holds content: otherwise a 400 names it (``messages[0].content[1].text``).
The stop strings are kept in the chat output (``include_stop_str_in_output``) so the reply can say
which one ended it; they are cut off here.

Reply: ``thinking`` (with a reasoning parser), ``text`` and ``tool_use`` blocks, each only when it holds
something (as the stream opens them; an empty answer is ``content: []``); ``stop_reason`` from
the finish reason; ``usage`` as Anthropic counts it: ``input_tokens`` excludes the prompt tokens read
from the prefix cache, which are ``cache_read_input_tokens``.
"""

from __future__ import annotations

import json
from typing import Any

from kiln.serving.anthropic_protocol import BLOCKS, CountTokensRequest, MessagesRequest, Tool
from kiln.serving.errors import APIError, from_validation_error
from kiln.serving.protocol import ChatCompletionRequest
from kiln.serving.request_path import validated
from pydantic import ValidationError

ALLOWED = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use")}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def text_of_block(block: Any, param: str) -> str:
    """A text block's text (``block`` a dict, or a parsed ``TextBlock``); Anthropic's 400 for an empty or blank one,
    naming ``param.text`` (the SDK never sends one: a reply holds no empty text block)."""
    text = (validated(BLOCKS["text"], block, param) if isinstance(block, dict) else block).text
    if not text.strip():
        what = "must be non-empty" if not text else "must contain non-whitespace text"
        raise APIError(400, f"{param}.text: text content blocks {what}; give the block text or leave it out",
                       param=f"{param}.text")
    return text


def _text_of(content: Any, param: str) -> str:
    """A tool result's content (a string or text blocks) as text."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise APIError(400, f"{param}[{j}]: a tool result holds text blocks here; kiln serves text models",
                           param=f"{param}[{j}]")
        parts.append(text_of_block(block, f"{param}[{j}]"))
    return "\n".join(parts)


def _blocks(i: int, role: str, content: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One Messages API message's blocks as chat messages."""
    tool_results: list[dict[str, Any]] = []
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, raw in enumerate(content):
        param = f"messages[{i}].content[{j}]"
        kind = raw.get("type")
        if kind in ("thinking", "redacted_thinking") and role == "assistant":
            if kind == "thinking":  # the template decides what it shows of it
                if not isinstance(raw.get("thinking"), str):
                    raise APIError(400, f"{param}.thinking must be a string, as the reply's thinking block gave it",
                                   param=f"{param}.thinking")
                thoughts.append(raw["thinking"])
            continue
        if kind not in ALLOWED[role]:
            raise APIError(400, f"{param}: a {kind!r} block is not served here; {role} messages take "
                           f"{' and '.join(ALLOWED[role])} blocks (kiln serves text models)", param=f"{param}.type")
        if kind == "text":
            texts.append(text_of_block(raw, param))
            continue
        block = validated(BLOCKS[kind], raw, param)
        if kind == "tool_use":
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        else:
            text = _text_of(block.content, f"{param}.content")
            tool_results.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                 "content": f"Error: {text}" if block.is_error else text})
    out = list(tool_results)
    if texts or calls or not tool_results:
        message: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
        if calls:
            message["tool_calls"] = calls
        if thoughts:
            message["reasoning_content"] = "\n".join(thoughts)
        out.append(message)
    return out


def chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages."""
    messages: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else \
            "\n".join(text_of_block(b, f"system[{j}]") for j, b in enumerate(req.system))
        messages.append({"role": "system", "content": system})
    last = len(req.messages) - 1
    for i, m in enumerate(req.messages):
        if not m.content and not (i == last and m.role == "assistant"):
            raise APIError(400, f"messages[{i}].content: all messages must have non-empty content except for the "
                           "optional final assistant message; give it text or leave the message out",
                           param=f"messages[{i}].content")
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
        else:
            messages += _blocks(i, m.role, m.content)
    _check_tool_pairs(req.messages)
    return messages


def _ids(message: Any, kind: str, key: str) -> list[tuple[int, str]]:
    blocks = message.content if isinstance(message.content, list) else []
    return [(j, b.get(key)) for j, b in enumerate(blocks) if b.get("type") == kind]


def _check_tool_pairs(messages: list[Any]) -> None:
    """Anthropic's rule (its 400s): each ``tool_result`` answers a ``tool_use`` of the message just before it,
    and each ``tool_use`` of an assistant message that another message follows is answered in that next one. A
    result answering nothing would reach the template as a tool message without its call."""
    asked: list[tuple[int, str]] = []  # (block, id) of the previous message's tool_use blocks
    for i, m in enumerate(messages):
        answered = _ids(m, "tool_result", "tool_use_id") if m.role == "user" else []
        for j, use_id in answered:
            if use_id not in {u for _, u in asked}:
                before = f"messages[{i - 1}]" if i else "a message before it (it is the first)"
                raise APIError(400, f"messages[{i}].content[{j}].tool_use_id: {use_id!r} answers no tool_use block of "
                               f"{before}; each tool_result block answers a tool_use block of the message "
                               "just before it", param=f"messages[{i}].content[{j}].tool_use_id")
        if missing := [u for _, u in asked if u not in {a for _, a in answered}]:
            raise APIError(400, f"messages[{i}]: tool_use ids {', '.join(map(repr, missing))} of messages[{i - 1}] "
                           "have no tool_result block here; each tool_use block is answered in the next message",
                           param=f"messages[{i}].content")
        asked = _ids(m, "tool_use", "id") if m.role == "assistant" else []


def _tools(req: CountTokensRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    tools = []
    for i, raw in enumerate(req.tools or []):
        if isinstance(raw, dict):  # not a custom tool's shape: say why
            if raw.get("type") not in (None, "custom"):
                raise APIError(400, f"tools[{i}]: {raw.get('type')!r} is one of Anthropic's server tools; kiln "
                               "serves custom tools ({name, description, input_schema})", param=f"tools[{i}].type")
            raw = validated(Tool, raw, f"tools[{i}]")
        tools.append({"type": "function", "function": {"name": raw.name, "description": raw.description,
                                                       "parameters": raw.input_schema, "strict": raw.strict}})
    if tools:
        fields["tools"] = tools
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise APIError(400, "tool_choice.name is required with type tool: name the tool to call",
                           param="tool_choice.name")
        fields["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                                 else {"auto": "auto", "any": "required", "none": "none"}[choice.type])
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    if req.output_config is not None and req.output_config.format is not None:
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": req.output_config.format.schema_, "strict": True}}
    return fields


def to_chat(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that runs ``req``: a Messages request, or a count_tokens one (which only renders)."""
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req), **_tools(req)}
    _prefill(body, len(req.messages) - 1)
    if req.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
    if req.output_config is not None and req.output_config.effort is not None:
        body["reasoning_effort"] = req.output_config.effort
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, stream=req.stream, temperature=req.temperature, top_p=req.top_p,
                    top_k=req.top_k, stop=req.stop_sequences, include_stop_str_in_output=bool(req.stop_sequences))
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:  # a shape Anthropic's rules allow and chat's do not: name chat's field
        raise from_validation_error(exc) from None


def _prefill(body: dict[str, Any], index: int) -> None:
    """A final assistant message is a prefill: the reply continues its text (Anthropic's rule), rendered without
    its end of turn. Empty, it is left out (a new turn opens); its text may not end in whitespace (Anthropic's 400)."""
    final = body["messages"][-1]
    if final["role"] != "assistant" or final.get("tool_calls"):
        return
    if not final["content"]:
        body["messages"].pop()
        return
    if final["content"] != final["content"].rstrip():
        raise APIError(400, f"messages[{index}]: final assistant content cannot end with trailing whitespace; "
                       "strip it (the reply continues the text as written)", param=f"messages[{index}].content")
    body.update(add_generation_prompt=False, continue_final_message=True)


def tool_use_id(call_id: str) -> str:
    """A chat tool call's id (``call_`` + hex) as Anthropic spells a tool_use block's (``toolu_`` + the rest)."""
    return "toolu_" + call_id.removeprefix("call_")


def cut_stop_sequence(text: str, finish_reason: str | None, stops: list[str] | None) -> tuple[str, str | None]:
    """(text without the stop sequence that ended it, that sequence or None)."""
    if finish_reason == "stop":
        for stop in stops or ():
            if text.endswith(stop):
                return text[: len(text) - len(stop)], stop
    return text, None


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"] - cached, "output_tokens": chat_usage["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def to_message(chat: dict[str, Any], message_id: str, stops: list[str] | None) -> dict[str, Any]:
    """The chat completion ``chat`` as a Messages API reply."""
    choice = chat["choices"][0]
    message = choice["message"]
    text, stop = cut_stop_sequence(message.get("content") or "", choice["finish_reason"], stops)
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):  # as the stream gives it: a block only for what the model wrote
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if text:  # never an empty text block: Anthropic sends none, and refuses one sent back
        content.append({"type": "text", "text": text})
    for call in message.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"])})
    reason = "stop_sequence" if stop is not None else STOP_REASONS.get(choice["finish_reason"], "end_turn")
    return {"id": message_id, "type": "message", "role": "assistant", "content": content, "model": chat["model"],
            "stop_reason": reason, "stop_sequence": stop, "usage": usage(chat["usage"])}
