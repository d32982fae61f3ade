"""One level-triggered reconcile of one LLMEnginePool, as the engine's (:mod:`kiln.operator.reconcile`): read the
world once, decide with pure functions (:mod:`kiln.operator.pool_decide`), act, write status.

- :func:`observe_pool` re-reads the pool, validates its spec, lists the LLMEngines of its namespace and keeps those
  whose ``spec.serving.pool`` names it (one that does not parse, or is being deleted, is no member), and for each
  built one reads what it counts through the store (:func:`read_member`: the manifest checked as the engine's own
  reconcile checks it, then its engine.json against that manifest's sha256) and, with ``spec.lora``, the adapter
  list its own reconcile keeps in its ``<engine>-adapters`` ConfigMap (:func:`read_adapter_list`).
- :func:`act` applies the engine-list ConfigMap first (a new pod starts with it), then the Deployment and the
  Service; the pods follow the ConfigMap without a restart.
- :func:`write_pool_status` writes ``status`` only when it changed, with the read's resourceVersion as a
  precondition (a 409 means the next reconcile starts from the new truth).

Errors are not caught here: an API or store error ends the reconcile (the handlers retry it); an invalid spec
is reported in status (Failed, InvalidSpec) and acts on nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, replace
from typing import Any

from kiln.operator import keys
from kiln.operator.adapters import ADAPTERS_FILE_KEY, configmap_name
from kiln.operator.apply import apply
from kiln.operator.context import Context, key_pair
from kiln.operator.kube import ApiError, api_path
from kiln.operator.naming import pool_owner_reference, pool_workload_name, taken_name
from kiln.operator.pool_decide import (
    LISTED,
    POOL_FAILURES,
    MemberView,
    PoolWorld,
    compose_pool_status,
    entries_by_name,
    judge_all,
    listed_adapters,
    listed_entries,
)
from kiln.operator.pools import (
    build_engines_configmap,
    build_pool_deployment,
    build_pool_held_requests,
    build_pool_inference_pool,
    build_pool_network_policy,
    build_pool_pdb,
    build_pool_scaler,
    build_pool_service,
    validate_pool,
)
from kiln.operator.scale_out import KINDS, missing_prerequisite
from kiln.operator.status import now_iso, same_status, transitions
from kiln.operator.trust import manifest_problem
from kiln.operator.validation import InvalidSpec
from pydantic import ValidationError

from kiln.api import API_VERSION, PLURAL, LLMEngineSpec
from kiln.artifact_manifest import ArtifactCorrupt, Manifest, rm_hint
from kiln.envelope import build_envelope, engine_version, envelope_digest
from kiln.memory_budget import engine_memory
from kiln.pool_api import POOL_PLURAL

# What a member counts, by (version, content digest): a pinned build never changes, so its engine.json is read
# once per process (its manifest is still checked on every reconcile).
_MEMORY: dict[tuple[str, str], tuple[int, str]] = {}
_MEMORY_LIMIT = 4096


@dataclass(frozen=True)
class PoolResult:
    body: dict[str, Any] | None = None  # the pool as read (None: gone or being deleted)
    status: dict[str, Any] | None = None
    events: tuple[tuple[str, str, str], ...] = ()
    invalid: str | None = None
    stale: bool = False  # the status write lost a race; reconcile again


def pool_path(namespace: str, name: str | None = None, sub: str | None = None) -> str:
    return api_path(API_VERSION, POOL_PLURAL, namespace, name, sub)


async def reconcile_pool(ctx: Context, namespace: str, name: str, logger: logging.Logger) -> PoolResult:
    world = await observe_pool(ctx, namespace, name)
    if world is None:
        return PoolResult()  # gone, or being deleted: the garbage collector removes its objects
    judged = judge_all(world, now_iso()) if world.spec is not None else []
    if world.spec is not None and world.taken is None:
        deployment = await act(ctx, world, listed_entries(world, judged), listed_adapters(world, judged))
        scaler = await converge_scaler(ctx, world, [j.name for j in judged if j.state == LISTED])
        world = replace(world, deployment=deployment, scaler_problem=scaler, routing_problem=await converge_routing(
            ctx, world))
    return await write_pool_status(ctx, world, compose_pool_status(world, judged))


async def observe_pool(ctx: Context, namespace: str, name: str) -> PoolWorld | None:
    """Every read the decision needs, once; None when the pool is gone or being deleted."""
    body = await ctx.kube.get(pool_path(namespace, name))
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    try:
        spec = validate_pool(name, body.get("spec") or {}, ctx.config)
    except InvalidSpec as exc:
        return PoolWorld(body, invalid=str(exc))
    members = []
    before = entries_by_name(body.get("status") or {})
    for engine in await ctx.kube.list(api_path(API_VERSION, PLURAL, namespace)):
        mine = member_spec(engine, name)
        if mine is not None:
            view = await read_member(ctx, engine, mine, before.get(engine["metadata"]["name"]))
            # built and countable (or its earlier build still is): its adapters may be listed
            if mine.lora is not None and (view.memory is not None or view.previous is not None):
                view = replace(view, adapters=await read_adapter_list(ctx, namespace, view.name))
            members.append(view)
    deployment = await ctx.kube.get(api_path("apps/v1", "deployments", namespace, pool_workload_name(name)))
    if taken := taken_name(deployment, body):  # a name clash: the pool touches none of its objects
        return PoolWorld(body, spec=spec, members=tuple(members), taken=taken)
    return PoolWorld(body, spec=spec, members=tuple(members), deployment=deployment)


def member_spec(engine: dict[str, Any], pool: str) -> LLMEngineSpec | None:
    """The engine's spec when it is a member of ``pool``: it names the pool, parses and is not being deleted."""
    raw = engine.get("spec") or {}
    if (raw.get("serving") or {}).get("pool") != pool or engine["metadata"].get("deletionTimestamp"):
        return None
    try:
        return LLMEngineSpec.model_validate(raw)
    except ValidationError:
        return None  # its own reconcile reports it Failed (InvalidSpec)


async def read_member(ctx: Context, engine: dict[str, Any], spec: LLMEngineSpec,
                      listed: dict[str, Any] | None = None) -> MemberView:
    """What the pool needs of a member: its pinned build and what it counts, read only once that build is its
    current version's and the store's manifest is still the build it pinned (signed by the operator's key). While
    it is not: the build the pool listed before (``listed``: its old status.engines entry), verified the same way
    against the pin of that version in the engine's status.history, so the old version keeps serving."""
    name, status = engine["metadata"]["name"], engine.get("status") or {}
    version = engine_version(spec)
    pin = status.get("artifact") or {}
    if status.get("engineVersion") != version or pin.get("engineVersion") != version or not pin.get("contentDigest"):
        view = MemberView(name, spec, version)  # being built (or its status not caught up with its spec yet)
    else:
        view = await read_build(ctx, name, spec, version, pin["contentDigest"], build_envelope(spec))
    if view.artifact_uri is None and (before := listed_before(listed, status, version)) is not None:
        view = replace(view, previous=await read_build(ctx, name, spec, *before, envelope=None))
    return view


def listed_before(listed: dict[str, Any] | None, status: dict[str, Any], version: str) -> tuple[str, str] | None:
    """(version, pinned digest) of the build the pool listed for this member before, when it is another version
    than ``version`` and the engine's status.history still pins it; else None."""
    old = (listed or {}).get("engineVersion")
    if (listed or {}).get("state") != LISTED or not old or old == version:
        return None
    digest = next((h.get("contentDigest") for h in status.get("history") or [] if h.get("engineVersion") == old), None)
    return (old, digest) if digest else None


async def read_build(ctx: Context, name: str, spec: LLMEngineSpec, version: str, digest: str,
                     envelope: dict[str, Any] | None) -> MemberView:
    """The member's build ``version`` pinned at ``digest``, verified (``envelope``: what its spec hashes; None for
    a build of an earlier spec: its own envelope, which must hash to the digest its version names, and the pin the
    engine set when it verified that build)."""
    manifest, document = await asyncio.to_thread(ctx.store.read_signed_manifest, version)
    if manifest is None:
        return MemberView(name, spec, version, digest, waiting=f"its artifact {version} is not in the store: "
                          "its engine rebuilds it")
    view = MemberView(name, spec, version, digest, ctx.store.artifact_uri(version))
    problem = manifest_problem(manifest, document, verify_pem=(await key_pair(ctx)).verify_pem, config=ctx.config,
                               envelope=manifest.envelope if envelope is None else envelope, pinned=digest)
    named = envelope_digest(manifest.envelope)
    if problem is None and envelope is None and not version.endswith(f"-{named}"):
        problem = f"its envelope's sha256 {named} is not the one its version names"
    if problem is not None:
        return replace(view, problem=f"engine {name}: its artifact {version} is not listed: {problem} (the "
                                     "engine's status says how to recover)")
    try:
        memory = await member_memory(ctx, manifest, digest)
    except (ArtifactCorrupt, ValueError) as exc:
        return replace(view, problem=f"engine {name}: its artifact {version} is not listed: engine.json: {exc}; "
                                     f"rebuild it ({rm_hint(ctx.store.uri, version)})")
    return replace(view, memory=memory)


async def read_adapter_list(ctx: Context, namespace: str, engine: str) -> Any:
    """The adapter list the member's own reconcile keeps in its ``<engine>-adapters`` ConfigMap, parsed (None when
    there is none, or it is not JSON: nothing of it is listed)."""
    configmap = await ctx.kube.get(api_path("v1", "configmaps", namespace, configmap_name(engine)))
    try:
        return json.loads(((configmap or {}).get("data") or {}).get(ADAPTERS_FILE_KEY) or "null")
    except ValueError:
        return None


async def member_memory(ctx: Context, manifest: Manifest, digest: str) -> tuple[int, str]:
    """(bytes, source) the build counts: its engine.json, verified against ``manifest`` (once per build)."""
    key = (manifest.engine_version, digest)
    if key not in _MEMORY:
        raw = await asyncio.to_thread(ctx.store.read_file, manifest, "engine.json")
        try:
            document = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"not JSON ({exc})") from None
        if len(_MEMORY) >= _MEMORY_LIMIT:
            _MEMORY.clear()
        _MEMORY[key] = engine_memory(document)
    return _MEMORY[key]


async def act(ctx: Context, world: PoolWorld, entries: list[Any], adapters: list[dict[str, str]]) -> dict[str, Any]:
    """The verify key the pods check members with, the engine list and the members' adapter list, the Deployment,
    the Service, the PodDisruptionBudget (from 2 pods up) and the NetworkPolicy; returns the Deployment as the API
    server answered."""
    assert world.spec is not None
    owner = pool_owner_reference(world.body)
    await keys.ensure_copy(ctx.kube, keys.verify_key_copy(world.namespace, await key_pair(ctx)))
    await apply(ctx.kube, build_engines_configmap(world.name, world.namespace, entries, owner, adapters))
    deployment = await apply(ctx.kube, build_pool_deployment(world.spec, world.name, world.namespace, ctx.config,
                                                             owner))
    await apply(ctx.kube, build_pool_service(world.spec, world.name, world.namespace, owner))
    if (pdb := build_pool_pdb(world.spec, world.name, world.namespace, owner)) is not None:
        await apply(ctx.kube, pdb)
    else:  # fewer than 2 pods: a budget would block every drain
        await ctx.kube.delete(api_path("policy/v1", "poddisruptionbudgets", world.namespace,
                                       pool_workload_name(world.name)))
    if ctx.config.network_policy:
        await apply(ctx.kube, build_pool_network_policy(world.spec, world.name, world.namespace, owner))
    return deployment


async def converge_scaler(ctx: Context, world: PoolWorld, members: list[str]) -> str | None:
    """Apply what ``spec.autoscaling`` asks for (with ``minReplicas: 0`` on KEDA, the HTTPScaledObject too) and
    delete the autoscaler kinds this operator renders when it asks for none (the count goes back to
    ``spec.replicas``); the message naming the field and the fix when the cluster does not serve a kind (KEDA, its
    HTTP add-on or autoscaling/v2 missing), else None."""
    assert world.spec is not None
    wanted = build_pool_scaler(world.spec, world.name, world.namespace, ctx.config, members,
                               pool_owner_reference(world.body))
    kind = "HorizontalPodAutoscaler" if ctx.config.autoscaler == "hpa" else "ScaledObject"
    problem = await _converge(ctx, world, kind, wanted, "spec.autoscaling",
                              f"{KINDS[kind][3]}, or remove spec.autoscaling")
    if ctx.config.autoscaler != "keda":  # only KEDA's operator renders HTTPScaledObjects (scale_out._could_exist)
        return problem
    batches = [m.spec.max_batch_size for m in world.members if m.name in members]
    held = build_pool_held_requests(world.spec, world.name, world.namespace, ctx.config, batches,
                                    pool_owner_reference(world.body))
    zero = await _converge(ctx, world, "HTTPScaledObject", held, "spec.autoscaling.minReplicas: 0",
                           KINDS["HTTPScaledObject"][3])
    return "; ".join(p for p in (problem, zero) if p) or None


async def converge_routing(ctx: Context, world: PoolWorld) -> str | None:
    """Apply the InferencePool ``spec.routing.inferencePool`` asks for, or delete it when it asks for none; the
    message naming the field and the fix when the cluster does not serve InferencePools, else None."""
    assert world.spec is not None
    wanted = build_pool_inference_pool(world.spec, world.name, world.namespace, pool_owner_reference(world.body))
    return await _converge(ctx, world, "InferencePool", wanted, "spec.routing.inferencePool",
                           "install the Gateway API Inference Extension CRDs (https://gateway-api-inference-extension."
                           "sigs.k8s.io/), or set spec.routing.inferencePool: false")


async def _converge(ctx: Context, world: PoolWorld, kind: str, wanted: dict[str, Any] | None, field: str,
                    fix: str) -> str | None:
    """One optional object of the pool, named ``<pool>-pool``: applied when wanted, else deleted; on a cluster
    without its kind, the message naming ``field`` and ``fix`` (as an engine's, ``scale_out.missing_prerequisite``)."""
    api_version, plural, _, _ = KINDS[kind]
    if wanted is None:
        await ctx.kube.delete(api_path(api_version, plural, world.namespace, pool_workload_name(world.name)))
        return None
    try:
        await apply(ctx.kube, wanted)
    except ApiError as exc:
        if exc.status != 404:
            raise
        return missing_prerequisite(kind, world.namespace, field, fix)
    return None


def pool_events(old: dict[str, Any], new: dict[str, Any]) -> tuple[tuple[str, str, str], ...]:
    """One event per Ready transition; a failure is a Warning."""
    return tuple(("Warning" if reason in POOL_FAILURES else type_, reason, message)
                 for type_, reason, message in transitions(old, new))


async def write_pool_status(ctx: Context, world: PoolWorld, new: dict[str, Any]) -> PoolResult:
    """Write ``new`` when it changes anything, guarded by the read's resourceVersion."""
    body, old = world.body, world.old
    events = pool_events(old, new)
    if same_status(old, new):
        return PoolResult(body=body, status=new, invalid=world.invalid)
    meta = body["metadata"]
    patch = {"metadata": {"resourceVersion": meta["resourceVersion"]}, "status": new}
    try:
        await ctx.kube.patch(pool_path(meta["namespace"], meta["name"], "status"), patch)
    except ApiError as exc:
        if exc.status == 409:
            return PoolResult(body=body, status=new, invalid=world.invalid, stale=True)
        raise
    return PoolResult(body=body, status=new, events=events, invalid=world.invalid)
