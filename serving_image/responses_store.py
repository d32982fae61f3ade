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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kiln.serving.errors import APIError

MAX_PAGE = 100  # OpenAI's largest list page
MAX_STORED_CHARS = 256 * 2**20  # conversation text kept in all, whatever the count allows


@dataclass
class Stored:
    response: dict[str, Any]  # the response body as it was answered
    conversation: list[dict[str, Any]]  # chat messages: what it was asked (instructions aside) and answered
    expires: float
    num_chars: int = 0
    input_items: list[dict[str, Any]] = field(default_factory=list)  # its request's input, as items with ids


@dataclass
class ResponseStore:
    max_entries: int
    ttl_s: float
    max_chars: int = MAX_STORED_CHARS
    _entries: OrderedDict[str, Stored] = field(default_factory=OrderedDict)
    _num_chars: int = 0

    def put(self, response_id: str, response: dict[str, Any], conversation: list[dict[str, Any]],
            input_items: list[dict[str, Any]] | None = None) -> None:
        if self.max_entries == 0:
            return
        size = sum(len(str(m.get("content") or "")) + len(str(m.get("tool_calls") or "")) for m in conversation)
        size += sum(len(str(item)) for item in input_items or ())
        self.delete(response_id)
        self._entries[response_id] = Stored(response, conversation, time.monotonic() + self.ttl_s, size,
                                            list(input_items or ()))
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


def page_of(items: list[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    """A page of ``items`` as OpenAI lists one (``object: list``, ``first_id``, ``last_id``, ``has_more``), by the
    query's ``order`` (``desc``, the default, or ``asc``), ``limit`` (1-100, default 20) and ``after``/``before``
    cursors (item ids); a bad value is a 400 naming the parameter."""
    limit, order = query.get("limit", "20"), query.get("order", "desc")
    if not limit.isdigit() or not 1 <= int(limit) <= MAX_PAGE:
        raise APIError(400, f"limit must be an integer from 1 to {MAX_PAGE} (got {limit!r})", param="limit")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be 'asc' or 'desc' (got {order!r})", param="order")
    ordered = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    for cursor in ("after", "before"):
        if cursor in query and query[cursor] not in ids:
            raise APIError(400, f"{cursor}: {query[cursor]!r} is not an item of this list; pass an id a page gave",
                           param=cursor)
    window = ordered[ids.index(query["after"]) + 1 if "after" in query else 0:
                     ids.index(query["before"]) if "before" in query else len(ordered)]
    page = window[:int(limit)]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(window) > len(page)}
