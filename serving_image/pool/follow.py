"""The pool's engine list at start and while serving.

``--engine`` engines are read at start: one that cannot be read or cannot fit the budget on its own stops the
server with a message naming both figures. ``--engines-file`` is re-read every :data:`POLL_S` seconds, as pods
follow the adapter list (:mod:`kiln.serving.lora_sync`): an engine added is served from its next request (its
memory read and checked first: one too big or unreadable is refused in the log, named in its requests' 404s and
tried again every :data:`RETRY_S` seconds, and the rest serve), one removed answers 404 at once and is unloaded when
its requests finish. A file that cannot be parsed keeps the engines served; a missing one lists none (logged).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from kiln.serving.lora_sync import POLL_S, RETRY_S

from kiln.engine_list import EngineEntry, read_file

log = logging.getLogger("kiln.serving")


async def start_pool(pool: Any) -> EngineFileFollower | None:
    """Add the flags' engines (ValueError: the server cannot start) and the file's; the file's follower."""
    for entry in pool.settings.engines.values():
        pool.add(await asyncio.to_thread(pool.make_slot, entry))
    path = pool.settings.engines_file
    if path is None:
        return None
    follower = pool.follower = EngineFileFollower(pool, path)
    await follower.sync()
    return follower


class EngineFileFollower:
    def __init__(self, pool: Any, path: Path) -> None:
        self.pool, self.path = pool, path
        self.held: dict[str, EngineEntry] = {}  # what this follower added, by name
        self.refused: dict[str, tuple[EngineEntry, str, float]] = {}  # listed, not added: (entry, why, when)
        self._missing = False  # the file was missing at the last pass (logged once)
        self._last: bytes | None = None
        self._removals: set[asyncio.Task[None]] = set()
        self._passing = asyncio.Lock()  # one pass at a time: the loop's, or a request's for a name not found

    async def run(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            await self.sync()

    async def sync(self) -> None:
        """One pass: if the file changed, add what it lists anew and remove what it no longer lists. A request
        naming no engine and no adapter runs one too (waiting for one under way) before its 404: the operator's
        adapter list (read at each request) and this file change together, and an engine taking an adapter's
        name must not leave the name unanswered until the next pass."""
        async with self._passing:
            await self._pass()

    async def _pass(self) -> None:
        raw = self._read()
        if raw == self._last:  # unchanged: a refused engine (a store error, say) is tried again now and then
            for entry, _, when in list(self.refused.values()):
                if time.monotonic() - when >= RETRY_S:
                    await self._add(entry)
            return
        self._last = raw
        try:
            want = read_file(self.path)
        except ValueError as exc:
            log.warning("pool: %s; keeping the %d engine(s) served", exc, len(self.pool.slots))
            return
        self.refused = {n: r for n, r in self.refused.items() if want.get(n) == r[0]}  # still listed: tried below
        flags = self.pool.settings.engines
        for name in sorted(set(want) & set(flags)):
            log.warning("pool: %s lists %r, also given by --engine; the flag's engine is served", self.path, name)
            want.pop(name)
        for name, entry in list(self.held.items()):
            if want.get(name) != entry:
                self._remove(name)
        for name, entry in want.items():
            if name not in self.held:
                await self._add(entry)

    def _read(self) -> bytes:
        try:
            raw, missing = self.path.read_bytes(), False
        except FileNotFoundError:
            raw, missing = b"", True
        except OSError:
            raw, missing = b"", False
        if missing and not self._missing:
            log.warning("pool: --engines-file %s does not exist: it lists no engines until it does (check the path)",
                        self.path)
        self._missing = missing
        return raw

    def _remove(self, name: str) -> None:
        self.held.pop(name)
        log.info("pool: engine %r is no longer listed in %s: unloaded once its requests finish", name, self.path)
        task = asyncio.get_running_loop().create_task(self.pool.remove(name), name=f"kiln-pool-remove-{name}")
        self._removals.add(task)
        task.add_done_callback(self._removals.discard)

    async def _add(self, entry: EngineEntry) -> None:
        try:
            slot = await asyncio.to_thread(self.pool.make_slot, entry)
        except ValueError as exc:  # too big, or no artifact there: this one refused, the rest serve
            if (self.refused.get(entry.name) or (None, None))[1] != str(exc):  # logged once per reason
                log.error("pool: %s: refused: %s; tried again every %ss", self.path, exc, RETRY_S)
            self.refused[entry.name] = (entry, str(exc), time.monotonic())
            return
        self.refused.pop(entry.name, None)
        self.held[entry.name] = entry
        self.pool.add(slot)
        log.info("pool: engine %r added from %s", entry.name, self.path)
