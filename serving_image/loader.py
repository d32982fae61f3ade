"""Load the engine in the background while the server already answers probes.

Kubernetes probes a pod from the moment its container starts, and a big
artifact takes minutes to fetch and load. So the socket is bound first and
this runs after: fetch + verify the artifact (if given), build the
``AsyncLLM`` (weights onto the device), start it, and warm it up with one
real generation, so the first client request does not pay for lazy
initialisation. Only then does the phase become ``ready``. The blocking part
runs in a daemon thread, so a SIGTERM during a long load can still exit.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import platform
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kiln.engine.host_cache import host_cache_dir
from kiln.serving.config import ServeConfig

from kiln import __version__

log = logging.getLogger("kiln.serving")


def freeze_heap() -> int:
    """Import the engine stack, collect, and move every object alive then out of the cyclic collector's reach
    (``gc.freeze``); returns how many. For a pool's process, before its first load: each unload collects its
    engine's cycles at once (the budget counts on the memory going), and that full collection walked every object
    torch and the server had made, 100 ms on the event loop (no request streamed meanwhile) against 2-8 ms frozen
    (SmolLM2 float32, Zen 4). Frozen objects are still freed when their last reference goes; only cycles among
    them would stay, so nothing an engine makes is frozen."""
    import kiln.engine  # noqa: F401 - what an engine's build imports; its module objects live as long as the process
    import torch  # noqa: F401

    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def in_daemon_thread(fn: Callable[[], Any]) -> Any:
    """Run blocking ``fn`` in a daemon thread (unlike the default executor, it never blocks exit)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:  # handed to the awaiting coroutine
            loop.call_soon_threadsafe(_settle, future, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, future, result, None)

    threading.Thread(target=run, name="kiln-load", daemon=True).start()
    return await future


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():  # the awaiting task was cancelled (SIGTERM during the load)
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def default_cache_dir() -> Path:
    return host_cache_dir("engines")


def fetch_artifact(uri: str, cache_dir: Path | None, verify_key: Path | None = None, pinned: bool = True) -> Path:
    """Download and checksum-verify an engine artifact; reuses a verified local copy.

    With ``verify_key`` (``--verify-key``/``$KILN_VERIFY_KEY``) the manifest must be signed by that key,
    checked before any file is downloaded (:class:`kiln.artifact_manifest.ArtifactUntrusted` otherwise).
    In a pod the operator started, ``$KILN_EXPECT_ARTIFACT`` says which build it verified
    (builder image, operator, content digest); an artifact whose manifest differs is refused, one line
    naming what differs (``pinned=False``: an adapter's artifact, which that engine pin does not describe;
    its signature is still checked). Without either (``kiln serve`` by hand): only the checksums.
    """
    from kiln.artifact_manifest import ArtifactExpectation
    from kiln.artifacts import parse_artifact_uri
    from kiln.signing import Verifier

    store, version = parse_artifact_uri(uri)
    expect = ArtifactExpectation.from_env(os.environ) if pinned else None
    verifier = Verifier.from_pem(verify_key) if verify_key is not None else None
    dest = (cache_dir or default_cache_dir()) / version
    log.info("fetching engine %s from %s into %s", version, store.uri, dest)
    if expect is not None:
        log.info("expecting an artifact built by %s", expect.built_by.describe())
    if verifier is None:
        log.warning("no --verify-key: the artifact's signature is not checked, and no native code it ships "
                    "(CPU kernel library, compiled GPU kernels) is loaded")
    started = time.monotonic()
    path = store.fetch(version, dest, expect=expect, verifier=verifier)
    if verifier is not None:
        log.info("the artifact is signed by the verify key %s...", verifier.key_id[:16])
    log.info("fetched and verified %s in %.1fs", version, time.monotonic() - started)
    return Path(path)


# A server's engine times a missing tactic table after /ready and re-chooses its compute threads from its own
# steps (EngineConfig settings, off in LLM(...)); --no-tactics-background / --no-thread-governor turn them off.
SERVER_DEFAULTS = {"tactics_background": True, "thread_governor": True}


def placed_engine_kwargs(config: ServeConfig, artifact_dir: Path | None) -> dict[str, Any]:
    """The engine overrides plus, for ranks started separately, where this process's ranks sit.

    The parallel sizes are the flags', else the artifact's ``engine.json`` (what it was sharded for).
    """
    kwargs = dict(config.engine_kwargs)
    if artifact_dir is not None:  # fetch_artifact refused it unless signed by the verify key, when one is given
        kwargs["trust_shipped_code"] = config.verify_key is not None
    if config.placement is None:
        return kwargs
    stored: dict[str, Any] = {}
    if artifact_dir is not None:
        stored = json.loads((artifact_dir / "engine.json").read_text()).get("engine_config") or {}
    tp = int(kwargs.get("tensor_parallel_size", stored.get("tensor_parallel_size", 1)))
    pp = int(kwargs.get("pipeline_parallel_size", stored.get("pipeline_parallel_size", 1)))
    kwargs.update(config.placement.engine_kwargs(tp, pp))
    return kwargs


def build_engine(config: ServeConfig) -> tuple[Any, dict[str, Any]]:
    """The (not yet started) AsyncLLM plus what ``/version`` reports about it."""
    # Fetch first: a wrong URI fails in a second, not after importing torch.
    path = fetch_artifact(config.artifact, config.cache_dir, config.verify_key) if config.artifact else None

    import torch
    from kiln.engine import AsyncLLM
    from kiln.engine.config import reported_settings

    info: dict[str, Any] = {"kiln_version": __version__, "torch_version": torch.__version__,
                            "python_version": platform.python_version()}
    if path is not None:
        meta = json.loads((path / "engine.json").read_text())
        # Threads and compute dtype for this host are chosen by the engine (kiln.engine.cpu_target).
        with serving_choices():
            engine = AsyncLLM.from_artifact(path, **{**SERVER_DEFAULTS, **placed_engine_kwargs(config, path)})
        info.update(artifact_uri=config.artifact, engine_version=meta.get("engine_version"),
                    built_with_kiln=meta.get("kiln_version"), built_with_torch=meta.get("torch_version"),
                    gpu=meta.get("gpu"))
    else:
        with serving_choices():
            threads = checkpoint_threads()
            engine = AsyncLLM(str(config.model), **{**SERVER_DEFAULTS, **placed_engine_kwargs(config, None)})
        info.update(model_dir=str(config.model), engine_version=None)
    info["torch_num_threads"] = torch.get_num_threads()
    # How `auto` tool calls are read back: the build's record, else the template's own markers.
    from kiln.engine.structured.tool_format import detect_tool_call_format

    recorded = (meta.get("chat") or {}).get("tool_call_format") if path is not None else None
    info["tool_call_format"] = recorded or detect_tool_call_format(getattr(engine.tokenizer, "chat_template", None))
    cfg = engine.engine_config
    info["engine_config"] = reported_settings(cfg)  # the settings EngineConfig marks reported
    # Artifact vs compute dtype, the native-dtype probe, the int8 path, the host and the thread choice.
    info["cpu_target"] = getattr(cfg, "cpu_target", None) or (threads if path is None else None)
    if engine.thread_governor is not None and info["cpu_target"] is not None:  # the count, re-chosen from the steps
        info["cpu_target"] = {**info["cpu_target"], "governor": engine.thread_governor.state}
    # Which tactic table runs the linears: the artifact's, one re-timed on this host (and what differed), ...
    info["tactics"] = getattr(cfg, "tactics_info", None)
    return engine, info


@contextmanager
def serving_choices():
    """What the engine chooses for a server, on this (the loading) thread: its compute threads leave a core to
    the server's own (``cpu_target.serving``)."""
    from kiln.engine.cpu_target import serving

    with serving():
        yield


def checkpoint_threads() -> dict[str, Any]:
    """A checkpoint directory has no build to take the thread count from: chosen here as for an artifact
    (``cpu_target.choose_threads``: ``$OMP_NUM_THREADS``, ``$KILN_CPU_THREADS``, the cgroup quota, the cores)."""
    import torch
    from kiln.engine.cpu_target import choose_threads

    threads, why = choose_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    return {"threads": torch.get_num_threads(), "threads_from": why}


async def warm_up(engine: Any) -> None:
    """One real greedy generation, so the first client does not pay for lazy initialisation."""
    from kiln.engine import SamplingParams

    ids = engine.tokenizer.encode("Hello") or [0]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    async for _ in engine.generate(ids, params, request_id="kiln-warmup"):
        pass


# The grammar warm-up waits for this long without a request in flight (loader.warm_up_grammar).
GRAMMAR_WARM_UP_IDLE_S = 1.0


async def warm_up_grammar(engine: Any, in_flight: Callable[[], int] = lambda: 0,
                          idle_s: float | None = None) -> None:
    """The grammar engine's view of the vocabulary and its checker processes, made after ``/ready`` once the server
    has had no request in flight for ``idle_s`` (``GRAMMAR_WARM_UP_IDLE_S``): only structured requests need them,
    and llguidance builds the view in one call that holds the GIL (0.3 s for SmolLM2's 49k tokens), which stalls
    every request it overlaps. Run at once after ready, it made the first request after ready take 0.5 s, not
    0.02 (SmolLM2, one thread), which is when a rolling update sends a new pod its traffic. A structured request
    that comes first builds what it needs itself (``GrammarCompiler._tokenizer`` under its lock, a checker per
    compile thread on first use), so nothing waits for this and nothing is done twice."""
    idle_s = GRAMMAR_WARM_UP_IDLE_S if idle_s is None else idle_s
    quiet_since: float | None = None  # when a poll first saw nothing in flight (a request may have ended before)
    while True:
        now = time.monotonic()
        if in_flight():
            quiet_since = None
        elif quiet_since is None:
            quiet_since = now
        elif now - quiet_since >= idle_s:
            break
        await asyncio.sleep(min(0.1, idle_s / 4 or 0.01))
    from kiln.engine.errors import RequestError

    started = time.monotonic()
    try:
        compiler = engine.engine.grammar_compiler  # made here, on the loop's thread, as a request would make it
        await in_daemon_thread(compiler.warm_up)
        log.info("grammar compiler warmed up in %.1fs (after ready, once idle)", time.monotonic() - started)
    except RequestError as exc:  # the model serves; constrained requests get this as a 400
        log.warning("structured outputs are unavailable for this model: %s", exc)
    except Exception as exc:  # noqa: BLE001 - a warm-up's failure must not take a serving engine down
        log.warning("the grammar compiler's warm-up failed (%s); structured requests will start it", exc)
