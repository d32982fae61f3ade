"""The adapters an operator tells a pod to hold: its ``<engine>-adapters`` ConfigMap, mounted as a file.

On a cluster the operator builds each adapter of ``spec.lora.adapters`` into a signed artifact of its own and
lists the built ones in a ConfigMap the serving pods mount (``$KILN_LORA_ADAPTERS_FILE``; the kubelet
rewrites the file in place, so the pod template never changes and no pod restarts)::

    {"format": 1, "adapters": [{"name": ..., "artifactURI": ..., "version": ...,
                                "baseEngineVersion": ..., "contentDigest": ...}, ...]}

:class:`AdapterSync` reads it every few seconds and makes the server hold exactly the listed adapters whose
``baseEngineVersion`` is the engine it serves (during a base rollout the file lists both): a new entry is
fetched like an engine (signature checked with ``--verify-key`` before any file is downloaded, every file
against its digest, and the manifest's content digest against the ``contentDigest`` the operator pinned) and
loaded in the background; a removed one is unloaded. Passes run one at a time (the load's first pass and the
follower's ticks, which start once the engine's version is known): an engine's removal is queued on its step
thread, and a pass that overlapped one still waiting could act on a file read before it and leave the server
holding what the file no longer lists (issue 38, the update race). Adapters given by
``--lora-modules`` or loaded through the API are not its to touch. A failed fetch or load is logged once
and tried again at the next change of the file or after a back-off; the rest keep serving.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from kiln.adapter_list import ADAPTERS_FILE_ENV, wanted

log = logging.getLogger("kiln.serving")

POLL_S = 2.0
RETRY_S = 30.0


class AdapterSync:
    """Keeps the server's adapters equal to what the operator's file lists for its engine."""

    def __init__(self, ctx: Any, path: Path) -> None:
        self.ctx, self.path = ctx, path
        self.held: dict[str, str] = {}  # name -> artifact URI, the adapters this sync loaded
        self.failed: dict[str, float] = {}  # "name@uri" -> when it last failed
        self._last: tuple[bytes, str | None] | None = None
        self._pass = asyncio.Lock()  # one pass at a time

    async def run(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            info = self.ctx.state.engine_info  # {} while loading: the first pass runs in the load, before /ready
            if info:
                await self.sync(info.get("engine_version"))

    async def sync(self, engine_version: str | None) -> None:
        """One pass: read the file and, if it changed (or a failed adapter is due again), apply it; a pass
        waits for the one running, then reads the file as it is by then."""
        async with self._pass:
            await self._sync(engine_version)

    async def _sync(self, engine_version: str | None) -> None:
        try:
            raw = self.path.read_bytes()
        except OSError:
            raw = b""  # an optional ConfigMap not created yet: hold none
        # The engine's version is part of what was applied: a pass that ran before the engine was known (the
        # follower's first tick can race the load) must not make the file look handled for the real version.
        if (raw, engine_version) == self._last and not self._retry_due():
            return
        self._last = (raw, engine_version)
        try:
            document = json.loads(raw) if raw.strip() else {}
        except ValueError as exc:
            log.warning("%s is not JSON (%s): keeping the adapters held", self.path, exc)
            return
        await self.apply(wanted(document, engine_version))

    def _retry_due(self) -> bool:
        return any(time.monotonic() - at > RETRY_S for at in self.failed.values())

    async def apply(self, want: dict[str, dict[str, str]]) -> None:
        """Unload what is no longer wanted (or moved to another artifact), then load what is missing."""
        for name, uri in list(self.held.items()):
            if want.get(name, {}).get("artifactURI") != uri:
                await self._unload(name)
        for name, entry in want.items():
            if name not in self.held:
                await self._load(name, entry["artifactURI"], entry.get("contentDigest"))

    async def _unload(self, name: str) -> None:
        from kiln.serving.errors import APIError

        self.held.pop(name, None)
        try:
            await self.ctx.loras.remove(name)
            log.info("LoRA adapter %r unloaded: no longer listed in %s", name, self.path)
        except APIError as exc:
            log.warning("LoRA adapter %r could not be unloaded: %s", name, exc.message)

    async def _load(self, name: str, uri: str, digest: str | None = None) -> None:
        """Fetch and load one adapter; ``digest``: the content digest the operator pinned (listed in the file),
        any other refused."""
        from kiln.serving.errors import APIError
        from kiln.serving.loader import fetch_artifact, in_daemon_thread

        key = f"{name}@{uri}"
        if key in self.failed and time.monotonic() - self.failed[key] < RETRY_S:
            return
        config = self.ctx.config
        try:
            path = await in_daemon_thread(lambda: fetch_artifact(uri, config.cache_dir, config.verify_key,
                                                                    pinned=False))
            pinned_problem(path, digest)
            await self.ctx.loras.add(name, str(path))
        except APIError as exc:
            self.failed[key] = time.monotonic()
            log.error("LoRA adapter %r (%s) refused: %s", name, uri, exc.message)
            return
        except Exception as exc:  # a store or signature problem: one line, tried again later
            self.failed[key] = time.monotonic()
            log.error("LoRA adapter %r (%s) could not be fetched: %s", name, uri, exc)
            return
        self.failed.pop(key, None)
        self.held[name] = uri
        log.info("LoRA adapter %r loaded from %s", name, uri)


def pinned_problem(path: Path, digest: str | None) -> None:
    """Raise when the fetched (signed, checksummed) artifact at ``path`` is not the build the operator pinned."""
    if digest is None:  # a file from an operator that pinned no digest
        return
    from kiln.artifact_manifest import MANIFEST_NAME, ArtifactUntrusted, Manifest

    got = Manifest.model_validate_json((path / MANIFEST_NAME).read_bytes()).content_digest
    if got != digest:
        raise ArtifactUntrusted(f"its content digest is {got[:16]}..., the operator pinned {digest[:16]}... (the "
                                "adapter was replaced in the store after the operator checked it); the LLMEngine's "
                                "status.adapters says what the operator found")


def adapters_file(env: dict[str, str] | os._Environ = os.environ) -> Path | None:
    """``$KILN_LORA_ADAPTERS_FILE`` (set by the operator on pods of an engine with ``spec.lora``)."""
    value = env.get(ADAPTERS_FILE_ENV, "").strip()
    return Path(value) if value else None
