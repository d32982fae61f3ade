"""The adapters' part of a reconcile (docs/lora.md, "On a cluster"): read each adapter's artifact and Job, create
the Jobs of adapters not built yet, apply the ``<engine>-adapters`` ConfigMap, and return ``status.adapters``.

It runs after the engine's own step, only when that step served the base (its artifact is in the store and
trusted): an adapter is built against the base's published engine. It never touches the workload, whose pod
template mounts the ConfigMap whatever it lists (:func:`kiln.operator.adapters.adapters_volume`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from kiln.operator import keys, metrics
from kiln.operator.adapters import (
    AdapterView,
    adapter_job_name,
    adapter_secrets,
    adapter_statuses,
    build_adapter_job,
    build_configmap,
    configmap_name,
    pinned_digests,
    wanted_views,
    wants_job,
)
from kiln.operator.apply import apply
from kiln.operator.decide import World
from kiln.operator.job_pods import job_failure
from kiln.operator.kube import ApiError, api_path
from kiln.operator.naming import owner_reference
from kiln.operator.status import job_state
from kiln.operator.trust import manifest_problem

from kiln.envelope import adapter_envelope

KeyPairGetter = Callable[[], Awaitable[keys.KeyPair]]


async def converge_adapters(ctx: Any, world: World, logger: logging.Logger,
                            key_pair: KeyPairGetter) -> list[dict[str, Any]] | None:
    """``status.adapters`` after converging them; None (removes it) when the spec has no ``lora``.
    ``key_pair``: the operator's signing key pair, read on first need (an adapter Job's build signs)."""
    spec = world.spec
    assert spec is not None and world.version is not None
    if spec.lora is None:
        if world.old.get("adapters") is not None:
            await ctx.kube.delete(api_path("v1", "configmaps", world.namespace, configmap_name(world.name)))
        return None
    serving = world.old.get("servingVersion")
    bases = list(dict.fromkeys(v for v in (world.version, serving) if v))
    path = api_path("v1", "configmaps", world.namespace, configmap_name(world.name))
    pins = pinned_digests(await ctx.kube.get(path))
    verify_pem = (await key_pair()).verify_pem
    views = [await read_view(ctx, world, adapter, base, version, verify_pem, pins.get(version))
             for adapter, base, version in wanted_views(spec, bases)]
    for i, view in enumerate(views):
        if view.base_version == world.version and wants_job(view):
            views[i] = AdapterView(**{**view.__dict__, "job": await create_adapter_job(ctx, world, view, logger,
                                                                                         key_pair)})
    owner = owner_reference(world.body)
    # The old base's adapters stay listed while its pods serve; adapters not built for any base are left out.
    listed = [v for v in views if v.base_version == world.version or v.built]
    await apply(ctx.kube, build_configmap(world.name, world.namespace, listed, owner))
    return adapter_statuses([v for v in views if v.base_version == world.version])


async def read_view(ctx: Any, world: World, adapter: Any, base: str, version: str, verify_pem: bytes,
                    pinned: str | None) -> AdapterView:
    """One adapter's artifact (trusted or not: its signature, builder, envelope and ``pinned`` digest) and, while
    it is not built, its Job and why that failed."""
    manifest, document = await asyncio.to_thread(ctx.store.read_signed_manifest, version)
    uri = ctx.store.artifact_uri(version)
    pin_place = (f"ConfigMap {configmap_name(world.name)}, contentDigest; a new revision of the adapter builds "
                 "a new version")
    if manifest is not None:
        problem = manifest_problem(manifest, document, verify_pem=verify_pem, config=ctx.config,
                                   envelope=adapter_envelope(base, adapter), pinned=pinned, pinned_at=pin_place)
        digest = pinned or (manifest.content_digest if problem is None else None)
        return AdapterView(adapter, base, version, uri, built=problem is None, untrusted=problem,
                           content_digest=digest)
    if pinned is not None:  # the pin outlives its manifest: what is published there next is compared with it
        return AdapterView(adapter, base, version, uri, built=False, content_digest=pinned,
                           untrusted=f"its manifest is gone from the store after this operator pinned it ({pin_place})")
    if base != world.version:  # the old base's adapters are listed if built, never built again
        return AdapterView(adapter, base, version, uri, built=False)
    jobs = ctx.config.jobs_namespace
    job = await ctx.kube.get(api_path("batch/v1", "jobs", jobs, adapter_job_name(version)))
    failure = ""
    if job is not None and job_state(job).state == "failed":
        failure = (await job_failure(ctx.kube, jobs, job)).detail
    return AdapterView(adapter, base, version, uri, built=False, job=job, failure=failure)


async def create_adapter_job(ctx: Any, world: World, view: AdapterView, logger: logging.Logger,
                             key_pair: KeyPairGetter) -> dict[str, Any]:
    """Create the adapter's build Job in the jobs namespace (no owner, as a base build Job: another engine with the
    same base and adapter shares it); when it exists already, take that one."""
    assert world.spec is not None
    jobs = ctx.config.jobs_namespace
    await keys.ensure_copy(ctx.kube, keys.signing_key_copy(jobs, await key_pair()))
    desired = build_adapter_job(world.spec, world.name, world.namespace, view, ctx.config)
    try:
        job = await ctx.kube.create(api_path("batch/v1", "jobs", jobs), desired)
    except ApiError as exc:
        if exc.status != 409:
            raise
        return await ctx.kube.get(api_path("batch/v1", "jobs", jobs, adapter_job_name(view.version))) or {}
    await keys.ensure_credentials(ctx.kube, world.namespace, adapter_secrets(world.spec, view.adapter), job)
    metrics.BUILDS_STARTED.inc()
    logger.info(f"created adapter build Job {adapter_job_name(view.version)} for {view.adapter.name} ({view.version})")
    return job
