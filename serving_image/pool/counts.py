"""What an engine pool reports (its engines loaded, the memory they count, ``/v1/models``' cards) and counts (the
requests in flight or waiting for an engine, which a drain waits for), over its listed and leaving engines."""

from __future__ import annotations

from typing import Any

from kiln.serving.pool.slot import LOADED, UNLOADED, EngineSlot


class PoolCounts:
    slots: dict[str, EngineSlot]
    leaving: list[EngineSlot]

    @property
    def num_loaded(self) -> int:
        return sum(1 for s in self.slots.values() if s.status == LOADED)

    @property
    def memory_in_use(self) -> int:
        return sum(s.memory_bytes for s in [*self.slots.values(), *self.leaving] if s.status != UNLOADED)

    def cards(self, created: int) -> list[dict[str, Any]]:
        cards = [s.card(created) for s in self.slots.values()]
        for slot in self.slots.values():  # an adapter named as an engine is not what its name reaches (slot_for)
            cards += [c for c in slot.loras.cards(created, slot.name) if c["id"] not in self.slots]
        return cards

    def _members(self) -> list[EngineSlot]:
        return [*self.slots.values(), *self.leaving]

    @property
    def num_in_flight(self) -> int:
        """Requests in flight or waiting for their engine to be placed, removed engines' included: what a drain
        waits for."""
        return sum(s.state.num_in_flight + s.num_waiting for s in self._members())

    @property
    def num_waiting(self) -> int:
        """Requests waiting for their engine to be placed or loaded (the queue's among them): admitted by no engine
        yet, so in no engine's waiting count."""
        return sum(s.num_waiting for s in self._members())

    def generations(self) -> list[Any]:
        return [g for s in self._members() for g in s.state.generations]
