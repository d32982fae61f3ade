"""What the server knows about itself: its phase, its engine, and who is in flight.

The phase moves ``loading -> ready -> draining`` (or ``loading -> failed``);
``/ready`` answers 200 only in ``ready``. Admission is counted here, not in
the engine: every engine request a client asks for (a prompt times ``n``)
takes one slot, and a request that would push the count past
``max_batch_size + max_queue_len`` is refused with 429 before it allocates
anything, so a flood of clients cannot grow memory without bound.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kiln.serving.errors import APIError, engine_dead_error

log = logging.getLogger("kiln.serving")

LOADING, READY, DRAINING, FAILED = "loading", "ready", "draining", "failed"


@dataclass
class ServerState:
    max_queue_len: int
    retry_after_s: int = 1
    phase: str = LOADING
    engine: Any = None
    load_error: str | None = None
    num_in_flight: int = 0
    engine_info: dict[str, Any] = field(default_factory=dict)
    # Every live HTTP generation, so a drain that times out can abort them.
    generations: set[Any] = field(default_factory=set)
    # Told when the last request in flight finishes (a pool's engine: it may be evicted now).
    on_idle: Callable[[], None] | None = None
    _idle: asyncio.Event | None = None

    @property
    def is_ready(self) -> bool:
        return self.phase == READY

    @property
    def max_in_flight(self) -> int:
        return self.engine.engine_config.max_batch_size + self.max_queue_len

    def check_accepting(self) -> None:
        """Raise the 503 a client should see unless the server takes new requests."""
        if self.phase == DRAINING:
            raise APIError(503, "The server is shutting down; retry on another replica",
                           code="draining", headers={"Retry-After": str(self.retry_after_s)})
        if self.phase == READY and not getattr(self.engine, "is_running", True):
            raise engine_dead_error()
        if self.phase != READY:
            raise APIError(503, f"The model is not ready yet (phase: {self.phase}); retry shortly",
                           code="not_ready", headers={"Retry-After": str(self.retry_after_s)})

    def admit(self, num_requests: int) -> Admission:
        """Reserve ``num_requests`` engine slots, or raise the 503/429 the client should see."""
        self.check_accepting()
        if num_requests > self.max_in_flight:
            raise APIError(
                400,
                f"This request asks for {num_requests} generations (prompts x n) but the server "
                f"admits at most {self.max_in_flight} at once; lower n or send fewer prompts",
                param="n",
            )
        if self.num_in_flight + num_requests > self.max_in_flight:
            raise APIError(429, f"The server is at capacity ({self.num_in_flight} requests in flight, limit "
                           f"{self.max_in_flight}); retry after {self.retry_after_s}s",
                           code="queue_full", headers={"Retry-After": str(self.retry_after_s)})
        self.num_in_flight += num_requests
        return Admission(self, num_requests)

    def _release(self, num_requests: int) -> None:
        self.num_in_flight -= num_requests
        if self.num_in_flight == 0 and self._idle is not None:
            self._idle.set()
        if self.num_in_flight == 0 and self.on_idle is not None:
            self.on_idle()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is in flight; False if ``timeout`` passed first."""
        if self.num_in_flight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False
        finally:
            self._idle = None


class Admission:
    """Slots held by one HTTP request; ``release()`` is idempotent."""

    def __init__(self, state: ServerState, num_requests: int) -> None:
        self._state = state
        self._num = num_requests

    def release(self) -> None:
        if self._num:
            self._state._release(self._num)
            self._num = 0
