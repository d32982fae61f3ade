"""One Generation's engine deltas as an OpenAI response body or a stream of SSE chunks.

Per choice, what the client sees depends on the chat request's tool plan: plain text; a named
tool_choice's arguments streamed as ``delta.tool_calls[0].function.arguments`` pieces; a
``required`` choice's calls when it ends (the grammar's JSON array parses only whole); an
``auto`` choice's content as it comes and its calls (read in the model family's format) when
it ends. With a reasoning parser, the thinking is split off first (``reasoning_content``) and only the
answer is read for tool calls. Usage: with ``include_usage`` the totals in a last chunk; with
``continuous_usage_stats`` too, every chunk carries its choice's usage so far (vLLM's).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from kiln.engine.errors import RequestError
from kiln.serving.constraints import ToolPlan
from kiln.serving.errors import APIError, engine_dead_error, engine_died
from kiln.serving.openai_bodies import SSE_DONE, Builder, ChoiceText, sse
from kiln.serving.reasoning import Reasoning
from kiln.serving.request_fanout import Generation
from kiln.serving.tool_calls import AutoToolStream, Call, finish_reason_with, read_calls

log = logging.getLogger("kiln.serving")


def usage(gen: Generation, num_output_tokens: list[int]) -> dict[str, Any]:
    # A prompt is counted once however many choices (n) it has, as OpenAI does.
    seen: dict[int, int] = {}
    cached = 0
    for slot, item in enumerate(gen.inputs):
        if item.prompt_index not in seen:
            seen[item.prompt_index] = gen.num_prompt_tokens[slot]
            cached += gen.num_cached_tokens[slot]
    return Builder.usage(sum(seen.values()), sum(num_output_tokens), cached)


async def collect(builder: Builder, gen: Generation, plan: ToolPlan | None = None,
                  reasoning: Reasoning | None = None) -> dict[str, Any]:
    choices = [ChoiceText(text=item.prompt_text or "", echo=item.prompt_text is not None) for item in gen.inputs]
    async for slot, delta in gen.deltas():
        choice = choices[slot]
        choice.text += delta.text
        choice.token_ids += delta.new_token_ids
        if delta.prompt_logprobs is not None:  # echo with logprobs (the prompt's tokens first), or prompt_logprobs
            choice.prompt_token_ids = gen.inputs[slot].prompt_token_ids
            choice.prompt_logprobs, choice.prompt_ranks = delta.prompt_logprobs, delta.prompt_ranks or []
        if delta.logprobs:
            choice.logprobs += delta.logprobs
        if delta.finish_reason is not None:
            choice.finish_reason = delta.finish_reason
    if reasoning is not None:  # the thinking first: tool calls are read from the answer only
        for choice in choices:
            choice.reasoning, choice.text = reasoning.split(choice.text)
    if plan is not None:
        for choice in choices:
            choice.text, calls = read_calls(choice.text, choice.finish_reason, plan)
            choice.tool_calls = [c.to_openai() for c in calls] or None
            choice.finish_reason = finish_reason_with(calls, choice.finish_reason)
    return builder.response(choices, usage(gen, [len(c.token_ids) for c in choices]))


class _ChoiceStream:
    """What one choice of a chat stream has sent, for a tool plan."""

    def __init__(self, plan: ToolPlan | None) -> None:
        self.plan = plan
        self.auto = AutoToolStream(plan) if plan is not None and plan.mode == "auto" else None
        self.named_call = Call(plan.named or "", "") if plan is not None and plan.mode == "named" else None
        self.buffered = ""  # a `required` choice's output, parsed when it ends
        self.calls: list[Call] = []

    def content(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """(content, tool-call deltas) to send now for ``text``."""
        if self.plan is None:
            return text, None
        if self.auto is not None:
            return self.auto.feed(text), None
        if self.named_call is not None:
            first = not self.calls
            self.calls = [self.named_call]
            if not text and not first:
                return None, None
            head = {"id": self.named_call.id, "type": "function", "name": self.named_call.name} if first else {}
            return None, [_delta(0, text, **head)]
        self.buffered += text
        return None, None

    def finish(self, reason: str) -> tuple[str | None, list[dict[str, Any]] | None, str]:
        """(content, tool-call deltas, finish reason) at the end of the choice."""
        if self.plan is None or self.named_call is not None:
            return None, None, finish_reason_with(self.calls, reason) or reason
        if self.auto is not None:
            rest, self.calls = self.auto.finish()
        else:
            rest, self.calls = read_calls(self.buffered, reason, self.plan)
        deltas = [_delta(i, c.arguments, id=c.id, type="function", name=c.name) for i, c in enumerate(self.calls)]
        return (rest or None), (deltas or None), finish_reason_with(self.calls, reason) or reason


def _delta(index: int, arguments: str, id: str | None = None, type: str | None = None,
           name: str | None = None) -> dict[str, Any]:
    call: dict[str, Any] = {"index": index}
    if id is not None:
        call.update(id=id, type=type)
    call["function"] = {"name": name, "arguments": arguments} if name is not None else {"arguments": arguments}
    return call


async def events(builder: Builder, gen: Generation, include_usage: bool, continuous: bool = False,
                 plan: ToolPlan | None = None, reasoning: Reasoning | None = None) -> AsyncIterator[str]:
    async for body in chunks(builder, gen, include_usage, continuous, plan, reasoning):
        yield sse(body)
    yield SSE_DONE


async def chunks(builder: Builder, gen: Generation, include_usage: bool, continuous: bool = False,
                 plan: ToolPlan | None = None, reasoning: Reasoning | None = None,
                 first_usage: bool = False) -> AsyncIterator[dict[str, Any]]:
    """The stream's chunk bodies (an ``{"error": ...}`` body last if it fails); the Messages and Responses
    dialects render these in their own events (:mod:`anthropic_stream`, :mod:`responses_stream`), with
    ``first_usage``: a choice's first chunk carries its usage so far (the prompt's, for ``message_start``)."""
    chat = builder.kind == "chat"
    started: set[int] = set()
    num_output = [0 for _ in gen.inputs]
    streams = [_ChoiceStream(plan if chat else None) for _ in gen.inputs]
    thinking = [reasoning.stream() if reasoning is not None and chat else None for _ in gen.inputs]

    def chunk(slot: int, **fields: Any) -> dict[str, Any]:
        running = None
        if (continuous or (first_usage and fields.get("role"))) and include_usage:
            running = Builder.usage(gen.num_prompt_tokens[slot], num_output[slot], gen.num_cached_tokens[slot])
        return builder.chunk(slot, include_usage=include_usage, usage=running, **fields)

    try:
        async for slot, delta in gen.deltas():
            text = delta.text
            if slot not in started:
                started.add(slot)
                if chat:
                    yield chunk(slot, text="", role=True)
                elif gen.inputs[slot].prompt_text:
                    text = gen.inputs[slot].prompt_text + text
            num_output[slot] += len(delta.new_token_ids)
            prefix = len(gen.inputs[slot].prompt_text or "")
            ids, lps = delta.new_token_ids, delta.logprobs
            if delta.prompt_logprobs is not None:  # echo with logprobs: the prompt's tokens first, offsets from 0
                ids, lps, prefix = gen.inputs[slot].prompt_token_ids + ids, delta.prompt_logprobs + (lps or []), 0
            logprobs = builder.logprobs(slot, ids, lps, prefix)
            thought, text = thinking[slot].feed(text) if thinking[slot] is not None else ("", text)
            if delta.finish_reason is not None and thinking[slot] is not None:
                more_thought, more_text = thinking[slot].finish()
                thought, text = thought + more_thought, text + more_text
            content, calls = streams[slot].content(text) if chat else (text, None)
            if content or logprobs or calls or thought:
                yield chunk(slot, text=content, logprobs=logprobs, tool_calls=calls, reasoning=thought or None)
            if delta.finish_reason is not None:
                content, calls, reason = streams[slot].finish(delta.finish_reason)
                if content or calls:
                    yield chunk(slot, text=content, tool_calls=calls)
                yield chunk(slot, text=None if chat else "", finish_reason=reason)
    except RequestError as exc:
        yield APIError(400, str(exc), param=exc.param).body()
    except Exception as exc:
        if engine_died(gen.engine):  # the group broke mid-stream (a rank died): one line, the probes' answer
            log.error("generation %s failed mid-stream: the engine's step loop failed: %s", gen.request_id, exc)
            yield engine_dead_error(type="server_error").body()
        else:
            log.exception("generation %s failed mid-stream", gen.request_id)
            yield APIError(500, "Internal server error during generation; the server log has the details",
                           type="server_error").body()
    else:
        if include_usage:
            yield builder.usage_chunk(usage(gen, num_output))
