"""OpenAI response and stream-chunk bodies, built from engine deltas.

Shapes follow the OpenAI API exactly: ``text_completion`` objects for
``/v1/completions`` (streamed chunks use the same object name),
``chat.completion`` / ``chat.completion.chunk`` for chat, where the first
streamed delta of each choice carries ``role`` and the last one an empty
delta with ``finish_reason``. With ``stream_options.include_usage`` every
chunk carries ``"usage": null`` and one extra chunk with no choices carries
the totals, just before ``data: [DONE]``; with ``continuous_usage_stats`` too
(vLLM's), every chunk carries its choice's usage so far instead of null.
Tool calls are ``message.tool_calls`` / ``delta.tool_calls`` (OpenAI's shapes:
a delta per call with its ``index``, ``id``, ``type`` and ``function``); with a reasoning parser the
thinking is ``message.reasoning_content`` / ``delta.reasoning_content``, and the same under ``reasoning`` (vLLM's
names: the first its older, the second its newer). vLLM's
``prompt_logprobs`` come in vLLM's shape: per prompt token (None for the first) ``{token id: {"logprob",
"rank", "decoded_token"}}``, the token's own entry and the k most likely, on each completion choice and at the
top of a chat completion.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


@dataclass
class ChoiceText:
    """The accumulated output of one choice (non-streaming responses)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # chat: the calls read from `text` (then content is `text`)
    reasoning: str | None = None  # chat with a reasoning parser: the thinking split from `text` (reasoning.py)
    prompt_token_ids: list[int] = field(default_factory=list)  # with prompt logprobs: the prompt's, and theirs
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    prompt_ranks: list[int | None] = field(default_factory=list)
    echo: bool = False  # a completion echoing its prompt: its logprobs (if asked) start with the prompt's


def _finite(logprob: float | None) -> float:
    """A logprob JSON can carry: -inf (a token the grammar refused) and a missing one are -9999.0,
    as vLLM sends them."""
    return -9999.0 if logprob is None or logprob == float("-inf") else logprob


def _message(c: ChoiceText) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
    if c.reasoning is not None:
        message["reasoning_content"] = message["reasoning"] = c.reasoning
    if c.tool_calls:
        message["tool_calls"] = c.tool_calls
    if c.reasoning is not None or c.tool_calls:  # no answer beside thinking or calls: null, as vLLM gives it
        message["content"] = c.text or None
    return message


class Builder:
    """Response pieces for one HTTP request; ``kind`` is ``"completion"`` or ``"chat"``."""

    def __init__(
        self, kind: str, request_id: str, model: str, tokenizer: Any, top_logprobs: int | None,
        prompt_top: int | None = None,
    ) -> None:
        self.kind = kind
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.top_logprobs = top_logprobs
        self.prompt_top = prompt_top  # vLLM's prompt_logprobs: k, None when not asked
        self._offsets: dict[int, int] = {}  # choice -> text offset so far (completion logprobs)
        self._decoded: dict[int, str] = {}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _token(self, token_id: int) -> str:
        text = self._decoded.get(token_id)
        if text is None:  # a long prompt's logprobs name many tokens many times: each decoded once
            text = self._decoded[token_id] = self.tokenizer.decode([token_id])
        return text

    # -- logprobs ---------------------------------------------------------------------------------

    def logprobs(self, index: int, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                 text_prefix_len: int = 0) -> dict[str, Any] | None:
        if self.top_logprobs is None or not logprobs:
            return None
        k = self.top_logprobs
        rows = [  # an entry of None: the prompt's first token (echo), which nothing comes before
            (tid, lp, None if lp is None else sorted(lp.items(), key=lambda kv: -kv[1])[:k])
            for tid, lp in zip(token_ids, logprobs, strict=False)
        ]
        if self.kind == "chat":
            def entry(tid: int, value: float) -> dict[str, Any]:
                s = self._token(tid)
                return {"token": s, "logprob": value, "bytes": list(s.encode())}

            return {"content": [{**entry(tid, _finite(lp.get(tid))),
                                 "top_logprobs": [entry(t, _finite(v)) for t, v in top]} for tid, lp, top in rows],
                    "refusal": None}
        offset = self._offsets.get(index, text_prefix_len)
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for tid, lp, top in rows:
            s = self._token(tid)
            tokens.append(s)
            token_logprobs.append(None if lp is None else _finite(lp.get(tid)))
            tops.append(None if top is None else {self._token(t): _finite(v) for t, v in top})
            offsets.append(offset)
            offset += len(s)
        self._offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def prompt_logprobs(self, c: ChoiceText) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's ``prompt_logprobs`` of choice ``c``: the prompt token's entry and the ``prompt_top`` most likely."""
        out: list[dict[str, dict[str, Any]] | None] = []
        for tid, entry, rank in zip(c.prompt_token_ids, c.prompt_logprobs, c.prompt_ranks, strict=True):
            if entry is None:  # the first token: nothing comes before it
                out.append(None)
                continue
            top = sorted(entry.items(), key=lambda kv: -kv[1])[:self.prompt_top]
            row = {str(t): {"logprob": _finite(v), "rank": i + 1, "decoded_token": self._token(t)}
                   for i, (t, v) in enumerate(top)}
            row[str(tid)] = {"logprob": _finite(entry[tid]), "rank": rank, "decoded_token": self._token(tid)}
            out.append(row)
        return out

    # -- usage ------------------------------------------------------------------------------------

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    # -- whole responses --------------------------------------------------------------------------

    def response(self, choices: list[ChoiceText], usage: dict[str, Any]) -> dict[str, Any]:
        if self.kind == "chat":
            body = self._head("chat.completion")
            body["choices"] = [
                {
                    "index": i,
                    "message": _message(c),
                    "logprobs": self.logprobs(i, c.token_ids, c.logprobs),
                    "finish_reason": c.finish_reason,
                }
                for i, c in enumerate(choices)
            ]
            if self.prompt_top is not None:  # one prompt, whatever n: at the top, as vLLM puts it
                body["prompt_logprobs"] = self.prompt_logprobs(choices[0])
        else:
            body = self._head("text_completion")
            body["choices"] = [
                {
                    "index": i,
                    "text": c.text,
                    "logprobs": self.logprobs(i, c.prompt_token_ids + c.token_ids, c.prompt_logprobs + c.logprobs)
                    if c.echo else self.logprobs(i, c.token_ids, c.logprobs),
                    "finish_reason": c.finish_reason,
                    **({"prompt_logprobs": self.prompt_logprobs(c)} if self.prompt_top is not None else {}),
                }
                for i, c in enumerate(choices)
            ]
        body["usage"] = usage
        body["system_fingerprint"] = None
        return body

    # -- stream chunks ----------------------------------------------------------------------------

    def chunk(
        self,
        index: int,
        *,
        text: str | None = None,
        role: bool = False,
        finish_reason: str | None = None,
        logprobs: dict[str, Any] | None = None,
        include_usage: bool = False,
        usage: dict[str, Any] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
        reasoning: str | None = None,
    ) -> dict[str, Any]:
        """One chunk; with ``include_usage`` it carries ``usage`` (None but on the last chunk, unless
        ``continuous_usage_stats`` asked for it on every one)."""
        if self.kind == "chat":
            body = self._head("chat.completion.chunk")
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if reasoning:
                delta["reasoning_content"] = delta["reasoning"] = reasoning
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            body = self._head("text_completion")
            choice = {
                "index": index,
                "text": text or "",
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        body["choices"] = [choice]
        body["system_fingerprint"] = None
        if include_usage:
            body["usage"] = usage
        return body

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        body = self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        body["choices"] = []
        body["system_fingerprint"] = None
        body["usage"] = usage
        return body
