"""The FastAPI app: probes, metrics, version, models, and the OpenAI routes.

``create_app`` builds everything from a :class:`ServeConfig` without touching
the engine; the lifespan starts loading it in the background (see
:mod:`kiln.serving.loader`), so ``/health`` and ``/ready`` answer while a
long load runs. Probe and metrics endpoints never need the API key; the
``/v1`` endpoints and ``/version`` do when one is configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from kiln.serving import lora, prefix, routes, tokenizing
from kiln.serving.auth import require_api_key
from kiln.serving.config import ServeConfig
from kiln.serving.constraints import close_compiler
from kiln.serving.errors import APIError, install_error_handlers
from kiln.serving.loader import build_engine, in_daemon_thread, warm_up, warm_up_grammar
from kiln.serving.lora import LoRARegistry, runtime_updating_allowed
from kiln.serving.lora_sync import POLL_S, AdapterSync, adapters_file
from kiln.serving.metrics import CONTENT_TYPE, ServingMetrics
from kiln.serving.openapi import openapi_schema
from kiln.serving.pool.follow import start_pool
from kiln.serving.pool.pool import EnginePool
from kiln.serving.pool.settings import PoolSettings
from kiln.serving.server_state import DRAINING, FAILED, LOADING, READY, ServerState

from kiln import __version__

log = logging.getLogger("kiln.serving")


class ServingContext:
    """Everything a request handler needs, hung on ``app.state.kiln``."""

    def __init__(self, config: ServeConfig, pool: PoolSettings | None = None) -> None:
        self.config = config
        self.state = ServerState(max_queue_len=config.max_queue_len)
        self.served_model_name = config.model_name
        self.model_names = {self.served_model_name}
        self.loras = LoRARegistry(self)  # adapters served by name ("model": NAME), docs/lora.md
        path = adapters_file()  # the adapters an operator (or kiln up) lists, followed while serving
        # A pool's engines follow the list each for itself (kiln.serving.pool.slot).
        self.adapter_sync = AdapterSync(self, path) if path is not None and pool is None else None
        self.metrics = ServingMetrics(self.served_model_name, self._engine_stats, self._lora_info)
        # Several engines (docs/pools.md): requests are placed by their model; None: this one engine serves all.
        self.pool = EnginePool(pool, config, self.metrics) if pool is not None else None
        self.pool_follower: Any = None
        self.grammar_warm_up: asyncio.Task | None = None  # started once ready (loader.warm_up_grammar)
        self.created = int(time.time())
        self.exit_code = 0
        self.on_fatal: Callable[[], None] | None = None  # set by the server: stop after a failed load

    def _engine_stats(self) -> Any | None:
        engine = self.state.engine
        if engine is None or self.state.phase not in (READY, DRAINING):
            return None
        return engine.stats()

    def _lora_info(self) -> dict[str, Any] | None:
        engine = self.state.engine
        if engine is None or self.state.phase not in (READY, DRAINING):
            return None
        return engine.engine.lora_info()

    async def serving_for(self, model: str) -> Any:
        """The context a request for ``model`` runs in (``state``, ``loras``, ``metrics``...): this server's own,
        or a pool's engine for that model, loaded (404 for a model it does not serve, 503 when it cannot be
        placed). Nothing between this and the request's admission may yield to the loop (kiln.serving.pool.pool)."""
        return self if self.pool is None else await self.pool.acquire(model)

    async def wait_idle(self, timeout: float) -> bool:
        """Nothing in flight (a pool: on any of its engines) within ``timeout``."""
        return await (self.pool or self.state).wait_idle(timeout)

    def in_flight(self) -> tuple[int, list[Any]]:
        """Requests in flight and their generations, on this engine or every engine of the pool."""
        if self.pool is not None:
            return self.pool.num_in_flight, self.pool.generations()
        return self.state.num_in_flight, list(self.state.generations)

    async def load(self) -> None:
        if self.pool is not None:
            return await self._start_pool()
        started = time.monotonic()
        try:
            engine, info = await in_daemon_thread(lambda: build_engine(self.config))
            self.state.engine = engine
            await engine.start()
            await warm_up(engine)
            for module in self.config.lora_modules:  # --lora-modules: each read and checked before ready
                await self.loras.add(module["name"], module["path"], module.get("base_model_name"))
            if self.adapter_sync is not None:  # the listed adapters too (one that fails is logged, not fatal)
                await self.adapter_sync.sync(info.get("engine_version"))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if isinstance(exc, APIError):  # a --lora-modules adapter refused: say why as a load error
                exc = ValueError(f"--lora-modules: {exc.message}")
            return self._failed(exc)
        self.state.engine_info = info
        if self.state.phase == LOADING:
            self.state.phase = READY
        log.info("model %r ready in %.1fs (max_batch_size=%d, max_queue_len=%d)", self.served_model_name,
                 time.monotonic() - started, engine.engine_config.max_batch_size, self.config.max_queue_len)
        # after /ready, once idle: structured requests only
        self.grammar_warm_up = asyncio.create_task(warm_up_grammar(engine, lambda: self.state.num_in_flight))


    async def _start_pool(self) -> None:
        """A pool is ready once its engines are listed and each fits the budget; each loads on demand."""
        assert self.pool is not None
        try:
            self.pool_follower = await start_pool(self.pool)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return self._failed(exc)
        self.state.engine_info = {"pool": {"engines": sorted(self.pool.slots), "memory_budget_bytes": self.pool.budget,
                                           "memory_budget_from": self.pool.budget_source}}
        if self.state.phase == LOADING:
            self.state.phase = READY
        log.info("pool ready: %d engine(s), budget %d bytes (%s), at most %s loaded", len(self.pool.slots),
                 self.pool.budget, self.pool.budget_source, self.pool.settings.max_loaded_engines or "any number")

    def _failed(self, exc: Exception) -> None:
        self.state.phase, self.state.load_error = FAILED, str(exc)
        self.exit_code = 1
        if _is_user_error(exc):
            log.error("kiln serve: could not load the model: %s", exc)
        else:
            log.exception("kiln serve: could not load the model")
        if self.on_fatal is not None:
            self.on_fatal()

    async def watch_group(self, grace_s: float) -> None:
        """A parallel engine whose group broke (a rank died, a collective timed out) cannot heal:
        /health and /ready answer 503 at once, and after ``grace_s`` (so probes and logs see why)
        the leader exits 1, which makes a LeaderWorkerSet recreate the whole group."""
        while True:
            await asyncio.sleep(0.25)
            engine = self.state.engine
            world = getattr(getattr(engine, "engine_config", None), "world_size", 1)
            if engine is None or world == 1 or not _engine_dead(self.state):
                continue
            log.error("kiln serve: the engine group broke (%s); /health is 503, exiting 1 in %.0fs so the "
                      "group restarts", getattr(engine, "_error", None), grace_s)
            await asyncio.sleep(grace_s)
            self.exit_code = 1
            if self.on_fatal is not None:
                self.on_fatal()
            return


def _is_user_error(exc: BaseException) -> bool:
    """A failure the message explains (bad setting, missing, corrupt or unsigned artifact, a bad key file):
    no traceback."""
    from kiln.artifact_manifest import StoreError
    from kiln.signing import SigningError

    return isinstance(exc, ValueError | OSError | StoreError | SigningError)


probes = APIRouter()
models = APIRouter()


def _engine_dead(state: ServerState) -> bool:
    """The engine's step loop died after loading: only a restart helps."""
    return state.phase in (READY, DRAINING) and not getattr(state.engine, "is_running", True)


@probes.get("/health")
async def health(request: Request) -> JSONResponse:
    """Liveness: the process and its event loop answer, and the engine loop (once loaded) is alive."""
    if _engine_dead(request.app.state.kiln.state):
        return JSONResponse({"status": "engine_dead"}, status_code=503)
    return JSONResponse({"status": "ok"})


@probes.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """Readiness: 200 only when the engine is loaded, warmed up, alive and not draining."""
    state = request.app.state.kiln.state
    body: dict[str, Any] = {"status": "engine_dead" if _engine_dead(state) else state.phase}
    if state.load_error:
        body["error"] = state.load_error
    return JSONResponse(body, status_code=200 if state.is_ready and body["status"] == READY else 503)


@probes.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.kiln.metrics.render(), media_type=CONTENT_TYPE)


@models.get("/version")
async def version(request: Request) -> dict[str, Any]:
    """What runs here (versions, engine config); behind the API key when one is set: it tells an
    attacker which kiln, torch and model to target."""
    ctx = request.app.state.kiln
    body = {"kiln_version": __version__, "served_model_name": ctx.served_model_name, "phase": ctx.state.phase,
            **ctx.state.engine_info, "reasoning_parser": ctx.config.reasoning_parser,
            "default_chat_template_kwargs": ctx.config.default_chat_template_kwargs}
    lora = ctx._lora_info()
    if lora is not None:
        body["lora_adapters"] = lora["loaded"]
    return body


def _model_card(ctx: ServingContext) -> dict[str, Any]:
    card: dict[str, Any] = {"id": ctx.served_model_name, "object": "model", "created": ctx.created,
                            "owned_by": "kiln", "root": ctx.config.artifact or str(ctx.config.model), "parent": None}
    if ctx.state.engine is not None:
        card["max_model_len"] = ctx.state.engine.engine_config.max_seq_len
    return card


@models.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    ctx = request.app.state.kiln
    if ctx.pool is not None:  # every engine of the pool, with its state (loaded, loading, unloaded)
        return {"object": "list", "data": ctx.pool.cards(ctx.created)}
    return {"object": "list", "data": [_model_card(ctx), *ctx.loras.cards(ctx.created, ctx.served_model_name)]}


@models.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    ctx = request.app.state.kiln
    if ctx.pool is not None:
        card = next((c for c in ctx.pool.cards(ctx.created) if c["id"] == model_id), None)
        if card is None:
            raise ctx.pool.not_found(model_id)
        return card
    for card in ctx.loras.cards(ctx.created, ctx.served_model_name):
        if card["id"] == model_id:
            return card
    if model_id not in ctx.model_names:
        raise APIError(404, f"The model {model_id!r} does not exist on this server; it serves "
                       f"{ctx.served_model_name!r}", param="model", code="model_not_found")
    return _model_card(ctx)


async def _follow_pool(ctx: ServingContext) -> None:
    """Once the pool started: idle unloads, the engines file and each loaded engine's adapters, each in a loop of
    its own (an adapter's fetch, however long, does not hold up an engine added to or removed from the list)."""
    while ctx.state.phase == LOADING:
        await asyncio.sleep(0.1)
    assert ctx.pool is not None
    loops = [asyncio.create_task(ctx.pool.run_idle_unloads()), asyncio.create_task(_follow_adapters(ctx))]
    try:
        while ctx.pool_follower is not None:  # each pass guarded: one that fails is logged and tried again
            await asyncio.sleep(POLL_S)
            await _logged(f"following the engines file {ctx.pool_follower.path}", ctx.pool_follower.sync())
        await asyncio.gather(*loops)
    finally:
        for loop in loops:
            loop.cancel()


async def _follow_adapters(ctx: ServingContext) -> None:
    assert ctx.pool is not None
    while True:
        await asyncio.sleep(POLL_S)
        for slot in list(ctx.pool.slots.values()):
            if slot.adapter_sync is not None and slot.state.engine is not None:
                await _logged(f"engine {slot.name!r}: following its adapters",
                              slot.adapter_sync.sync(slot.state.engine_info.get("engine_version")))


async def _logged(what: str, step: Any) -> None:
    """Await ``step``; an error is logged with ``what`` failed, not raised (it would stop following for good)."""
    try:
        await step
    except Exception:
        log.exception("pool: %s failed; trying again in %ss", what, POLL_S)


def _group_failure_grace() -> float:
    """Seconds a leader whose engine group broke keeps answering 503 before it exits 1."""
    try:
        return max(0.0, float(os.environ.get("KILN_GROUP_FAILURE_EXIT_SECONDS", "10")))
    except ValueError:
        return 10.0


def create_app(config: ServeConfig, pool: PoolSettings | None = None) -> FastAPI:
    ctx = ServingContext(config, pool)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        load = asyncio.create_task(ctx.load(), name="kiln-load")
        watch = asyncio.create_task(ctx.watch_group(_group_failure_grace()), name="kiln-watch-group")
        tasks = [load, watch]
        if ctx.adapter_sync is not None:  # the operator's adapter list (docs/lora.md, "On a cluster")
            tasks.append(asyncio.create_task(ctx.adapter_sync.run(), name="kiln-lora-sync"))
        if ctx.pool is not None:
            tasks.append(asyncio.create_task(_follow_pool(ctx), name="kiln-pool"))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            if ctx.pool is not None:
                await ctx.pool.shutdown()
            if ctx.state.engine is not None:
                await ctx.state.engine.shutdown()
                close_compiler(ctx.state.engine)

    app = FastAPI(title="kiln", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]
    app.state.kiln = ctx
    install_error_handlers(app)
    app.include_router(probes)
    app.include_router(models, dependencies=[Depends(require_api_key)])
    app.include_router(routes.router, dependencies=[Depends(require_api_key)])
    app.include_router(prefix.router, dependencies=[Depends(require_api_key)])
    app.include_router(tokenizing.router, dependencies=[Depends(require_api_key)])  # a pool's: by model (prefix.py)
    if runtime_updating_allowed(config.allow_runtime_lora_updating) and pool is None:  # else 404, as vLLM
        app.include_router(lora.router, dependencies=[Depends(require_api_key)])
    return app
