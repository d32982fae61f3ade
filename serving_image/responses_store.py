"""The Responses API's stored responses: bounded, per process, forgotten after a time.

``store: true`` (the default) keeps a response and the conversation that led to it, so that
``previous_response_id`` can continue it and ``GET``/``DELETE /v1/responses/{id}`` find it. The
store holds at most ``--responses-store-size`` responses (the least recently used goes first) and
``MAX_STORED_CHARS`` characters of conversation in all, each for ``--responses-store-ttl`` seconds.
It lives in this process only: another replica does not know the id (docs/serving.md says what
that means behind a load balancer), and a restart forgets every response.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

MAX_STORED_CHARS = 256 * 2**20  # conversation text kept in all, whatever the count allows


@dataclass
class Stored:
    response: dict[str, Any]  # the response body as it was answered
    conversation: list[dict[str, Any]]  # chat messages: what it was asked (instructions aside) and answered
    expires: float
    num_chars: int = 0


@dataclass
class ResponseStore:
    max_entries: int
    ttl_s: float
    max_chars: int = MAX_STORED_CHARS
    _entries: OrderedDict[str, Stored] = field(default_factory=OrderedDict)
    _num_chars: int = 0

    def put(self, response_id: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        if self.max_entries == 0:
            return
        size = sum(len(str(m.get("content") or "")) + len(str(m.get("tool_calls") or "")) for m in conversation)
        self.delete(response_id)
        self._entries[response_id] = Stored(response, conversation, time.monotonic() + self.ttl_s, size)
        self._num_chars += size
        while self._entries and (len(self._entries) > self.max_entries or self._num_chars > self.max_chars):
            self.delete(next(iter(self._entries)))

    def get(self, response_id: str) -> Stored | None:
        stored = self._entries.get(response_id)
        if stored is None:
            return None
        if stored.expires <= time.monotonic():
            self.delete(response_id)
            return None
        self._entries.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        stored = self._entries.pop(response_id, None)
        if stored is None:
            return False
        self._num_chars -= stored.num_chars
        return True

    def __len__(self) -> int:
        return len(self._entries)
