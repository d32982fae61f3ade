"""What one reconcile does, as pure functions: no API calls, no store reads, no clock.

:func:`kiln.operator.reconcile.reconcile` reads the world once into a :class:`World`, asks :func:`decide`
for a :class:`Plan` (which one step converges the engine), runs that step, which reports what it left as
an :class:`Outcome`, and turns both into an :class:`~kiln.operator.status.Observation` with
:func:`observation`, which :func:`~kiln.operator.status.compose_status` turns into ``status``. Everything
here is tested without a cluster (tests/operator/test_decide.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from kiln.operator import retry, scale_out
from kiln.operator.adapters import AdapterPlan, AdapterView, plan_adapters
from kiln.operator.kube import iso
from kiln.operator.naming import LWS_API_VERSION, LWS_PLURAL, job_name, owner_reference
from kiln.operator.pool_member import LIST_SYNC, PoolView, pool_view
from kiln.operator.scheduling import unschedulable
from kiln.operator.settings import OperatorConfig
from kiln.operator.status import JobState, ObjectRead, Observation, job_state, rollout_complete, serving_version
from kiln.operator.trust import pinned_digest
from kiln.operator.workloads import endpoint

from kiln.api import LLMEngineSpec
from kiln.artifact_manifest import Manifest
from kiln.engine_status import add_to_history

REPORT, BUILD, RETRY, SERVE = "report", "build", "retry", "serve"  # Plan.step
SCALE_DOWN_DEPLOYMENT, DELETE_LWS = "scale-down-deployment", "delete-lws"  # retirement()


@dataclass(frozen=True)
class World(ObjectRead):
    """What one reconcile read, once, at its top (``reconcile.observe``). Reads stop where the rest could
    change nothing: an invalid spec reads no workloads, a missing LeaderWorkerSet API no store, and the
    build Job is read only while it matters (no valid artifact yet, or a build just finished)."""

    body: dict[str, Any]  # the LLMEngine
    invalid: str | None = None  # why the spec can never work (kiln.operator.validation); nothing else read
    spec: LLMEngineSpec | None = None
    version: str | None = None  # engine version: the hash of the build envelope
    artifact_uri: str | None = None
    deployment: dict[str, Any] | None = None  # the engine's Deployment, as read
    lws: dict[str, Any] | None = None  # its LeaderWorkerSet, as read (absent without the CRD)
    lws_served: bool = True  # False: a multi-node spec on a cluster without the LeaderWorkerSet API
    manifest: Manifest | None = None  # the store's valid manifest of ``version``
    untrusted: str | None = None  # why this operator will not serve that artifact (kiln.operator.trust)
    job: dict[str, Any] | None = None  # the build Job of ``version``
    conflict: str | None = None  # the Job under its name is another version's (naming.job_conflict): not adopted
    taken: str | None = None  # another object controls the workload under its name (naming.taken_name): untouched
    failure: retry.Failure = retry.Failure()  # what a failed build Job's pods said
    now: datetime | None = None  # when this was read (a retry is due at status.build.retryAt)
    # spec.lora's adapters for the wanted base and the one serving, read once the base is trusted in the store
    adapters: tuple[AdapterView, ...] = ()
    pool: dict[str, Any] | None = None  # the LLMEnginePool of spec.serving.pool, when it names one and it exists
    list_sync: timedelta = LIST_SYNC  # OperatorConfig.pool_list_sync_seconds: when its pods have loaded its list

    @property
    def pinned(self) -> str | None:
        """The content digest this engine pinned for ``version`` (kiln.operator.trust.pinned_digest)."""
        return pinned_digest(self.old, self.version) if self.version else None

    @property
    def record(self) -> dict[str, Any] | None:
        """``status.build`` of ``version``: its build attempts (kiln.operator.retry)."""
        return retry.record_of(self.old, self.version)

    @property
    def membership(self) -> PoolView | None:
        """How the pool of spec.serving.pool lists this engine (kiln.operator.pool_member); None: not in a pool."""
        return pool_view(self.spec, self.name, self.namespace, self.pool, self.now, self.list_sync) \
            if self.spec is not None else None


@dataclass(frozen=True)
class Plan:
    step: str  # REPORT: write status only | BUILD: get or create the build Job | RETRY: delete the failed build
    # Job and create the next | SERVE: roll the artifact out
    warning: str | None = None  # log it: the engine just entered a failure that needs a person
    cache: str | None = None  # "hit" | "miss": a newly wanted version was found in / missing from the store
    adapters: AdapterPlan | None = None  # SERVE: the adapters' Jobs, ConfigMap and status.adapters


@dataclass(frozen=True)
class Outcome:
    """What the step left: the workloads as they are now, and what only acting could show."""

    deployment: dict[str, Any] | None = None
    lws: dict[str, Any] | None = None
    job: dict[str, Any] | None = None  # BUILD: the build Job, got or created
    failure_detail: str = ""  # BUILD: the builder's termination message, when the Job failed
    missing_credentials: str | None = None  # BUILD: a credentials copy the Job waits for, to create by hand
    prerequisite: str | None = None  # SERVE: a CRD scale-out needs is missing; no workload was applied
    new_pods: list[dict[str, Any]] | None = None  # SERVE: the new version's pods, read while it rolls out


# The policy, in order; the first that applies decides:
#
# 1. An invalid spec builds and serves nothing: report Failed (the caller raises PermanentError).
# 2. A replica that spans nodes needs the LeaderWorkerSet API. Checked before anything is built: a
#    multi-node build takes hours and could never serve here. Not an invalid spec: installing
#    LeaderWorkerSet fixes it, and the next timer reconcile notices.
# 3. An artifact in the store that this operator did not build, or whose manifest is no longer the build
#    this engine pinned (status.artifact), is never served (the old version keeps serving, the pods keep
#    the pinned expectation) and never rebuilt (a build would find the version published); the status
#    says how to recover.
# 4. No valid manifest for the engine version: make sure ONE build Job exists for it. Its name comes from
#    the version, so creation races (two engines with one envelope, a restart, a second replica) end in
#    AlreadyExists, which is fine; every engine waiting for it adds itself as a (non-controller) owner, so
#    the garbage collector deletes the Job with the last of them: no finalizer on LLMEngines. A failed Job
#    is retried only after a storage error, with backoff; any other failure waits for a spec change
#    (kiln.operator.retry.build_step).
# 5. Otherwise roll it out. The serving workload is not touched until the wanted artifact exists, so a
#    GitOps bump keeps the old version serving for the whole build, and the rollout itself keeps old
#    pods until new ones are available (maxUnavailable 0). A served base also gets its adapters' plan
#    (kiln.operator.adapters.plan_adapters: their Jobs, the ConfigMap pods read, status.adapters); an engine
#    that does not serve its wanted version yet plans none, and status.adapters stays as it was. An engine of
#    a pool rolls out nothing of its own: its pool lists it (kiln.operator.pool_member).
#
# Warnings are logged once, when the engine enters the failure (not on every timer reconcile).
def decide(world: World) -> Plan:
    if world.invalid is not None:
        return Plan(REPORT)
    assert world.spec is not None
    phase = world.old.get("phase")
    is_new = world.old.get("engineVersion") != world.version
    if not world.lws_served:
        return Plan(REPORT, warning=lws_missing_message(world.spec) if phase != "Failed" else None)
    if world.untrusted is not None:
        warning = f"{world.artifact_uri}: not serving it: {world.untrusted}"
        return Plan(REPORT, warning=warning if is_new or phase != "Failed" else None)
    if (clash := world.conflict or world.taken) is not None:
        return Plan(REPORT, warning=clash if phase != "Failed" else None)
    if world.manifest is None:
        step = retry.build_step(world.record, world.job, world.generation, world.now)
        return Plan({retry.BUILD: BUILD, retry.RETRY: RETRY, retry.WAIT: REPORT}[step],
                    cache="miss" if is_new else None)
    return Plan(SERVE, cache="hit" if is_new and phase != "Building" else None, adapters=adapter_plan(world))


def adapter_plan(world: World) -> AdapterPlan:
    """Adapters are built against, and listed for, a served base (docs/lora.md): only a SERVE plan has them."""
    assert world.spec is not None and world.version is not None
    owner = owner_reference(world.body) if world.spec.lora is not None else None  # the ConfigMap's
    return plan_adapters(world.spec, world.name, world.namespace, world.version, world.adapters, world.old, owner)


def observation(world: World, plan: Plan, outcome: Outcome, config: OperatorConfig) -> Observation:
    """Everything the status is composed from: the world as read, and what the plan's step left."""
    old = world.old
    if world.invalid is not None:
        return Observation(generation=world.generation, old=old, invalid=world.invalid,
                           serving=old.get("servingVersion"))
    spec, version = world.spec, world.version
    assert spec is not None and version is not None
    serving = serving_now(spec, outcome.deployment, outcome.lws, old.get("servingVersion"))
    own_endpoint, member = endpoint(world.name, world.namespace, spec), world.membership
    if member is not None and member.serves:  # its pool's pods serve it, whatever its own ones do
        serving, own_endpoint = member.version, member.endpoint
    base = dict(generation=world.generation, old=old, engine_version=version, artifact_uri=world.artifact_uri,
                job_name=job_name(version), replicas=spec.serving.replicas, endpoint=own_endpoint,
                history=old.get("history") or [], serving=serving, pool=member)
    if plan.step == SERVE:
        base["history"] = add_to_history(base["history"], history_entry(world))
        adapters = plan.adapters.statuses if plan.adapters is not None else None
        return Observation(**base, built=True, prerequisite=outcome.prerequisite, artifact=pin(world),
                           build=world.record, adapters=adapters, adapters_known=True,
                           **scale_out_view(world, outcome, serving, config))
    if world.manifest is None and world.lws_served and world.untrusted is None and world.conflict is None \
            and world.taken is None:
        job = outcome.job if plan.step in (BUILD, RETRY) else world.job
        record = retry.next_record(world.record, version, job, world.failure, world.generation,
                                   world.now or EPOCH, job_name(version), config)
        return Observation(**base, built=False, job=job_state(job or {}), failure_detail=world.failure.detail,
                           missing_credentials=outcome.missing_credentials,
                           artifact=unbuilt_pin(world, record), build=record)
    missing_api = None if world.lws_served else lws_missing_message(spec)
    return Observation(**base, missing_api=missing_api, untrusted=world.untrusted, conflict=world.conflict,
                       taken=world.taken, artifact=old.get("artifact"), build=old.get("build"))


EPOCH = datetime(1970, 1, 1, tzinfo=UTC)  # the clock of a World read without one (tests)


def unbuilt_pin(world: World, record: dict[str, Any] | None) -> dict[str, Any]:
    """``status.artifact`` while the version is not in the store: a new build Job (a new attempt) is pinned
    afresh when it publishes; otherwise the pin stays (a manifest deleted and republished by someone else is
    not a build of this operator's, and must match the pin)."""
    old = world.old.get("artifact") or {}
    new_job = record is not None and (world.record or {}).get("jobUID") != record.get("jobUID")
    if old.get("engineVersion") == world.version and not new_job:
        return old
    return {"engineVersion": world.version, "contentDigest": None}


def pin(world: World) -> dict[str, Any]:
    """``status.artifact`` of a served version: the digest pinned before, or at first sight this manifest's."""
    assert world.manifest is not None
    return {"engineVersion": world.version, "contentDigest": world.pinned or world.manifest.content_digest}


def history_entry(world: World) -> dict[str, Any]:
    """The ``status.history`` entry of the version being served: what it is, and when it was built."""
    assert world.manifest is not None
    return {"engineVersion": world.version, "artifactURI": world.artifact_uri,
            "builtAt": iso(world.manifest.created_at),
            "contentDigest": pin(world)["contentDigest"]}


def lws_missing_message(spec: LLMEngineSpec) -> str:
    shape = spec.replica_shape
    return (f"spec.pipelineParallel: one replica of this engine spans {shape.pods} pods (tensorParallel "
            f"{shape.tensor_parallel} x pipelineParallel {shape.pipeline_parallel} ranks, {shape.ranks_per_pod} per "
            f"node), which kiln runs as a LeaderWorkerSet, but this cluster does not serve {LWS_API_VERSION} "
            f"{LWS_PLURAL} (the LeaderWorkerSet CRD is not installed). Install LeaderWorkerSet, a prerequisite of "
            "multi-node engines (docs/multi-node-cluster.md), and the operator continues on its own; or lower "
            "tensorParallel x pipelineParallel to fit one node")


def serving_now(spec: LLMEngineSpec, deployment: dict[str, Any] | None, lws: dict[str, Any] | None,
                previous: str | None) -> str | None:
    """servingVersion with either workload kind: the wanted kind's template version once its rollout is
    complete; otherwise, while pods of either kind run, the version that served before."""
    wanted, other = (lws, deployment) if spec.replica_shape.multi_node else (deployment, lws)
    if wanted is not None and serving_version(wanted, None) is not None:
        return serving_version(wanted, None)
    running = [w for w in (wanted, other) if w is not None and (w.get("spec") or {}).get("replicas", 1) != 0]
    return previous if running else None


def retirement(spec: LLMEngineSpec, deployment: dict[str, Any] | None, lws: dict[str, Any] | None) -> str | None:
    """When an engine moves between a Deployment and a LeaderWorkerSet (its shape crossed a node), the old
    kind keeps serving until the new one's rollout is complete, then goes: a LeaderWorkerSet is deleted
    (DELETE_LWS), a Deployment scaled to zero (SCALE_DOWN_DEPLOYMENT: the chart grants Deployments no delete;
    the garbage collector removes it with the engine, and a move back re-renders it). None: nothing to do."""
    if spec.replica_shape.multi_node:
        if lws is None or not rollout_complete(lws) or deployment is None:
            return None
        return None if (deployment.get("spec") or {}).get("replicas", 1) == 0 else SCALE_DOWN_DEPLOYMENT
    if deployment is None or not rollout_complete(deployment) or lws is None:
        return None
    return DELETE_LWS


def retirements(world: World, deployment: dict[str, Any] | None, lws: dict[str, Any] | None) -> tuple[str, ...]:
    """What the serve step retires of the workloads as they are: the other kind (:func:`retirement`), or, for an
    engine of a pool, its own pods once its pool serves it (they served it alone until then)."""
    assert world.spec is not None
    member = world.membership
    if member is None:
        return tuple(r for r in (retirement(world.spec, deployment, lws),) if r is not None)
    if not member.serves:
        return ()
    scale_down = deployment is not None and (deployment.get("spec") or {}).get("replicas", 1) != 0
    return (SCALE_DOWN_DEPLOYMENT,) * scale_down + (DELETE_LWS,) * (lws is not None)


def scaled_workload(spec: LLMEngineSpec, deployment: dict[str, Any] | None,
                    lws: dict[str, Any] | None) -> dict[str, Any] | None:
    """The workload the autoscaler scales: the LeaderWorkerSet when a replica spans pods."""
    return lws if spec.replica_shape.pods > 1 else deployment


def replica_counts(world: World, workload: dict[str, Any] | None, config: OperatorConfig) -> dict[str, Any]:
    """``status.replicas``: the counts, and who owns the desired one."""
    assert world.spec is not None
    scaler = "HorizontalPodAutoscaler" if config.autoscaler == "hpa" else "ScaledObject"
    return scale_out.replica_status(workload, world.spec.serving.autoscaling is not None, f"{scaler}/{world.name}")


def awaits_new_pods(world: World, deployment: dict[str, Any] | None, lws: dict[str, Any] | None,
                    config: OperatorConfig) -> bool:
    """Whether new pods should be running but the version does not serve yet: then read them, to tell
    pods the scheduler cannot place (Insufficient GPU) from a rollout that is merely in flight."""
    assert world.spec is not None
    if world.spec.serving.pool is not None:
        return False  # no own pods roll out: the pool's serve it
    workload = scaled_workload(world.spec, deployment, lws)
    serving = serving_now(world.spec, deployment, lws, world.old.get("servingVersion"))
    return workload is not None and serving != world.version and replica_counts(world, workload, config)[
        "desired"] > 0


def scale_out_view(world: World, outcome: Outcome, serving: str | None, config: OperatorConfig) -> dict[str, Any]:
    """The scale-out part of an Observation: replica counts and their owner, and new pods that cannot be placed."""
    assert world.spec is not None and world.version is not None
    workload = scaled_workload(world.spec, outcome.deployment, outcome.lws)
    stuck = None
    if outcome.new_pods is not None:
        stuck = unschedulable(outcome.new_pods, world.spec, world.version, config, serving)
    return {"replica_status": replica_counts(world, workload, config),
            "autoscaled": world.spec.serving.autoscaling is not None, "unschedulable": stuck}


def finished_build(world: World, plan: Plan, outcome: Outcome,
                   record: dict[str, Any] | None = None) -> tuple[JobState, dict[str, Any] | None] | None:
    """(how, the Job) when this reconcile sees a build end; None otherwise. A failure counts once, when it is
    recorded in ``status.build`` (``record``: the new one); a version that reaches the store while the engine
    was Building counts as a success."""
    if plan.step == SERVE and world.old.get("phase") == "Building":
        return JobState("succeeded"), world.job
    if world.job is not None and retry.newly_failed(world.record, record):
        return job_state(world.job), world.job
    return None
