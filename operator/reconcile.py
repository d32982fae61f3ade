"""One level-triggered reconcile of one LLMEngine, as steps: read the world once, decide with a pure
function, act, write status.

- :func:`observe` re-reads the LLMEngine (handlers may hold an older body), validates its spec and reads
  what the decision needs: the live workloads, the store's manifest (checked against the digest pinned in
  ``status.artifact``, never re-pinned from the store), the build Job and, when it failed, its pods, and
  once that manifest is trusted, ``spec.lora``'s adapters (:func:`kiln.operator.adapter_steps.read_adapters`);
  for an engine of a pool, that LLMEnginePool (:mod:`kiln.operator.pool_member`).
- :func:`kiln.operator.decide.decide` picks one step (a SERVE plan carries the adapters' plan); the policy is
  explained there, once.
- The step (:func:`report`, :func:`build`, :func:`retry_build`, :func:`serve`) makes its calls and returns what it left; an
  applied workload is taken from the API server's answer, not read again. The serve step also carries out the
  adapters' plan (:func:`kiln.operator.adapter_steps.act_adapters`); their status is part of the composed one.
- :func:`write_status` writes the recomputed status only when it changed, with the read's
  resourceVersion as a precondition: a concurrent change makes the write fail with 409 and the next
  reconcile starts from the new truth.

Errors are not caught here: an API or store error ends the reconcile, and the handlers turn it into a
kopf TemporaryError (retried); an invalid spec is returned as ``Result.invalid`` (a PermanentError).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from kiln.operator import keys, metrics, scale_out
from kiln.operator.adapter_steps import act_adapters, read_adapters
from kiln.operator.apply import HASH_ANNOTATION, apply
from kiln.operator.context import Context, key_pair, remove_old_signing_copy
from kiln.operator.decide import (
    BUILD,
    DELETE_LWS,
    REPORT,
    RETRY,
    SCALE_DOWN_DEPLOYMENT,
    SERVE,
    Outcome,
    Plan,
    World,
    awaits_new_pods,
    decide,
    finished_build,
    observation,
    retirements,
)
from kiln.operator.job_pods import job_failure
from kiln.operator.jobs import build_job, model_secrets
from kiln.operator.kube import ApiError, api_path
from kiln.operator.naming import (
    ANNOTATION_VERSION,
    LWS_API_VERSION,
    LWS_PLURAL,
    job_conflict,
    job_name,
    lws_name,
    owner_reference,
    taken_name,
)
from kiln.operator.network import build_network_policy
from kiln.operator.retry import Failure
from kiln.operator.scheduling import new_pods_selector
from kiln.operator.status import (
    JobState,
    compose_status,
    job_duration_seconds,
    job_state,
    same_status,
    transitions,
)
from kiln.operator.trust import expectation, manifest_problem, pinned_digest
from kiln.operator.validation import InvalidSpec, validate_name, validate_namespace, validate_spec
from kiln.operator.workloads import build_pdb, build_service, build_workload

from kiln.api import API_VERSION, PLURAL
from kiln.envelope import build_envelope, engine_version
from kiln.pool_api import POOL_PLURAL


@dataclass(frozen=True)
class Result:
    body: dict[str, Any] | None = None  # the LLMEngine as read (None: gone or being deleted)
    status: dict[str, Any] | None = None
    events: tuple[tuple[str, str, str], ...] = ()
    invalid: str | None = None
    stale: bool = False  # the status write lost a race; reconcile again


Workloads = tuple[dict[str, Any] | None, dict[str, Any] | None]  # (Deployment, LeaderWorkerSet)


def engine_path(namespace: str, name: str | None = None, sub: str | None = None) -> str:
    return api_path(API_VERSION, PLURAL, namespace, name, sub)


async def reconcile(ctx: Context, namespace: str, name: str, logger: logging.Logger) -> Result:
    await remove_old_signing_copy(ctx, namespace)
    world = await observe(ctx, namespace, name)
    if world is None:
        return Result()  # gone, or being deleted: the garbage collector removes its objects
    plan = decide(world)
    if plan.warning:
        logger.warning(plan.warning)
    count_cache(plan)
    outcome = await STEPS[plan.step](ctx, world, plan, logger)
    status = compose_status(observation(world, plan, outcome, ctx.config))
    count_build(finished_build(world, plan, outcome, status.get("build")))
    return await write_status(ctx, world, status)


async def observe(ctx: Context, namespace: str, name: str) -> World | None:
    """Every read the decision needs, once; None when the engine is gone or being deleted."""
    body = await ctx.kube.get(engine_path(namespace, name))
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    try:
        validate_name(name)
        spec = validate_spec(body.get("spec") or {}, ctx.config)
        validate_namespace(spec, namespace, ctx.config)
    except InvalidSpec as exc:
        return World(body, invalid=str(exc))
    version = engine_version(spec)
    deployment, lws = await live_workloads(ctx, namespace, name)
    if taken := taken_name(deployment, body) or taken_name(lws, body):  # a name clash: touch neither object
        return World(body, spec=spec, version=version, artifact_uri=ctx.store.artifact_uri(version), taken=taken)
    pool = await ctx.kube.get(api_path(API_VERSION, POOL_PLURAL, namespace, spec.serving.pool)) \
        if spec.serving.pool is not None else None  # what it serves from (kiln.operator.pool_member)
    seen = dict(body=body, spec=spec, version=version, artifact_uri=ctx.store.artifact_uri(version), deployment=deployment,
                lws=lws, pool=pool, list_sync=timedelta(seconds=ctx.config.pool_list_sync_seconds))
    if spec.replica_shape.multi_node and not await ctx.kube.serves(LWS_API_VERSION, LWS_PLURAL):
        return World(**seen, lws_served=False)
    manifest, document = await asyncio.to_thread(ctx.store.read_signed_manifest, version)
    untrusted = None
    if manifest is not None:  # nothing is pinned or served before its signature and envelope check out
        untrusted = manifest_problem(manifest, document, verify_pem=(await key_pair(ctx)).verify_pem,
                                     config=ctx.config, envelope=build_envelope(spec),
                                     pinned=pinned_digest(body.get("status") or {}, version))
    # The Job: to get or create it, or to time the build that just published the version.
    wants_job = manifest is None or (untrusted is None and (body.get("status") or {}).get("phase") == "Building")
    jobs = ctx.config.jobs_namespace
    job = await ctx.kube.get(job_path(jobs, version)) if wants_job else None
    conflict = job_conflict(job, ANNOTATION_VERSION, version) if job else None
    job = None if conflict else job  # another version's Job under this name is never taken as this build
    failure = await job_failure(ctx.kube, jobs, job) if job and job_state(job).state == "failed" else Failure()
    adapters = () if manifest is None or untrusted is not None else await read_adapters(
        ctx, spec, name, namespace, version, body.get("status") or {})  # what a SERVE plan needs of them
    return World(**seen, manifest=manifest, untrusted=untrusted, job=job, conflict=conflict, failure=failure,
                 now=datetime.now(UTC), adapters=adapters)


async def live_workloads(ctx: Context, namespace: str, name: str) -> Workloads:
    """The engine's Deployment and LeaderWorkerSet as they are (either may be absent; the LWS is absent on a
    cluster without its CRD: the GET is a 404 like a missing object)."""
    deployment = await ctx.kube.get(api_path("apps/v1", "deployments", namespace, name))
    lws = await ctx.kube.get(api_path(LWS_API_VERSION, LWS_PLURAL, namespace, lws_name(name)))
    return deployment, lws


def job_path(namespace: str, version: str | None = None) -> str:
    return api_path("batch/v1", "jobs", namespace, job_name(version) if version else None)


# -- the steps: each takes the world and returns what it left ------------------------------------------------


async def report(ctx: Context, world: World, plan: Plan, logger: logging.Logger) -> Outcome:
    """Nothing converges (an invalid spec, a missing API, an untrusted artifact): only the status changes."""
    return Outcome(world.deployment, world.lws)


async def build(ctx: Context, world: World, plan: Plan, logger: logging.Logger) -> Outcome:
    """Get or create the version's build Job."""
    job, missing = await ensure_job(ctx, world, logger)
    return Outcome(world.deployment, world.lws, job=job, missing_credentials=missing)


async def retry_build(ctx: Context, world: World, plan: Plan, logger: logging.Logger) -> Outcome:
    """Delete the failed build Job and create the version's next one (a storage error's retry is due, or the
    spec changed since a failure)."""
    assert world.version is not None
    await ctx.kube.delete(job_path(ctx.config.jobs_namespace, world.version))
    logger.info(f"deleted the failed build Job {job_name(world.version)}: building {world.version} again")
    return Outcome(world.deployment, world.lws, job=await create_job(ctx, world, logger))


async def serve(ctx: Context, world: World, plan: Plan, logger: logging.Logger) -> Outcome:
    """Scale-out objects, then the workload, Service and PDB, then retire the other workload kind; while the
    new version is not serving yet, read its pods. An engine of a pool gets no workload of its own: its own pods
    from before it joined retire once the pool serves it (kiln.operator.decide.retirements)."""
    owner = owner_reference(world.body)
    assert world.spec is not None
    # Scale out first: a missing prerequisite (CRD) leaves the workload as it is (the old version serves).
    _, missing = await scale_out.converge(ctx.kube, apply, world.spec, world.name, world.namespace, ctx.config,
                                          owner)
    deployment, lws = world.deployment, world.lws
    if missing is None:
        rank_group = await ensure_serving_secrets(ctx, world, owner)  # a pool's pods mount the verify key too
        if world.spec.serving.pool is None:
            deployment, lws = await apply_serving(ctx, world, owner, rank_group)
        deployment, lws = await retire(ctx, world, retirements(world, deployment, lws), (deployment, lws), logger)
    pods = await new_pods(ctx, world) if awaits_new_pods(world, deployment, lws, ctx.config) else None
    if plan.adapters is not None:
        await act_adapters(ctx, world.spec, world.name, world.namespace, plan.adapters, logger)
    return Outcome(deployment, lws, prerequisite=missing, new_pods=pods)


STEPS: dict[str, Callable[[Context, World, Plan, logging.Logger], Awaitable[Outcome]]] = {
    REPORT: report, BUILD: build, RETRY: retry_build, SERVE: serve}


# -- what the steps call -------------------------------------------------------------------------------------


async def ensure_job(ctx: Context, world: World, logger: logging.Logger) -> tuple[dict[str, Any], str | None]:
    """Get-or-create THE build Job of the version (``world.job`` is the get), and the credentials it names (what
    to create by hand when the operator does not copy them)."""
    assert world.spec is not None
    job = world.job or await create_job(ctx, world, logger)
    missing = await keys.ensure_credentials(ctx.kube, world.namespace, model_secrets(world.spec), job,
                                            ctx.config.copy_credentials)
    return job, missing


async def create_job(ctx: Context, world: World, logger: logging.Logger) -> dict[str, Any]:
    """Create the build Job in the jobs namespace; when someone else created it first, share theirs. It has no
    owner (an owner must be in the same namespace): it ends by its deadline and goes ttlSecondsAfterFinished later."""
    assert world.spec is not None and world.version is not None
    jobs = ctx.config.jobs_namespace
    # The private key, for the build container only, where builds run (keys module docstring).
    await keys.ensure_copy(ctx.kube, keys.signing_key_copy(jobs, await key_pair(ctx)))
    desired = build_job(world.spec, world.name, world.namespace, world.version, ctx.config)
    try:
        job = await ctx.kube.create(job_path(jobs), desired)
    except ApiError as exc:
        if exc.status != 409:
            raise
        theirs = await ctx.kube.get(job_path(jobs, world.version))
        if theirs is None:
            raise
        if conflict := job_conflict(theirs, ANNOTATION_VERSION, world.version):
            raise ApiError(409, "Conflict", conflict) from None  # the next reconcile reports it in the condition
        return theirs
    metrics.BUILDS_STARTED.inc()
    logger.info(f"created build Job {jobs}/{job_name(world.version)} for {world.version}")
    return job


async def ensure_serving_secrets(ctx: Context, world: World, owner: dict[str, Any]) -> str | None:
    """What serving pods mount besides the workload: the public key, and a multi-node engine's group token, whose
    rank label value this returns (None: one pod per replica, no rank channel)."""
    assert world.spec is not None
    await keys.ensure_copy(ctx.kube, keys.verify_key_copy(world.namespace, await key_pair(ctx)))
    if not world.spec.replica_shape.multi_node:
        return None
    token = await keys.ensure_group_token(ctx.kube, world.name, world.namespace, owner)
    return keys.rank_group_label(token, world.name)


async def apply_serving(ctx: Context, world: World, owner: dict[str, Any], rank_group: str | None) -> Workloads:
    """Apply the workload, Service and PDB (or delete a PDB no longer wanted). Returns the workloads as they
    are now: the applied one as the API server answered, the other kind as read."""
    spec, name, namespace = world.spec, world.name, world.namespace
    assert spec is not None and world.version is not None and world.artifact_uri is not None
    assert world.manifest is not None
    expect = expectation(world.manifest, world.pinned)
    workload = await apply(ctx.kube, build_workload(spec, name, namespace, world.version, world.artifact_uri,
                                                    ctx.config, owner, expect, rank_group))
    await apply(ctx.kube, build_service(spec, name, namespace, owner))
    pdb = build_pdb(spec, name, namespace, owner)
    if pdb is not None:
        await apply(ctx.kube, pdb)
    else:
        await ctx.kube.delete(api_path("policy/v1", "poddisruptionbudgets", namespace, name))
    if ctx.config.network_policy:
        await apply(ctx.kube, build_network_policy(spec, name, namespace, owner, rank_group))
    else:
        await ctx.kube.delete(api_path("networking.k8s.io/v1", "networkpolicies", namespace, name))
    return (world.deployment, workload) if spec.replica_shape.multi_node else (workload, world.lws)


async def retire(ctx: Context, world: World, retiring: tuple[str, ...], workloads: Workloads,
                 logger: logging.Logger) -> Workloads:
    """Carry out :func:`kiln.operator.decide.retirements`; returns the workloads as they are after it."""
    assert world.spec is not None
    name, namespace, pool = world.name, world.namespace, world.spec.serving.pool
    deployment, lws = workloads
    if SCALE_DOWN_DEPLOYMENT in retiring:
        deployment = await ctx.kube.patch(api_path("apps/v1", "deployments", namespace, name), {
            "metadata": {"annotations": {HASH_ANNOTATION: None}}, "spec": {"replicas": 0}})
        logger.info(f"{f'LLMEnginePool {pool}' if pool else lws_name(name)} serves {name}: scaled Deployment {name} to 0")
    if DELETE_LWS in retiring:
        await ctx.kube.delete(api_path(LWS_API_VERSION, LWS_PLURAL, namespace, lws_name(name)))
        lws = None
        logger.info(f"{f'LLMEnginePool {pool}' if pool else f'Deployment {name}'} serves {name}: deleted "
                    f"LeaderWorkerSet {lws_name(name)}")
    return deployment, lws


async def new_pods(ctx: Context, world: World) -> list[dict[str, Any]]:
    """The new version's pods; none when not readable (RBAC): the condition stays RollingOut."""
    assert world.version is not None
    selector = new_pods_selector(world.name, world.version)
    try:
        return await ctx.kube.list(api_path("v1", "pods", world.namespace), label_selector=selector)
    except ApiError:
        return []


async def write_status(ctx: Context, world: World, new: dict[str, Any]) -> Result:
    """Write ``new`` when it changes anything, guarded by the read's resourceVersion."""
    body, old, invalid = world.body, world.old, world.invalid
    events = tuple(transitions(old, new))
    if same_status(old, new):
        return Result(body=body, status=new, invalid=invalid)
    meta = body["metadata"]
    patch = {"metadata": {"resourceVersion": meta["resourceVersion"]}, "status": new}
    try:
        await ctx.kube.patch(engine_path(meta["namespace"], meta["name"], "status"), patch)
    except ApiError as exc:
        if exc.status == 409:
            return Result(body=body, status=new, invalid=invalid, stale=True)
        raise
    return Result(body=body, status=new, events=events, invalid=invalid)


# -- metrics -------------------------------------------------------------------------------------------------


def count_cache(plan: Plan) -> None:
    if plan.cache == "hit":
        metrics.CACHE_HITS.inc()
    elif plan.cache == "miss":
        metrics.CACHE_MISSES.inc()


def count_build(finished: tuple[JobState, dict[str, Any] | None] | None) -> None:
    if finished is None:
        return
    state, job = finished
    if state.state == "failed":
        metrics.BUILDS_FAILED.labels(reason=state.reason or "Failed").inc()
    elif state.state == "succeeded":
        metrics.BUILDS_SUCCEEDED.inc()
        seconds = job_duration_seconds(job) if job else None
        if seconds is not None:
            metrics.BUILD_DURATION.observe(seconds)
