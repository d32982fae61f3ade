"""One level-triggered reconcile of one LLMEngine: read the world, converge it one step, write status.

Order, and why:

1. Re-read the LLMEngine (handlers may hold an older body) and validate its spec;
   a spec that can never work is written as Failed and reported to the caller.
2. Engine version = hash of the build envelope. If the store has a valid
   manifest for it, roll out; if not, make sure ONE build Job exists for it.
   The Job name comes from the version, so creation races (two engines with one
   envelope, a restart, a second replica) end in AlreadyExists, which is fine.
   Every engine waiting for a Job adds itself as a (non-controller) owner, so
   the garbage collector deletes the Job when the last of them is deleted: no
   finalizer is needed on LLMEngines.
3. The serving workload (a Deployment, or a LeaderWorkerSet when a replica spans nodes; an engine
   that needs one on a cluster without the LWS CRD fails before building) is not touched until the wanted artifact exists, so a GitOps
   bump keeps the old version serving for the whole build; the rollout itself
   keeps old pods until new ones are available (maxUnavailable 0).
4. Status is recomputed from what was observed and written only when it changed,
   with the read's resourceVersion as a precondition (a concurrent change makes
   the write fail with 409 and the next reconcile starts from the new truth).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from kiln.operator import metrics, scale_out
from kiln.operator.apply import HASH_ANNOTATION, apply
from kiln.operator.jobs import build_job
from kiln.operator.kube import ApiError, KubeClient, api_path
from kiln.operator.naming import LWS_API_VERSION, LWS_PLURAL, job_name, lws_name, owner_reference
from kiln.operator.scheduling import new_pods_selector, unschedulable
from kiln.operator.settings import OperatorConfig
from kiln.operator.status import (
    JobState,
    Observation,
    compose_status,
    job_duration_seconds,
    job_state,
    rollout_complete,
    same_status,
    serving_version,
    termination_message,
    transitions,
)
from kiln.operator.trust import artifact_problem, expectation
from kiln.operator.validation import InvalidSpec, validate_name, validate_spec
from kiln.operator.workloads import (
    build_pdb,
    build_service,
    build_workload,
    endpoint,
)

from kiln.api import API_VERSION, PLURAL
from kiln.artifacts import ArtifactStore
from kiln.engine_status import add_to_history
from kiln.envelope import engine_version


@dataclass
class Context:
    kube: KubeClient
    store: ArtifactStore
    config: OperatorConfig


@dataclass(frozen=True)
class Result:
    body: dict[str, Any] | None = None  # the LLMEngine as read (None: gone or being deleted)
    status: dict[str, Any] | None = None
    events: tuple[tuple[str, str, str], ...] = ()
    invalid: str | None = None
    stale: bool = False  # the status write lost a race; reconcile again


def engine_path(namespace: str, name: str | None = None, sub: str | None = None) -> str:
    return api_path(API_VERSION, PLURAL, namespace, name, sub)


async def reconcile(ctx: Context, namespace: str, name: str, logger: logging.Logger) -> Result:
    body = await ctx.kube.get(engine_path(namespace, name))
    if body is None or body["metadata"].get("deletionTimestamp"):
        return Result()
    old = body.get("status") or {}
    generation = body["metadata"].get("generation") or 0
    try:
        validate_name(name)
        spec = validate_spec(body.get("spec") or {}, ctx.config)
    except InvalidSpec as exc:
        obs = Observation(generation=generation, old=old, invalid=str(exc), serving=old.get("servingVersion"))
        return await _finish(ctx, body, old, compose_status(obs), invalid=str(exc))

    version = engine_version(spec)
    uri = ctx.store.artifact_uri(version)
    shape = spec.replica_shape
    if shape.multi_node and not await ctx.kube.serves(LWS_API_VERSION, LWS_PLURAL):
        # Checked before anything is built: a multi-node build takes hours and could never serve here.
        # Not InvalidSpec: installing LeaderWorkerSet fixes it, and the next timer reconcile notices.
        deployment, lws = await live_workloads(ctx, namespace, name)
        obs = Observation(generation=generation, old=old, engine_version=version, artifact_uri=uri,
                          job_name=job_name(version), replicas=spec.serving.replicas,
                          endpoint=endpoint(name, namespace, spec), history=old.get("history") or [],
                          missing_api=lws_missing_message(spec),
                          serving=serving_now(spec, deployment, lws, old.get("servingVersion")))
        if old.get("phase") != "Failed":
            logger.warning(obs.missing_api)
        return await _finish(ctx, body, old, compose_status(obs))
    manifest = await asyncio.to_thread(ctx.store.read_manifest, version)
    is_new = old.get("engineVersion") != version
    base = dict(generation=generation, old=old, engine_version=version, artifact_uri=uri,
                job_name=job_name(version), replicas=spec.serving.replicas,
                endpoint=endpoint(name, namespace, spec), history=old.get("history") or [])
    untrusted = artifact_problem(manifest, ctx.config) if manifest is not None else None
    if untrusted is not None:
        # Someone else published this version: serve nothing new from it (the old version keeps serving),
        # and build nothing (a build would find the version published); the status says how to recover.
        deployment, lws = await live_workloads(ctx, namespace, name)
        obs = Observation(**base, untrusted=untrusted,
                          serving=serving_now(spec, deployment, lws, old.get("servingVersion")))
        if is_new or old.get("phase") != "Failed":
            logger.warning(f"{uri}: not serving it: {untrusted}")
    elif manifest is None:
        if is_new:
            metrics.CACHE_MISSES.inc()
        job = await ensure_job(ctx, body, spec, version, logger)
        state = job_state(job)
        detail = await builder_message(ctx, namespace, job) if state.state == "failed" else ""
        deployment, lws = await live_workloads(ctx, namespace, name)
        obs = Observation(**base, built=False, job=state, failure_detail=detail,
                          serving=serving_now(spec, deployment, lws, old.get("servingVersion")))
        if state.state == "failed":
            _count_build_outcome(old, state, job)
    else:
        if is_new and old.get("phase") != "Building":
            metrics.CACHE_HITS.inc()
        owner = owner_reference(body)
        # Scale out first: a missing prerequisite (CRD) leaves the workload as it is (the old version serves).
        _, missing = await scale_out.converge(ctx.kube, apply, spec, name, namespace, ctx.config, owner)
        if missing is None:
            await apply(ctx.kube, build_workload(spec, name, namespace, version, uri, ctx.config, owner,
                                                 expectation(manifest)))
            await apply(ctx.kube, build_service(spec, name, namespace, owner))
            pdb = build_pdb(spec, name, namespace, owner)
            if pdb is not None:
                await apply(ctx.kube, pdb)
            else:
                await ctx.kube.delete(api_path("policy/v1", "poddisruptionbudgets", namespace, name))
        deployment, lws = await live_workloads(ctx, namespace, name)
        if missing is None:
            await retire_other_workload(ctx, spec, name, namespace, deployment, lws, logger)
        entry = {"engineVersion": version, "artifactURI": uri,
                 "builtAt": manifest.created_at.isoformat().replace("+00:00", "Z")}
        base["history"] = add_to_history(base["history"], entry)
        serving = serving_now(spec, deployment, lws, old.get("servingVersion"))
        workload = lws if spec.replica_shape.pods > 1 else deployment  # what the scaler scales
        obs = Observation(**base, built=True, serving=serving, prerequisite=missing,
                          **await scale_out_observation(ctx, spec, name, namespace, version, workload, serving))
        _count_build_outcome(old, JobState("succeeded"), await ctx.kube.get(
            api_path("batch/v1", "jobs", namespace, job_name(version))) if old.get("phase") == "Building" else None)
    return await _finish(ctx, body, old, compose_status(obs))


def lws_missing_message(spec: Any) -> str:
    shape = spec.replica_shape
    return (f"spec.pipelineParallel: one replica of this engine spans {shape.pods} pods (tensorParallel "
            f"{shape.tensor_parallel} x pipelineParallel {shape.pipeline_parallel} ranks, {shape.ranks_per_pod} per "
            f"node), which kiln runs as a LeaderWorkerSet, but this cluster does not serve {LWS_API_VERSION} "
            f"{LWS_PLURAL} (the LeaderWorkerSet CRD is not installed). Install LeaderWorkerSet, a prerequisite of "
            "multi-node engines (docs/multi-node-cluster.md), and the operator continues on its own; or lower "
            "tensorParallel x pipelineParallel to fit one node")


async def live_workloads(ctx: Context, namespace: str, name: str) -> tuple[dict[str, Any] | None,
                                                                          dict[str, Any] | None]:
    """The engine's Deployment and LeaderWorkerSet as they are (either may be absent; the LWS is absent on a
    cluster without its CRD: the GET is a 404 like a missing object)."""
    deployment = await ctx.kube.get(api_path("apps/v1", "deployments", namespace, name))
    lws = await ctx.kube.get(api_path(LWS_API_VERSION, LWS_PLURAL, namespace, lws_name(name)))
    return deployment, lws


def serving_now(spec: Any, deployment: dict[str, Any] | None, lws: dict[str, Any] | None,
                previous: str | None) -> str | None:
    """servingVersion with either workload kind: the wanted kind's template version once its rollout is
    complete; otherwise, while pods of either kind run, the version that served before."""
    wanted, other = (lws, deployment) if spec.replica_shape.multi_node else (deployment, lws)
    if wanted is not None and serving_version(wanted, None) is not None:
        return serving_version(wanted, None)
    running = [w for w in (wanted, other) if w is not None and (w.get("spec") or {}).get("replicas", 1) != 0]
    return previous if running else None


async def retire_other_workload(ctx: Context, spec: Any, name: str, namespace: str,
                                deployment: dict[str, Any] | None, lws: dict[str, Any] | None,
                                logger: logging.Logger) -> None:
    """When an engine moves between a Deployment and a LeaderWorkerSet (its shape crossed a node), the old
    kind keeps serving until the new one's rollout is complete, then goes: a LeaderWorkerSet is deleted, a
    Deployment scaled to zero (the chart grants Deployments no delete; the garbage collector removes it with
    the engine, and a move back re-renders it)."""
    if spec.replica_shape.multi_node:
        if lws is None or not rollout_complete(lws) or deployment is None:
            return
        if (deployment.get("spec") or {}).get("replicas", 1) == 0:
            return
        await ctx.kube.patch(api_path("apps/v1", "deployments", namespace, name), {
            "metadata": {"annotations": {HASH_ANNOTATION: None}}, "spec": {"replicas": 0}})
        logger.info(f"{lws_name(name)} serves {name}: scaled Deployment {name} to 0")
    else:
        if deployment is None or not rollout_complete(deployment) or lws is None:
            return
        await ctx.kube.delete(api_path(LWS_API_VERSION, LWS_PLURAL, namespace, lws_name(name)))
        logger.info(f"Deployment {name} serves {name}: deleted LeaderWorkerSet {lws_name(name)}")


async def _finish(ctx: Context, body: dict[str, Any], old: dict[str, Any], new: dict[str, Any],
                  invalid: str | None = None) -> Result:
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


async def ensure_job(ctx: Context, body: dict[str, Any], spec: Any, version: str,
                     logger: logging.Logger) -> dict[str, Any]:
    """Get-or-create THE build Job of ``version``, with this engine among its owners."""
    meta = body["metadata"]
    namespace = meta["namespace"]
    path = api_path("batch/v1", "jobs", namespace, job_name(version))
    mine = owner_reference(body, controller=False)
    job = await ctx.kube.get(path)
    if job is None:
        desired = build_job(spec, meta["name"], namespace, version, ctx.config)
        desired["metadata"]["ownerReferences"] = [mine]
        try:
            job = await ctx.kube.create(api_path("batch/v1", "jobs", namespace), desired)
            metrics.BUILDS_STARTED.inc()
            logger.info(f"created build Job {job_name(version)} for {version}")
            return job
        except ApiError as exc:
            if exc.status != 409:
                raise
            job = await ctx.kube.get(path)  # someone else created it first: share theirs
            if job is None:
                raise
    refs = job["metadata"].get("ownerReferences") or []
    if not any(ref.get("uid") == mine["uid"] for ref in refs):
        try:
            job = await ctx.kube.patch(path, {"metadata": {
                "resourceVersion": job["metadata"]["resourceVersion"], "ownerReferences": [*refs, mine]}})
        except ApiError as exc:
            if exc.status != 409:
                raise  # 409: another engine joined at the same time; the next reconcile adds us
    return job


async def builder_message(ctx: Context, namespace: str, job: dict[str, Any]) -> str:
    """The builder's termination message; empty when pods are gone or not readable (RBAC)."""
    selector = f"batch.kubernetes.io/job-name={job['metadata']['name']}"
    try:
        pods = await ctx.kube.list(api_path("v1", "pods", namespace), label_selector=selector)
    except ApiError:
        return ""
    return termination_message(pods)


async def scale_out_observation(ctx: Context, spec: Any, name: str, namespace: str, version: str,
                                deployment: dict[str, Any] | None, serving: str | None) -> dict[str, Any]:
    """The scale-out part of an Observation: replica counts and their owner, and new pods that cannot be placed."""
    autoscaled = spec.serving.autoscaling is not None
    scaler = "HorizontalPodAutoscaler" if ctx.config.autoscaler == "hpa" else "ScaledObject"
    replicas = scale_out.replica_status(deployment, autoscaled, f"{scaler}/{name}")
    stuck = None
    if deployment is not None and serving != version and replicas["desired"] > 0:
        try:
            pods = await ctx.kube.list(api_path("v1", "pods", namespace), label_selector=new_pods_selector(name, version))
        except ApiError:
            pods = []  # not readable (RBAC): the condition stays RollingOut
        stuck = unschedulable(pods, spec, version, ctx.config, serving)
    return {"replica_status": replicas, "autoscaled": autoscaled, "unschedulable": stuck}


def _count_build_outcome(old: dict[str, Any], state: JobState, job: dict[str, Any] | None) -> None:
    if old.get("phase") != "Building":
        return
    if state.state == "failed":
        metrics.BUILDS_FAILED.labels(reason=state.reason or "Failed").inc()
    elif state.state == "succeeded":
        metrics.BUILDS_SUCCEEDED.inc()
        seconds = job_duration_seconds(job) if job else None
        if seconds is not None:
            metrics.BUILD_DURATION.observe(seconds)
