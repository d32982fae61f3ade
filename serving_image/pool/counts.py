"""What an engine pool reports (its engines loaded, the memory they count, ``/v1/models``' cards, the errors naming
its engines) and counts (the requests in flight or waiting for an engine, which a drain waits for), over its listed
and leaving engines."""

from __future__ import annotations

from typing import Any

from kiln.serving.errors import APIError
from kiln.serving.pool.slot import LOADED, UNLOADED, EngineSlot

from kiln.memory_budget import human


class PoolCounts:
    slots: dict[str, EngineSlot]
    leaving: list[EngineSlot]
    budget: int
    budget_source: str
    follower: Any

    def served_names(self) -> str:
        """The engines' names, as errors name them: ``'a', 'b'``."""
        return ", ".join(repr(n) for n in sorted(self.slots)) or "no engines yet"

    def not_found(self, model: str) -> APIError:
        """404 for ``model``; one the engines file lists but that was refused says why (follow.EngineFileFollower)."""
        refused = self.follower.refused.get(model) if self.follower is not None else None
        why = (f"it is listed in --engines-file {self.follower.path} but not served: {refused[1]}; "
               if refused is not None else "")
        return APIError(404, f"The model {model!r} does not exist on this server; {why}the pool serves "
                        f"{self.served_names()} (see GET /v1/models)", param="model", code="model_not_found")

    def too_big(self, slot: EngineSlot) -> str:
        return (f"engine {slot.name!r} needs {human(slot.memory_bytes)} ({slot.memory_source}) but the pool's memory "
                f"budget is {human(self.budget)} ({self.budget_source}); raise --memory-budget (or the pod's memory "
                "limit) or serve this engine elsewhere")

    @property
    def num_loaded(self) -> int:
        return sum(1 for s in self.slots.values() if s.status == LOADED)

    @property
    def memory_in_use(self) -> int:
        return sum(s.memory_bytes for s in [*self.slots.values(), *self.leaving] if s.status != UNLOADED)

    def cards(self, created: int) -> list[dict[str, Any]]:
        """Each name once, as what a request naming it reaches (``slot_for``): an engine, else the adapter of the
        first loaded engine holding one of that name (two engines' adapters may share a name under ``--engine`` or
        ``--engines-file``)."""
        cards = [s.card(created) for s in self.slots.values()]
        seen = set(self.slots)
        for slot in sorted(self.slots.values(), key=lambda s: s.status != LOADED):
            for card in slot.loras.cards(created, slot.name):
                if card["id"] not in seen:
                    seen.add(card["id"])
                    cards.append(card)
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
