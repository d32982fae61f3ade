"""The scheduler's policy over the ``max_loras`` device slots. No tensors.

A request under an adapter is admitted only when its adapter holds a slot or one can be given to it: an
empty slot, else the least recently used slot whose adapter no running request uses. Its slot is then
pinned until it finishes or is preempted; a slot held by a running request's adapter is never taken.
Requests that cannot get a slot stay in the waiting queue (others behind them go on, as vLLM's scheduler
does). A newly assigned slot is a pending load the runner applies before the step runs (on every rank).
An unloaded adapter's slots are emptied the same way (a pending load of None), at once when idle, else when
their last request releases them: no unloaded adapter's weights stay on the device.
"""

from __future__ import annotations

import itertools
from typing import Any


class SlotTable:
    def __init__(self, max_loras: int) -> None:
        self.holder: list[int | None] = [None] * max_loras  # adapter int_id per slot
        self.users = [0] * max_loras   # running requests per slot
        self.last_used = [0] * max_loras
        self._clock = itertools.count(1)
        self.pending: list[tuple[int, Any]] = []  # (slot, adapter or None: empty it) to load before the next step
        self.retired: set[int] = set()  # int_ids of unloaded adapters whose slots still have running requests

    def _find(self, adapter: Any) -> int | None:
        for s, held in enumerate(self.holder):
            if held == adapter.int_id:
                return s
        return None

    def _free_slot(self) -> int | None:
        free = [s for s, n in enumerate(self.users) if n == 0]
        empty = [s for s in free if self.holder[s] is None]
        if empty:
            return empty[0]
        return min(free, key=lambda s: self.last_used[s]) if free else None

    def can_acquire(self, adapter: Any) -> bool:
        return adapter is None or self._find(adapter) is not None or self._free_slot() is not None

    def acquire(self, adapter: Any) -> int:
        """Pin a slot holding ``adapter`` (assigning one, a pending load, if needed); call after can_acquire."""
        slot = self._find(adapter)
        if slot is None:
            slot = self._free_slot()
            assert slot is not None, "acquire without a free slot"
            self.holder[slot] = adapter.int_id
            self.pending = [(s, a) for s, a in self.pending if s != slot] + [(slot, adapter)]
        self.users[slot] += 1
        self.last_used[slot] = next(self._clock)
        return slot

    def release(self, slot: int) -> None:
        self.users[slot] -= 1
        assert self.users[slot] >= 0
        if self.users[slot] == 0 and self.holder[slot] in self.retired:
            self._empty(slot)

    def forget(self, int_ids: set[int]) -> None:
        """Empty the slots of these (unloaded) adapters: now where no request runs under them, else at release."""
        for slot, held in enumerate(self.holder):
            if held in int_ids:
                if self.users[slot]:
                    self.retired.add(held)
                else:
                    self._empty(slot)

    def _empty(self, slot: int) -> None:
        self.retired.discard(self.holder[slot])
        self.holder[slot] = None
        self.pending = [(s, a) for s, a in self.pending if s != slot] + [(slot, None)]

    def take_loads(self) -> list[tuple[int, Any]]:
        loads, self.pending = self.pending, []
        return loads
