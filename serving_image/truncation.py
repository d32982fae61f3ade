"""The Responses API's ``truncation: "auto"``: a conversation too long for the engine loses items in its middle.

As OpenAI's: when the rendered input (with the room ``max_output_tokens`` asks for) is over what the engine takes,
the oldest exchanges after the instructions go, whole, until it fits. An exchange runs from a user message up to
the next one (the assistant's reply, its tool calls and their outputs with it), so the template still sees turns
in order and every tool output after its call. The last exchange always stays: when it alone is too long, the
request is refused as ``disabled`` refuses it (a 400 naming ``input``). The stored conversation a
``previous_response_id`` continues keeps every item; only this request's prompt is cut.

The fewest exchanges that make it fit are found by bisection over renders of the chat template.
"""

from __future__ import annotations

from typing import Any

from kiln.serving.chat import render_chat
from kiln.serving.constraints import ToolPlan
from kiln.serving.protocol import ChatCompletionRequest

HEAD_ROLES = ("system", "developer")  # the instructions: never dropped


def fits(num_ids: int, engine: Any, max_tokens: int | None) -> bool:
    """Whether a prompt of ``num_ids`` tokens (with ``max_tokens`` after it, when asked) fits ``engine``."""
    config = engine.engine_config
    return num_ids <= config.max_input_len and (max_tokens is None or num_ids + max_tokens <= config.max_seq_len)


def exchange_starts(messages: list[Any]) -> tuple[int, list[int]]:
    """(the instructions' length, where each exchange after them starts: each user message's index)."""
    head = 0
    while head < len(messages) and messages[head].role in HEAD_ROLES:
        head += 1
    return head, [i for i in range(head, len(messages)) if messages[i].role == "user"]


def middle_truncated(req: ChatCompletionRequest, ids: list[int], engine: Any, plan: ToolPlan | None,
                     max_tokens: int | None) -> tuple[ChatCompletionRequest, list[int]]:
    """``req`` and its prompt ``ids`` with the fewest oldest exchanges dropped that make it fit; as it was when it
    fits already, or when even the last exchange alone does not (the caller's check then refuses it)."""
    if fits(len(ids), engine, max_tokens):
        return req, ids
    head, starts = exchange_starts(req.messages)
    cuts = [s for s in starts if s > head]  # drop messages[head:cut]; the last user message's exchange stays
    rendered: dict[int, tuple[ChatCompletionRequest, list[int]]] = {}

    def render(k: int) -> tuple[ChatCompletionRequest, list[int]]:
        if k not in rendered:
            trial = req.model_copy(update={"messages": req.messages[:head] + req.messages[cuts[k]:]})
            rendered[k] = trial, render_chat(trial, engine.tokenizer, plan)
        return rendered[k]

    low, high = 0, len(cuts)  # the answer is the least k with render(k) fitting; len(cuts): none does
    while low < high:
        mid = (low + high) // 2
        if fits(len(render(mid)[1]), engine, max_tokens):
            high = mid
        else:
            low = mid + 1
    return render(low) if low < len(cuts) else (req, ids)
