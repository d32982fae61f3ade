"""kopf handlers: thin wrappers around :func:`kiln.operator.reconcile.reconcile` and, for LLMEnginePools,
:func:`kiln.operator.pool_reconcile.reconcile_pool`.

Creation, spec edits and operator restarts reconcile at once; a timer
reconciles every ``KILN_RECONCILE_INTERVAL`` seconds, which is how Job and
Deployment progress is noticed (level-triggered: nothing depends on catching
one event). Every reconcile of an engine takes that engine's lock, every reconcile of a pool that pool's (from its
own handlers or cross-triggered from the other kind): two reconciles of one object never interleave. The locks live
in dicts on the global memo (kopf hands each object a shallow copy of it, which shares them).
An engine's reconcile (or deletion) that changed what its pool reads of it (the pool it names, its pinned build, its
adapters) reconciles that pool, and the one it left, right after, outside the engines' lock; a pool's reconcile then
reconciles the engines whose entry in it changed: an engine (or an adapter) joins or leaves a pool within seconds.
Run with ``kiln operator`` or ``kopf run -m kiln.operator.handlers``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import random
from collections.abc import Iterator
from typing import Any

import aiohttp
import kopf
from kiln.operator import metrics
from kiln.operator.context import Context
from kiln.operator.keys import GroupTokenMissing, KeyPairMissing
from kiln.operator.kube import ApiError, KubeClient, in_cluster_server
from kiln.operator.pool_decide import changed_members
from kiln.operator.pool_reconcile import PoolResult, reconcile_pool
from kiln.operator.reconcile import Result, reconcile
from kiln.operator.settings import ConfigError, OperatorConfig, reconcile_interval_from_env

from kiln.api import GROUP, PLURAL, VERSION
from kiln.artifact_manifest import StoreError
from kiln.artifacts import ArtifactStore
from kiln.pool_api import POOL_PLURAL

try:
    INTERVAL = reconcile_interval_from_env(os.environ)
except ConfigError:  # configure() reports the bad value at startup, as a PermanentError naming it
    INTERVAL = OperatorConfig.reconcile_interval
WATCH_TIMEOUT = int(os.environ.get("KILN_WATCH_TIMEOUT") or 300)


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    try:
        config = OperatorConfig.from_env()
        if not config.store_uri:
            raise ConfigError("KILN_STORE_URI is not set; pass --store s3://bucket/prefix (chart value store.uri)")
        store = ArtifactStore.from_uri(config.store_uri)
    except (ConfigError, StoreError) as exc:
        raise kopf.PermanentError(f"operator configuration: {exc}") from None
    # Bookkeeping in annotations: status belongs to kiln's API, kopf's progress must not leak into it.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=f"kopf.{GROUP}")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=f"kopf.{GROUP}", key="last-handled-configuration")
    # kopf holds deletion with this finalizer only to stop the engine's timer; children (and shared
    # build Jobs, once their last owner is gone) are deleted by the garbage collector via ownerReferences.
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    # Watches end server-side and are re-listed, so a dropped connection heals within this time.
    settings.watching.server_timeout = WATCH_TIMEOUT
    settings.watching.client_timeout = WATCH_TIMEOUT + 30
    settings.watching.connect_timeout = 30
    # On deletion kopf waits for a running reconcile (the timer) to finish before releasing its
    # finalizer: give it a second, then re-check every second instead of kopf's default minute.
    settings.background.instant_exit_timeout = 1.0
    settings.background.cancellation_polling = 1.0
    # One event per state transition is ours; kopf's own per-handler events are noise at INFO.
    settings.posting.level = logging.WARNING
    # Peering off by default (no CRD needed); with --ha, replicas pick random priorities: the highest
    # runs and the others pause until its peering record expires — leader election by priority.
    settings.peering.standalone = not config.ha
    if config.ha:
        settings.peering.name = "kiln"  # the chart creates this (Cluster)KopfPeering
        settings.peering.mandatory = True  # a missing peering object is an error, not a silent standalone
        settings.peering.priority = random.randint(1, 1_000_000)
    memo.ctx = Context(kube=KubeClient(), store=store, config=config)
    # Set here, on the global memo: each object's memo is a shallow copy of it, so all share these dicts.
    memo.engine_locks = collections.defaultdict(asyncio.Lock)
    memo.pool_locks = collections.defaultdict(asyncio.Lock)
    memo.engine_pools = {}
    if config.metrics_port:
        metrics.serve(config.metrics_port)
    logger.info(f"kiln operator: store {store.uri}, reconcile every {config.reconcile_interval}s, ha={config.ha}")


@kopf.on.login()
def login(memo: kopf.Memo, logger: logging.Logger, settings: kopf.OperatorSettings,
          **kwargs: Any) -> kopf.ConnectionInfo | None:
    # In a pod: the service account. Elsewhere: kubeconfig via the client library (exec plugins work).
    info = in_cluster_server(kopf.login_with_service_account(settings=settings, **kwargs)) or kopf.login_via_client(
        logger=logger, settings=settings, **kwargs)
    if "ctx" in memo:
        memo.ctx.kube.connection = info  # the same server and credentials for our own client
    return info


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    if "ctx" in memo:
        await memo.ctx.kube.close()


@contextlib.contextmanager
def retried() -> Iterator[None]:
    """A reconcile's transient errors as kopf's TemporaryError (retried after a delay), counted by kind."""
    try:
        yield
    except StoreError as exc:
        metrics.RECONCILE_ERRORS.labels(kind="store").inc()
        raise kopf.TemporaryError(f"artifact store: {exc}", delay=10) from None
    except GroupTokenMissing as exc:
        metrics.RECONCILE_ERRORS.labels(kind="group-token").inc()
        raise kopf.TemporaryError(f"{exc.what}: {exc}", delay=30) from None
    except KeyPairMissing as exc:
        metrics.RECONCILE_ERRORS.labels(kind="signing-key").inc()
        raise kopf.TemporaryError(f"{exc.what}: {exc}", delay=30) from None
    except (ApiError, aiohttp.ClientError, TimeoutError) as exc:
        metrics.RECONCILE_ERRORS.labels(kind="api").inc()
        raise kopf.TemporaryError(f"Kubernetes API: {exc or type(exc).__name__}", delay=5) from None


def settle(result: Result | PoolResult, kind: str) -> None:
    """A change handler's end: again soon when the status write lost a race; a PermanentError for an invalid spec
    (status says Failed; a spec edit retries)."""
    if result.stale:
        raise kopf.TemporaryError(f"the {kind} changed while reconciling; again", delay=1)
    if result.invalid:
        raise kopf.PermanentError(result.invalid)


def lock(memo: kopf.Memo, kind: str, namespace: str, name: str) -> asyncio.Lock:
    """The one lock of the engine (``kind`` "engine_locks") or pool ("pool_locks") ``namespace/name``, shared by
    every object's memo (``configure`` puts the dicts on the global memo)."""
    return memo.setdefault(kind, collections.defaultdict(asyncio.Lock))[(namespace, name)]


async def _reconcile(namespace: str, name: str, memo: kopf.Memo, logger: logging.Logger,
                     follow: bool = True) -> Result:
    """One engine's reconcile; then, with ``follow``, its pool's when what the pool reads of it changed."""
    async with lock(memo, "engine_locks", namespace, name):
        with retried():
            result = await reconcile(memo.ctx, namespace, name, logger)
    for type_, reason, message in result.events:
        kopf.event(result.body, type=type_, reason=reason, message=message)
    await _follow_pools(namespace, name, result, memo, logger, follow)
    return result


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
async def reconcile_on_change(namespace: str, name: str, memo: kopf.Memo, logger: logging.Logger,
                              **_: Any) -> None:
    settle(await _reconcile(namespace, name, memo, logger), "LLMEngine")


@kopf.timer(GROUP, VERSION, PLURAL, interval=INTERVAL, initial_delay=INTERVAL)
async def reconcile_periodically(namespace: str, name: str, memo: kopf.Memo, logger: logging.Logger,
                                 **_: Any) -> None:
    await _reconcile(namespace, name, memo, logger)  # an invalid spec stays Failed quietly: no retry loop


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
async def engine_deleted(namespace: str, name: str, spec: dict[str, Any], memo: kopf.Memo, logger: logging.Logger,
                         **_: Any) -> None:
    """A member leaves its pool at once (the pool's reconcile skips an engine being deleted)."""
    pool = ((spec or {}).get("serving") or {}).get("pool")
    await _follow_pools(namespace, name, Result(), memo, logger, also=(pool,))


# -- engine pools (docs/pools.md) -----------------------------------------------------------------------------


async def _reconcile_pool(namespace: str, name: str, memo: kopf.Memo, logger: logging.Logger) -> PoolResult:
    """One pool's reconcile; then the engines whose entry in it changed are reconciled (their status follows the
    pool's: Ready once listed by a Ready pool, Failed when refused) without following pools again."""
    async with lock(memo, "pool_locks", namespace, name):  # released before its members are reconciled
        with retried():
            result = await reconcile_pool(memo.ctx, namespace, name, logger)
    for type_, reason, message in result.events:
        kopf.event(result.body, type=type_, reason=reason, message=message)
    if result.body is not None and result.status is not None:
        for engine in sorted(changed_members(result.body.get("status") or {}, result.status)):
            try:
                await _reconcile(namespace, engine, memo, logger, follow=False)
            except kopf.TemporaryError as exc:
                logger.warning(f"LLMEngine {namespace}/{engine} after its pool {name}: {exc}; its timer retries")
    return result


def membership(result: Result) -> tuple[str | None, ...] | None:
    """What of an engine its pool's reconcile reads: the pool it names (or its status names), its pinned build and
    its adapters (each built or gone changes the pool's adapter list); None when it is gone."""
    if result.body is None:
        return None
    spec, status = result.body.get("spec") or {}, result.status or result.body.get("status") or {}
    pinned = status.get("artifact") or {}
    adapters = json.dumps([(a.get("name"), a.get("version"), a.get("phase")) for a in status.get("adapters") or []])
    return ((spec.get("serving") or {}).get("pool"), (status.get("pool") or {}).get("name"),
            status.get("engineVersion"), pinned.get("contentDigest"), adapters)


async def _follow_pools(namespace: str, name: str, result: Result, memo: kopf.Memo, logger: logging.Logger,
                        follow: bool = True, also: tuple[str | None, ...] = ()) -> None:
    """After an engine's reconcile: when what its pool reads of it changed (it joined, left, was built or is
    gone), reconcile that pool and the one it left now, so it joins or leaves within seconds, not at the pool's
    next timer (``also``: pools to reconcile whatever changed). A failure is logged: the pool's timer retries it."""
    seen: dict[tuple[str, str], tuple[str | None, ...] | None] = memo.setdefault("engine_pools", {})
    before, now = seen.get((namespace, name)), membership(result)
    if now is None:
        seen.pop((namespace, name), None)
    else:
        seen[(namespace, name)] = now
    if not follow or (before == now and not any(also)):
        return
    for pool in sorted({p for p in (*(before or ())[:2], *(now or ())[:2], *also) if p}):
        try:
            await _reconcile_pool(namespace, pool, memo, logger)
        except kopf.TemporaryError as exc:
            logger.warning(f"LLMEnginePool {namespace}/{pool} after engine {name}: {exc}; its timer retries")


@kopf.on.resume(GROUP, VERSION, POOL_PLURAL)
@kopf.on.create(GROUP, VERSION, POOL_PLURAL)
@kopf.on.update(GROUP, VERSION, POOL_PLURAL)
async def reconcile_pool_on_change(namespace: str, name: str, memo: kopf.Memo, logger: logging.Logger,
                                   **_: Any) -> None:
    settle(await _reconcile_pool(namespace, name, memo, logger), "LLMEnginePool")


@kopf.timer(GROUP, VERSION, POOL_PLURAL, interval=INTERVAL, initial_delay=INTERVAL)
async def reconcile_pool_periodically(namespace: str, name: str, memo: kopf.Memo, logger: logging.Logger,
                                      **_: Any) -> None:
    await _reconcile_pool(namespace, name, memo, logger)
