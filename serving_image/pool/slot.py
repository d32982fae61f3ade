"""One engine of a pool, shaped as the request path sees a server (``ctx.state``, ``ctx.loras``...).

The request path (:mod:`kiln.serving.request_path`) asks the app for the serving context of a request's
``model`` (``ServingContext.serving_for``): a single-engine server answers itself, a pool answers the
:class:`EngineSlot` of that engine, loaded. Each slot has its own :class:`ServerState`, so its admissions are
its requests in flight (what eviction must never cut), and its own LoRA registry and adapter follower (the
adapter list names each adapter's ``baseEngineVersion``, so one list serves every engine of the pool), and its
request series on ``/metrics`` carry its name as ``model_name``.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from kiln.serving.config import ServeConfig
from kiln.serving.lora import LoRARegistry
from kiln.serving.lora_sync import AdapterSync, adapters_file, pinned_problem
from kiln.serving.server_state import LOADING, READY, ServerState

from kiln.engine_list import EngineEntry
from kiln.memory_budget import engine_memory, human

log = logging.getLogger("kiln.serving")

# A build makes about a thousand torch calls, each giving up the interpreter's lock and waiting to take it back from
# the loaded engines' step loops and the server's: at Python's 5 ms switch interval SmolLM2 float32 rebuilt in
# 0.28-1.26 s beside a stepping engine against 0.04-0.12 s alone. kiln bench --pool (Zen 4): 0.74x of one server
# per engine with 0.5 ms while a build runs, 0.69x without, in the same hour (docs/pools.md).
LOAD_SWITCH_INTERVAL_S = 0.0005
_handover = {"builds": 0, "usual": 0.005}

UNLOADED, LOADED, UNLOADING = "unloaded", "loaded", "unloading"  # and LOADING, the server's own word
# A load that added more to the server's RSS than the engine counts, by both of these (a tenth, and more than the
# allocator's and Python's own drift), raises what it counts (learn_memory).
LEARN_ABOVE, LEARN_ABOVE_BYTES = 1.1, 64 * 2**20


class EngineSlot:
    def __init__(self, entry: EngineEntry, base: ServeConfig, metrics: Any) -> None:
        self.entry = entry
        self.name = self.served_model_name = entry.name
        self.model_names = {entry.name}
        self.config = replace(base, model=None, artifact=entry.artifact_uri, served_model_name=entry.name,
                              lora_modules=[])
        # The server's series, labelled with this engine's name (model_name) rather than the pool's.
        self.metrics = copy.copy(metrics)
        self.metrics.labels = {**metrics.labels, "model_name": entry.name}
        self.state = ServerState(max_queue_len=base.max_queue_len)
        self.loras = LoRARegistry(self)
        self.adapter_sync: AdapterSync | None = None
        self.status = UNLOADED
        self.task: Any = None  # the load or unload under way (an asyncio.Task)
        self.memory_bytes = 0
        self.memory_source = ""
        self.learned_bytes = 0  # the RSS a load of it added here, where above what its artifact says (learn_memory)
        self.version = ""  # the artifact's version (its engine_version), read with its memory
        self.last_used = time.monotonic()
        self.num_waiting = 0  # requests that asked for this engine and wait for it to load
        self.load_error: str | None = None
        self.failed_at = 0.0  # when the last load failed (monotonic)

    @property
    def is_busy(self) -> bool:
        """Requests in flight or waiting for it: never evicted."""
        return self.state.num_in_flight > 0 or self.num_waiting > 0

    def read_memory(self) -> None:
        """What this engine counts against the budget, from its ``engine.json``, read only once verified
        (:meth:`_verified_engine_json`): the budget's decisions rest on the signed build's own figure."""
        raw = self._verified_engine_json()
        try:
            self.memory_bytes, self.memory_source = engine_memory(json.loads(raw))
        except ValueError as exc:  # not JSON, or a field not what a build writes: this engine refused, naming it
            raise ValueError(f"engine {self.name!r} ({self.entry.artifact_uri}): engine.json: {exc}") from None

    def learn_memory(self, added: int) -> bool:
        """Count ``added``, the RSS a load of this engine added to the server with nothing else under way, from
        now on where it is more than the engine counts (by ``LEARN_ABOVE`` and ``LEARN_ABOVE_BYTES``): its build
        measured it on another kind of host (an int8 engine re-timed here may hold a second copy of its weights),
        or measured less than a load here takes. Never lowers the count (a load may reuse memory freed before)."""
        if added <= self.memory_bytes * LEARN_ABOVE or added - self.memory_bytes <= LEARN_ABOVE_BYTES:
            return False
        log.warning("pool: engine %r added %s to the server's RSS when it loaded, above the %s it counted (%s): "
                    "it counts %s from now on", self.name, human(added), human(self.memory_bytes),
                    self.memory_source, human(added))
        self.memory_source = f"the RSS its load added in this server, above the {human(self.memory_bytes)} " \
                             f"{self.memory_source}"
        self.memory_bytes = self.learned_bytes = added
        return True

    def _verified_engine_json(self) -> bytes:
        """``engine.json`` after the checks every fetch makes first (:meth:`ArtifactStore.fetch`): the store's
        manifest signed by ``--verify-key`` when one is given, the build ``$KILN_EXPECT_ARTIFACT`` names when set,
        the content digest the engines file pinned; then the file (the local cache's copy when it matches, else
        the store's) must have the digest that manifest records. ValueError naming the engine and what failed."""
        from kiln.serving.loader import default_cache_dir

        from kiln.artifact_manifest import ArtifactExpectation, bytes_sha256
        from kiln.artifacts import parse_artifact_uri
        from kiln.signing import Verifier

        where = f"engine {self.name!r} ({self.entry.artifact_uri})"
        try:
            store, self.version = parse_artifact_uri(self.entry.artifact_uri)
            manifest, document = store.read_signed_manifest(self.version)
            verifier = Verifier.from_pem(self.config.verify_key) if self.config.verify_key is not None else None
            expect = ArtifactExpectation.from_env(os.environ)
        except Exception as exc:  # a store or key error: say which engine and where
            raise ValueError(f"{where}: its manifest cannot be read: {exc}") from None
        if manifest is None:
            raise ValueError(f"{where}: no artifact there (no valid manifest.json); check the URI, or build it with "
                             "kiln build")
        pinned = self.entry.content_digest
        problem = ((verifier.problem(document) if verifier is not None else None)
                   or (expect.mismatch(manifest) if expect is not None else None)
                   or (f"its content digest is {manifest.content_digest[:16]}..., the engines file pinned "
                       f"{pinned[:16]}..." if pinned is not None and pinned != manifest.content_digest else None))
        if problem is not None:
            raise ValueError(f"{where}: refusing this artifact: {problem}")
        entry = next((f for f in manifest.files if f.path == "engine.json"), None)
        cached = (self.config.cache_dir or default_cache_dir()) / self.version / "engine.json"
        raw = cached.read_bytes() if entry is not None and cached.is_file() else None
        if entry is not None and raw is not None and bytes_sha256(raw) == entry.sha256:
            return raw
        try:  # the store's copy, checked against the manifest as the operator reads it (ArtifactStore.read_file)
            return store.read_file(manifest, "engine.json")
        except Exception as exc:
            raise ValueError(f"{where}: its engine.json cannot be used: {exc}") from None

    def build(self) -> tuple[Any, dict[str, Any]]:
        """Fetch (from the local cache when there, verified) and build the engine: blocking, for a thread."""
        from kiln.serving.loader import build_engine, default_cache_dir

        from kiln.artifacts import parse_artifact_uri

        engine, info = build_engine(self.config)
        if self.entry.content_digest is not None:  # the verified copy must be the build a controller pinned
            _, version = parse_artifact_uri(self.entry.artifact_uri)
            try:
                pinned_problem((self.config.cache_dir or default_cache_dir()) / version, self.entry.content_digest)
            except Exception:
                del engine  # built, never started: dropping it frees it
                gc.collect()
                raise
        return engine, info

    async def load(self) -> None:
        """Build and start the engine. No warm-up: a request is waiting for this engine, and its own first step
        does that work; the grammar compiler's view of the vocabulary (seconds, holding the GIL) is built by the
        first structured request (a background build slowed every engine's first requests more than it saved)."""
        from kiln.serving.loader import in_daemon_thread

        with quick_handover():
            engine, info = await in_daemon_thread(self.build)
        self.state.engine = engine
        try:
            await engine.start()
        except BaseException:
            await self._close(engine)
            raise
        self.state.engine_info, self.state.phase = info, READY
        self.loras = LoRARegistry(self)
        path = adapters_file()
        if path is not None:  # this engine's adapters of the list; one that fails is logged, not fatal
            self.adapter_sync = AdapterSync(self, path)
            await self.adapter_sync.sync(info.get("engine_version"))

    async def unload(self) -> None:
        engine = self.state.engine
        self.state.engine, self.state.engine_info, self.state.phase = None, {}, LOADING
        self.adapter_sync = None
        self.loras = LoRARegistry(self)
        if engine is not None:  # handed over whole: no reference here while _close collects the engine's cycles
            held = [engine]
            del engine
            await self._close(held.pop())

    async def _close(self, engine: Any) -> None:
        from kiln.serving.constraints import close_compiler

        self.state.engine = None
        await engine.shutdown()
        close_compiler(engine)
        del engine
        gc.collect()  # the weights go now, not at some later collection: the budget counts on it
        _return_freed_memory()

    def card(self, created: int) -> dict[str, Any]:
        state = LOADING if self.status == LOADING else LOADED if self.status == LOADED else UNLOADED
        card: dict[str, Any] = {"id": self.name, "object": "model", "created": created, "owned_by": "kiln",
                                "root": self.entry.artifact_uri, "parent": None, "state": state,
                                "memory_bytes": self.memory_bytes}
        if self.state.engine is not None:
            card["max_model_len"] = self.state.engine.engine_config.max_seq_len
        if self.load_error:
            card["load_error"] = self.load_error
        return card


@contextlib.contextmanager
def quick_handover() -> Iterator[None]:
    """While an engine builds, the interpreter's lock changes hands every :data:`LOAD_SWITCH_INTERVAL_S` rather
    than every 5 ms (Python's), then as before once no build is left (builds may overlap: counted). On the event
    loop's thread, so the count needs no lock."""
    if _handover["builds"] == 0:
        _handover["usual"] = sys.getswitchinterval()
        sys.setswitchinterval(LOAD_SWITCH_INTERVAL_S)
    _handover["builds"] += 1
    try:
        yield
    finally:
        _handover["builds"] -= 1
        if _handover["builds"] == 0:
            sys.setswitchinterval(_handover["usual"])


def _return_freed_memory() -> None:
    """Hand the freed heap back to the system (glibc's ``malloc_trim``). Engines load in threads of their own, so
    their memory is spread over several malloc arenas that glibc keeps once freed: measured on SmolLM2 over four
    unloads, the server's RSS after an unload grew from 1.3 to 2.4 GiB without this, and stayed at 1.1 GiB with it.
    No-op where there is no glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:
        pass
