"""The adapters' reads and writes in a reconcile (docs/lora.md, "On a cluster"); the decisions between them are
:func:`kiln.operator.adapters.plan_adapters`, which ``decide`` calls.

- :func:`read_adapters` (the observe step, once the base is in the store and trusted: an adapter is built against
  the base's published engine): the ``<engine>-adapters`` ConfigMap's pins, then each adapter's artifact (checked
  against its signature, envelope and pin) and, while it is not built, its Job and why that failed.
- :func:`act_adapters` (the serve step): create the planned Jobs, apply the ConfigMap, or delete it when
  ``spec.lora`` is gone. It never touches the workload, whose pod template mounts the ConfigMap whatever it lists
  (:func:`kiln.operator.adapters.adapters_volume`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kiln.operator import keys, metrics
from kiln.operator.adapters import (
    ANNOTATION_ADAPTER_VERSION,
    AdapterPlan,
    AdapterView,
    adapter_job_name,
    adapter_secrets,
    build_adapter_job,
    configmap_name,
    pinned_digests,
    wanted_views,
)
from kiln.operator.apply import apply
from kiln.operator.context import Context, key_pair
from kiln.operator.job_pods import job_failure
from kiln.operator.kube import ApiError, api_path
from kiln.operator.naming import job_conflict
from kiln.operator.status import job_state
from kiln.operator.trust import manifest_problem

from kiln.api import LLMEngineSpec
from kiln.envelope import adapter_envelope
from kiln.lora_options import LoraAdapter


async def read_adapters(ctx: Context, spec: LLMEngineSpec, name: str, namespace: str, version: str,
                        old: dict[str, Any]) -> tuple[AdapterView, ...]:
    """Every adapter of the spec, for the wanted base ``version`` and the one still serving; () without ``lora``."""
    if spec.lora is None:
        return ()
    bases = list(dict.fromkeys(v for v in (version, old.get("servingVersion")) if v))
    pins = pinned_digests(await ctx.kube.get(api_path("v1", "configmaps", namespace, configmap_name(name))))
    verify_pem = (await key_pair(ctx)).verify_pem
    return tuple([await read_view(ctx, name, version, adapter, base, adapter_version, verify_pem,
                                  pins.get(adapter_version))
                  for adapter, base, adapter_version in wanted_views(spec, bases)])


async def read_view(ctx: Context, engine: str, wanted: str, adapter: LoraAdapter, base: str, version: str,
                    verify_pem: bytes, pinned: str | None) -> AdapterView:
    """One adapter's artifact (trusted or not: its signature, builder, envelope and ``pinned`` digest) and, while
    it is not built for the ``wanted`` base, its Job and why that failed."""
    manifest, document = await asyncio.to_thread(ctx.store.read_signed_manifest, version)
    uri = ctx.store.artifact_uri(version)
    pin_place = (f"ConfigMap {configmap_name(engine)}, contentDigest; a new revision of the adapter builds "
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
    if base != wanted:  # the old base's adapters are listed if built, never built again
        return AdapterView(adapter, base, version, uri, built=False)
    jobs = ctx.config.jobs_namespace
    job = await ctx.kube.get(api_path("batch/v1", "jobs", jobs, adapter_job_name(version)))
    if job is not None and (conflict := job_conflict(job, ANNOTATION_ADAPTER_VERSION, version)):
        return AdapterView(adapter, base, version, uri, built=False, conflict=conflict)  # never taken as this build
    failure = ""
    if job is not None and job_state(job).state == "failed":
        failure = (await job_failure(ctx.kube, jobs, job)).detail
    return AdapterView(adapter, base, version, uri, built=False, job=job, failure=failure)


async def act_adapters(ctx: Context, spec: LLMEngineSpec, name: str, namespace: str, plan: AdapterPlan,
                       logger: logging.Logger) -> None:
    """Carry out :func:`kiln.operator.adapters.plan_adapters`: Jobs first, then the list pods read."""
    if plan.delete_configmap:
        await ctx.kube.delete(api_path("v1", "configmaps", namespace, configmap_name(name)))
    for view in plan.jobs:
        await create_adapter_job(ctx, spec, name, namespace, view, logger)
    for view in plan.building:  # a credentials Secret created after its Job is copied now
        assert view.job is not None
        await keys.ensure_credentials(ctx.kube, namespace, adapter_secrets(spec, view.adapter), view.job,
                                      ctx.config.copy_credentials)
    if plan.configmap is not None:
        await apply(ctx.kube, plan.configmap)


async def create_adapter_job(ctx: Context, spec: LLMEngineSpec, name: str, namespace: str, view: AdapterView,
                             logger: logging.Logger) -> None:
    """Create the adapter's build Job in the jobs namespace (no owner, as a base build Job: another engine with the
    same base and adapter shares it; AlreadyExists means it is there), and copy the credentials it names."""
    jobs = ctx.config.jobs_namespace
    await keys.ensure_copy(ctx.kube, keys.signing_key_copy(jobs, await key_pair(ctx)))
    try:
        job = await ctx.kube.create(api_path("batch/v1", "jobs", jobs),
                                    build_adapter_job(spec, name, namespace, view, ctx.config))
    except ApiError as exc:
        if exc.status != 409:
            raise
        return
    await keys.ensure_credentials(ctx.kube, namespace, adapter_secrets(spec, view.adapter), job,
                                  ctx.config.copy_credentials)
    metrics.BUILDS_STARTED.inc()
    logger.info(f"created adapter build Job {jobs}/{adapter_job_name(view.version)} for {view.adapter.name} "
                f"({view.version})")
