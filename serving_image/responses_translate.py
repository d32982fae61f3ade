"""A Responses API request as the chat request kiln runs, and the chat answer as a Response.

Request: ``instructions`` become the system message (for this response only, as OpenAI has it: a
follow-up does not inherit them); ``previous_response_id`` puts the stored conversation first;
``input`` items become chat messages (``message`` items by role, ``function_call`` items the
assistant's ``tool_calls``, ``function_call_output`` items ``tool`` messages; a ``reasoning`` item's
text is the ``reasoning_content`` of the assistant turn it begins, which thinking templates show or
drop). Function ``tools``, ``tool_choice``, ``parallel_tool_calls`` and ``text.format`` map onto
chat's fields of the same meaning, and ``reasoning.effort`` onto its ``reasoning_effort`` (the chat
template's variable of that name).

Reply: ``output`` items in order: ``reasoning`` (with a reasoning parser), ``message`` with one
``output_text`` part, then one ``function_call`` per call. A reply cut at ``max_output_tokens`` is
``incomplete``. With ``include: ["message.output_text.logprobs"]`` the ``output_text`` part carries each
output token's ``logprobs`` (``top_logprobs`` alternatives), chat's entries as they are. Item ids derive from the response id (``msg_``/``rs_`` + its hex), so a streamed
reply and its stored copy name the same items.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kiln.serving.chat import tool_arguments
from kiln.serving.errors import APIError, from_validation_error
from kiln.serving.protocol import ChatCompletionRequest
from kiln.serving.request_path import in_terms_of, validated
from kiln.serving.responses_protocol import (
    LOGPROBS_INCLUDE,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    MessageItem,
)
from kiln.serving.responses_protocol import ResponsesRequest as Request
from kiln.serving.responses_store import ResponseStore
from pydantic import ValidationError

ITEMS = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem}
TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass
class Translated:
    """What ``POST /v1/responses`` runs: the chat request, and the conversation it continues (to store)."""

    chat: ChatCompletionRequest
    conversation: list[dict[str, Any]]  # the chat messages, instructions aside
    sources: list[str] = field(default_factory=list)  # per chat message, the field it came from (source_names)


def source_names(sources: list[str]) -> list[tuple[str, Any]]:
    """``in_terms_of`` names for ``messages[i]`` of the chat request: the field of the Responses request the
    message came from (``instructions``, ``previous_response_id``, ``input`` or ``input[j]``: items and messages
    are not one to one, as calls of one turn share a message and reasoning items join the next)."""
    def own(match: re.Match) -> str:
        i = int(match[1])
        return sources[i] if i < len(sources) else "input"

    return [(r"messages\[(\d+)\]", own)]


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"{param}[{j}]: a {kind!r} part is not served here; kiln serves text models: send "
                           "input_text parts", param=f"{param}[{j}]")
        parts.append(part["text"])
    return "\n".join(parts)


def _item_messages(items: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The input items as chat messages, and the item each message begins with (``input[i]``)."""
    messages: list[dict[str, Any]] = []
    sources: list[str] = []
    thought: str | None = None  # a reasoning item's text, for the assistant message that follows it
    for i, raw in enumerate(items):
        kind = raw.get("type", "message")
        if kind == "reasoning":
            thought = _reasoning_text(raw, f"input[{i}]")
            continue
        if kind not in ITEMS:
            raise APIError(400, f"input[{i}]: a {kind!r} item is not served here; send message, function_call "
                           "and function_call_output items", param=f"input[{i}].type")
        item = validated(ITEMS[kind], raw, f"input[{i}]")
        if kind == "message":
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _text(item.content, f"input[{i}].content")})
        elif kind == "function_call":
            tool_arguments(item.arguments, f"input[{i}].arguments")  # named here: chat's index is not the item's
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # calls of one turn: one assistant message
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output, f"input[{i}].output")})
        sources += [f"input[{i}]"] * (len(messages) - len(sources))
        if thought is not None and messages[-1]["role"] == "assistant":  # the turn the reasoning item began
            messages[-1]["reasoning_content"] = thought
        thought = None
    return messages, sources


def _reasoning_text(raw: dict[str, Any], param: str) -> str | None:
    """A reasoning item's text (its ``reasoning_text`` parts, as kiln's replies give them; else its summary's), or
    None; the assistant turn after it carries it as ``reasoning_content`` (the template shows it or not)."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = raw.get(key) or []
        if not isinstance(parts, list):
            raise APIError(400, f"{param}.{key} must be a list of {kind} parts", param=f"{param}.{key}")
        texts = [p.get("text") for p in parts if isinstance(p, dict) and p.get("type") == kind]
        if any(not isinstance(t, str) for t in texts):
            raise APIError(400, f"{param}.{key}: each {kind} part needs a text string", param=f"{param}.{key}")
        if texts:
            return "\n".join(texts)
    return None


def _fields(req: Request) -> dict[str, Any]:
    """Chat's fields for the request's tools, tool choice and text format."""
    fields: dict[str, Any] = {}
    tools = []
    for i, raw in enumerate(req.tools or []):
        if raw.get("type") != "function":
            raise APIError(400, f"tools[{i}]: {raw.get('type')!r} tools are OpenAI's hosted tools; kiln serves "
                           "function tools", param=f"tools[{i}].type")
        tool = validated(FunctionTool, raw, f"tools[{i}]")
        tools.append({"type": "function", "function": tool.model_dump(exclude={"type"})})
    if tools:
        fields["tools"] = tools
    if req.tool_choice is not None:
        choice = req.tool_choice
        fields["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                       "function": {"name": choice.name}}
    if req.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = req.parallel_tool_calls
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise APIError(400, "text.format.schema is required with type json_schema: send a JSON Schema",
                           param="text.format.schema")
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict}}
    elif fmt is not None and fmt.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    return fields


def not_stored(response_id: str, param: str) -> APIError:
    """OpenAI's answer to an id no response is stored under: a 404 on the response's own routes, a 400
    (``previous_response_not_found``, which clients such as Codex read to resend the whole conversation) for a
    ``previous_response_id``."""
    status, code = (400, "previous_response_not_found") if param == "previous_response_id" else \
        (404, "response_not_found")
    return APIError(status, f"{param}: no response {response_id!r} is stored on this server: it was never stored "
                    "(store: false), was deleted, expired, or is kept by another replica (docs/serving.md, "
                    "\"Responses API\"); send the whole conversation as input instead", param=param, code=code)


def _check_outputs(conversation: list[dict[str, Any]], sources: list[str], items: Any) -> None:
    """OpenAI's 400s: each ``function_call_output`` answers a ``function_call`` before it (in ``input``, or in the
    conversation ``previous_response_id`` continues), and each call is answered by one after it: a tool message
    without its call, or a call without its answer, would reach the template as a broken turn. A call is named as
    its own item (``input[j]``: calls of one turn share a message), or as ``previous_response_id``."""
    own = {} if isinstance(items, str) else {item.get("call_id"): f"input[{j}]" for j, item in enumerate(items)
                                             if item.get("type") == "function_call"}
    made: dict[str, str] = {}
    for message, source in zip(conversation, sources, strict=True):
        stored = source == "previous_response_id"
        made.update((call["id"], source if stored else own.get(call["id"], source))
                    for call in message.get("tool_calls") or ())
        if message["role"] == "tool" and made.pop(message["tool_call_id"], None) is None:
            raise APIError(400, f"{source}.call_id: no tool call found for function call output with call_id "
                           f"{message['tool_call_id']!r}; a function_call_output answers a function_call item "
                           "before it, in input or in the response previous_response_id names", param=f"{source}.call_id")
    for call_id, source in made.items():
        raise APIError(400, f"{source}: no tool output found for function call {call_id!r}; give its "
                       f"function_call_output item (call_id {call_id!r}) in input", param=source)


def to_chat(req: Request, store: ResponseStore) -> Translated:
    """The chat request that runs ``req``, after the stored conversation it continues."""
    if req.background:
        raise APIError(400, "background responses are not served by kiln; send background: false and stream "
                       "instead", param="background")
    earlier: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        stored = store.get(req.previous_response_id)
        if stored is None:
            raise not_stored(req.previous_response_id, "previous_response_id")
        earlier = [dict(m) for m in stored.conversation]
    new, given = ([{"role": "user", "content": req.input}], ["input"]) if isinstance(req.input, str) else \
        _item_messages(req.input)
    conversation = earlier + new
    _check_outputs(conversation, ["previous_response_id"] * len(earlier) + given, req.input)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    sources = ["instructions"] * len(system) + ["previous_response_id"] * len(earlier) + given
    body = {"model": req.model, "messages": system + conversation, "max_tokens": req.max_output_tokens,
            "stream": req.stream, "temperature": req.temperature, "top_p": req.top_p, **_fields(req)}
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    if LOGPROBS_INCLUDE in (req.include or ()):  # the output text's logprobs; top_logprobs alone asks for none
        body.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    try:
        chat = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise in_terms_of(from_validation_error(exc), source_names(sources)) from None
    chat._truncate_middle = req.truncation == "auto"  # kiln.serving.truncation
    return Translated(chat, conversation, sources)


def output_item(kind: str, response_id: str, message: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    """One output item of ``kind`` from the chat message: ``reasoning`` (its thinking), ``message`` (its
    content), ``function_call`` (its first call)."""
    hex_id = response_id.removeprefix("resp_")
    if kind == "reasoning":
        return {"id": f"rs_{hex_id}", "type": "reasoning", "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": message.get("reasoning_content") or ""}]}
    if kind == "message":
        return {"id": f"msg_{hex_id}", "type": "message", "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": message.get("content") or "", "annotations": [],
                             "logprobs": message.get("logprobs") or []}]}
    call = message["tool_calls"][0]
    return {"id": f"fc_{call['id'].removeprefix('call_')}", "type": "function_call", "status": status,
            "call_id": call["id"], "name": call["function"]["name"], "arguments": call["function"]["arguments"]}


INPUT_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_items(req: Request) -> list[dict[str, Any]]:
    """The request's ``input`` as ``GET /v1/responses/{id}/input_items`` lists it, in the order given: each item
    with an id (the client's, else a new one) and a status, a message's text as parts (``input_text``; the
    assistant's ``output_text``)."""
    given = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    items = []
    for raw in given:
        kind = raw.get("type", "message")
        item = {**raw, "type": kind, "id": raw.get("id") or f"{INPUT_ID_PREFIXES.get(kind, 'item')}_{uuid.uuid4().hex}"}
        if kind == "message" and isinstance(raw.get("content"), str):
            part = {"type": "input_text", "text": raw["content"]} if raw.get("role") != "assistant" else \
                {"type": "output_text", "text": raw["content"], "annotations": []}
            item["content"] = [part]
        if kind != "reasoning":
            item.setdefault("status", "completed")
        items.append(item)
    return items


def output_items(response_id: str, message: dict[str, Any], done: bool = True) -> list[dict[str, Any]]:
    """A chat message (content, reasoning_content, tool_calls) as Responses output items, none empty: an answer
    that is all thinking is its reasoning item alone, as the stream gives it. Cut short (``done`` false), the last
    item is ``incomplete``; the ones before it ended, and are ``completed`` (as their ``output_item.done`` said)."""
    calls = message.get("tool_calls") or []
    kinds = ["reasoning"] if message.get("reasoning_content") else []
    if message.get("content") or not (calls or kinds):
        kinds.append("message")
    items = [*(output_item(kind, response_id, message) for kind in kinds),
             *(output_item("function_call", response_id, {"tool_calls": [call]}) for call in calls)]
    if not done:
        items[-1]["status"] = "incomplete"
    return items


def usage(chat_usage: dict[str, Any] | None, num_reasoning_tokens: int = 0) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": num_reasoning_tokens},
            "total_tokens": chat_usage["total_tokens"]}


def response_body(req: Request, response_id: str, created_at: int, status: str = "in_progress",
                  output: list[dict[str, Any]] | None = None, chat_usage: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Response object: the request's settings echoed, with ``status``, ``output`` and ``usage``. ``truncation`` is
    echoed as asked (``auto``: the oldest turns of an input too long went, kiln.serving.truncation)."""
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else {"type": "text"}
    tools = [dict(t, strict=t.get("strict")) for t in req.tools or []]
    choice = req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None \
        else req.tool_choice.model_dump()
    return {"id": response_id, "object": "response", "created_at": created_at, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": req.model,
            "output": output or [], "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "reasoning": {
                "effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": req.store, "temperature": req.temperature, "text": {"format": fmt}, "top_logprobs": req.top_logprobs,
            "tool_choice": choice or "auto", "tools": tools, "top_p": req.top_p,
            "truncation": req.truncation or "disabled",
            "usage": usage(chat_usage), "user": req.user, "metadata": req.metadata or {}}


def to_response(req: Request, response_id: str, chat: dict[str, Any], tokenizer: Any = None) -> dict[str, Any]:
    """The chat completion ``chat`` as a Response."""
    choice = chat["choices"][0]
    done = choice["finish_reason"] != "length"
    message = {**choice["message"], "logprobs": (choice.get("logprobs") or {}).get("content")}
    body = response_body(req, response_id, int(time.time()), "completed" if done else "incomplete",
                         output_items(response_id, message, done), chat["usage"])
    count_reasoning(body, choice["message"], tokenizer)
    return body


def count_reasoning(body: dict[str, Any], message: dict[str, Any], tokenizer: Any) -> None:
    """``usage.output_tokens_details.reasoning_tokens``: the thinking's tokens, as the tokenizer counts its text."""
    thought = message.get("reasoning_content")
    if thought and tokenizer is not None and body.get("usage"):
        body["usage"]["output_tokens_details"]["reasoning_tokens"] = len(tokenizer.encode(thought, add_special_tokens=False))


def assistant_turn(message: dict[str, Any]) -> dict[str, Any]:
    """The reply as the chat message a follow-up's conversation holds (its thinking kept for the template, which
    shows it or drops it: Qwen3's shows the thinking of a tool loop's turn until the user speaks again)."""
    turn: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("tool_calls"):
        turn["tool_calls"] = message["tool_calls"]
    if message.get("reasoning_content") is not None:
        turn["reasoning_content"] = message["reasoning_content"]
    return turn
