"""Status as pure functions of what the operator observed.

``servingVersion`` is derived, never hoped for: a Deployment serves its
template's version only once the rollout has fully landed (observedGeneration
current, updated == desired == available replicas, no old pods left). While a
rollout is in flight the old pods serve, so the previous ``servingVersion``
stands. ``Ready`` is True only when the *wanted* version is the one serving.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kiln.operator.kube import iso, parse_time
from kiln.operator.naming import ANNOTATION_VERSION
from kiln.operator.pool_member import POOL_MISMATCH, SCALED_TO_ZERO, PoolView, listing_message, not_found_message

from kiln.artifact_manifest import rm_hint

BUILT, READY = "Built", "Ready"
MESSAGE_TAIL = 2000


class ObjectRead:
    """What a reconcile's read of one object (``self.body``: an LLMEngine or an LLMEnginePool) names: the object,
    its status as read (what the reconcile compares with and builds on) and its generation."""

    body: dict[str, Any]

    @property
    def name(self) -> str:
        return self.body["metadata"]["name"]

    @property
    def namespace(self) -> str:
        return self.body["metadata"]["namespace"]

    @property
    def old(self) -> dict[str, Any]:
        """The status as read: what this reconcile compares with and builds on."""
        return self.body.get("status") or {}

    @property
    def generation(self) -> int:
        return self.body["metadata"].get("generation") or 0


@dataclass(frozen=True)
class JobState:
    state: str  # "running" | "succeeded" | "failed"
    reason: str = ""
    message: str = ""


def now_iso() -> str:
    return iso(datetime.now(UTC))


def job_state(job: dict[str, Any]) -> JobState:
    status = job.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("status") != "True":
            continue
        if cond.get("type") in ("Complete", "SuccessCriteriaMet"):
            return JobState("succeeded", cond.get("reason") or "Completed", cond.get("message") or "")
        if cond.get("type") in ("Failed", "FailureTarget"):
            return JobState("failed", cond.get("reason") or "Failed", cond.get("message") or "")
    if (status.get("succeeded") or 0) >= 1:
        return JobState("succeeded", "Completed")
    return JobState("running")


def last_termination(pods: list[dict[str, Any]], limit: int = MESSAGE_TAIL) -> tuple[str, int | None]:
    """(the tail of the newest terminated builder container's message, or its log by FallbackToLogsOnError;
    its exit code). ("", None) when no container has terminated with a message."""
    found: list[tuple[str, str, int | None]] = []
    for pod in pods:
        status = pod.get("status") or {}
        # The fetch init container fails first when the model cannot be read; the build container after it.
        for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
            term = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")
            if term and term.get("message"):
                found.append((term.get("finishedAt") or "", term["message"].strip(), term.get("exitCode")))
    if not found:
        return "", None
    _, message, code = max(found, key=lambda f: f[:2])
    return (message if len(message) <= limit else "…" + message[-limit:]), code


def termination_message(pods: list[dict[str, Any]], limit: int = MESSAGE_TAIL) -> str:
    """The tail of the newest terminated builder container's message (or its log, by FallbackToLogsOnError)."""
    return last_termination(pods, limit)[0]


def failure_message(job_name: str | None, job: JobState, detail: str) -> str:
    """The Built condition's message for a failed build Job."""
    message = f"build Job {job_name} failed ({job.reason}): {job.message}".rstrip(": ")
    return message + (f"; builder said: {detail}" if detail else "")


def job_duration_seconds(job: dict[str, Any]) -> float | None:
    status = job.get("status") or {}
    start, end = status.get("startTime"), status.get("completionTime")
    if not start or not end:
        return None
    return (parse_time(end) - parse_time(start)).total_seconds()


def rollout_complete(workload: dict[str, Any]) -> bool:
    """Every replica runs the current template and is available, and no old one is left.

    A LeaderWorkerSet counts groups: ``readyReplicas`` are groups whose leader is Ready and whose
    workers' StatefulSet is ready (the leader's ``/ready`` already waits for every rank), and
    ``replicas`` includes a surge group until the rolling update has removed it."""
    spec, status = workload.get("spec") or {}, workload.get("status") or {}
    generation = (workload.get("metadata") or {}).get("generation") or 0
    wanted = spec.get("replicas", 1)
    available = "readyReplicas" if workload.get("kind") == "LeaderWorkerSet" else "availableReplicas"
    return ((status.get("observedGeneration") or 0) >= generation and (status.get("updatedReplicas") or 0) == wanted
            and (status.get(available) or 0) == wanted and (status.get("replicas") or 0) == wanted)


def pod_template(workload: dict[str, Any]) -> dict[str, Any]:
    """The template of the pods that serve the API: a Deployment's, a LeaderWorkerSet's leader's."""
    spec = workload.get("spec") or {}
    if workload.get("kind") == "LeaderWorkerSet":
        lwt = spec.get("leaderWorkerTemplate") or {}
        return lwt.get("leaderTemplate") or lwt.get("workerTemplate") or {}
    return spec.get("template") or {}


def template_version(workload: dict[str, Any]) -> str | None:
    template_meta = pod_template(workload).get("metadata") or {}
    return (template_meta.get("annotations") or {}).get(ANNOTATION_VERSION)


def serving_version(deployment: dict[str, Any] | None, previous: str | None) -> str | None:
    if deployment is None:
        return None
    if (deployment.get("spec") or {}).get("replicas", 1) == 0:
        return None
    if rollout_complete(deployment):
        return template_version(deployment)
    return previous


def condition(type_: str, ok: bool | None, reason: str, message: str, generation: int,
              previous: list[dict[str, Any]] | None = None, now: str | None = None) -> dict[str, Any]:
    """A Kubernetes condition; lastTransitionTime moves only when ``status`` changes."""
    status = "Unknown" if ok is None else ("True" if ok else "False")
    old = next((c for c in previous or [] if c.get("type") == type_), None)
    since = old.get("lastTransitionTime") if old and old.get("status") == status else None
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": since or now or now_iso(), "observedGeneration": generation}


def transitions(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(event type, reason, message) for each condition whose status or reason changed."""
    events = []
    old_by_type = {c.get("type"): c for c in old.get("conditions") or []}
    for cond in new.get("conditions") or []:
        before = old_by_type.get(cond["type"]) or {}
        if (before.get("status"), before.get("reason")) == (cond["status"], cond["reason"]):
            continue
        failed = cond["status"] == "False" and cond["reason"] in FAILURE_REASONS
        events.append(("Warning" if failed else "Normal", cond["reason"], cond["message"]))
    return events


FAILURE_REASONS = {"InvalidSpec", "BuildFailed", "BuildRetrying", "ArtifactMissing", "ArtifactUntrusted", "LeaderWorkerSetMissing"}
FAILURE_REASONS |= {"BuildJobConflict"}
FAILURE_REASONS |= {"PrerequisiteMissing", "InsufficientGPU", "Unschedulable"}  # scale out
FAILURE_REASONS |= {"PoolNotFound", "EngineTooBigForPool", "PoolMismatch"}  # engine pools (pool_member)


def pruned(value: Any) -> Any:
    """``value`` without None-valued keys, at any depth: what a merge patch leaves of it."""
    if isinstance(value, dict):
        return {k: pruned(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [pruned(v) for v in value]
    return value


def same_status(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether writing ``new`` would change nothing the operator owns in ``old`` (a None in ``new`` removes a
    key with a merge patch, so it equals an absent one)."""
    return all(pruned(old.get(key)) == pruned(value) for key, value in new.items())


@dataclass(frozen=True)
class Observation:
    """Everything one reconcile saw; :func:`compose_status` turns it into ``status``."""

    generation: int
    old: dict[str, Any]
    engine_version: str | None = None
    artifact_uri: str | None = None
    invalid: str | None = None  # a user-facing message naming the field
    built: bool = False  # the artifact of engine_version is in the store
    untrusted: str | None = None  # it is, but this operator did not build it (why; kiln.operator.trust)
    missing_api: str | None = None  # the spec needs an API (LeaderWorkerSet) this cluster does not serve
    conflict: str | None = None  # the build Job's name is taken by another version's Job (naming.job_conflict)
    taken: str | None = None  # its workload's name is another object's (naming.taken_name)
    job: JobState | None = None  # the build Job, when not built
    job_name: str | None = None
    failure_detail: str = ""  # tail of the builder's termination message
    missing_credentials: str | None = None  # a credentials Secret the build Job waits for, and how to create it
    serving: str | None = None  # derived servingVersion
    replicas: int = 1
    endpoint: str | None = None
    history: list[dict[str, Any]] | None = None
    artifact: dict[str, Any] | None = None  # status.artifact: the pinned build of engine_version
    build: dict[str, Any] | None = None  # status.build: its build attempts (kiln.operator.retry)
    # -- scale out (docs/scale-out.md) --
    replica_status: dict[str, Any] | None = None  # status.replicas (kiln.operator.scale_out.replica_status)
    autoscaled: bool = False  # the autoscaler owns the replica count
    unschedulable: tuple[str, str] | None = None  # (reason, message) of new pods the scheduler cannot place
    prerequisite: str | None = None  # a missing CRD the spec needs (kiln.operator.scale_out)
    # -- LoRA (docs/lora.md): status.adapters, written only when known (the base serves); None removes it --
    adapters: list[dict[str, Any]] | None = None
    adapters_known: bool = False
    # -- engine pools (docs/pools.md): spec.serving.pool's LLMEnginePool as read; None: not in a pool --
    pool: PoolView | None = None


Cond = Callable[[str, bool | None, str, str], dict[str, Any]]  # compose_status.cond


def compose_status(obs: Observation, now: str | None = None) -> dict[str, Any]:
    """``status`` from what one reconcile saw. A spec that builds nothing, an API the cluster lacks and an
    artifact this operator did not build each fail both conditions; otherwise ``Built`` follows the build
    (:func:`_build_progress`) and, once built, ``Ready`` follows the rollout (:func:`_rollout`)."""
    prev = obs.old.get("conditions") or []

    def cond(type_: str, ok: bool | None, reason: str, message: str) -> dict[str, Any]:
        return condition(type_, ok, reason, message, obs.generation, prev, now)

    status: dict[str, Any] = {"observedGeneration": obs.generation, "servingVersion": obs.serving}
    still = f"; {obs.serving} keeps serving" if obs.serving and obs.serving != obs.engine_version else ""
    if obs.invalid is not None:  # the spec builds nothing: no wanted version
        status.update(phase="Failed", engineVersion=None, artifactURI=None,
                      conditions=_failed(cond, "InvalidSpec", obs.invalid, still))
        return status
    status.update(engineVersion=obs.engine_version, artifactURI=obs.artifact_uri)
    if obs.history is not None:
        status["history"] = obs.history
    status.update(artifact=obs.artifact, build=obs.build)
    if obs.adapters_known:
        status["adapters"] = obs.pool.adapter_statuses(obs.adapters) if obs.pool and obs.adapters else obs.adapters
    status["endpoint"] = obs.endpoint if obs.serving else None  # None: a merge patch removes it
    status["pool"] = obs.pool.status() if obs.pool is not None else None
    if obs.missing_api is not None:  # nothing is built or rolled out until the API is there
        status.update(phase="Failed", conditions=_failed(cond, "LeaderWorkerSetMissing", obs.missing_api, still))
    elif obs.untrusted is not None:
        status.update(phase="Failed", conditions=_failed(cond, "ArtifactUntrusted", _untrusted_message(obs), still))
    elif obs.conflict is not None:
        status.update(phase="Failed", conditions=_failed(cond, "BuildJobConflict", obs.conflict, still))
    elif obs.taken is not None:
        status.update(phase="Failed", conditions=_failed(cond, "NameConflict", obs.taken, still))
    elif not obs.built:
        status.update(_build_progress(obs, cond, still))
    else:
        status.update(_rollout(obs, cond, still))
    return status


def _failed(cond: Cond, reason: str, message: str, still: str) -> list[dict[str, Any]]:
    """Both conditions False for one reason; Ready adds which version keeps serving."""
    return [cond(BUILT, False, reason, message), cond(READY, False, reason, message + still)]


def _untrusted_message(obs: Observation) -> str:
    store = (obs.artifact_uri or "").rpartition("/engines/")[0] or "<store>"
    return (f"{obs.artifact_uri} is in the store but {obs.untrusted}, so this operator will not serve it, "
            f"and a build cannot replace a published version; remove it ({rm_hint(store, obs.engine_version)}) "
            "and the operator rebuilds it")


def _build_progress(obs: Observation, cond: Cond, still: str) -> dict[str, Any]:
    """phase and conditions while the wanted version is not in the store: its build Job runs or ended."""
    job, record = obs.job or JobState("running"), obs.build or {}
    if record.get("retryAt"):
        attempt = f"attempt {record.get('attempts', 1) + 1} starts at {record['retryAt']}"
        built = cond(BUILT, False, "BuildRetrying", f"{record.get('message')}; a storage error: {attempt}")
        ready = cond(READY, False, "BuildRetrying", f"waiting for {obs.engine_version} to build ({attempt}){still}")
        return {"phase": "Building", "conditions": [built, ready]}
    if record.get("failedGeneration") is not None or job.state == "failed":
        detail = record.get("message") or failure_message(obs.job_name, job, obs.failure_detail)
        if record.get("attempts", 1) > 1:
            detail += f" (attempt {record['attempts']}; not retried: edit the spec to build again)"
        built = cond(BUILT, False, "BuildFailed", detail)
        ready = cond(READY, False, "BuildFailed", f"{obs.engine_version} failed to build{still}")
        return {"phase": "Failed", "conditions": [built, ready]}
    if job.state == "succeeded":
        msg = (f"build Job {obs.job_name} succeeded but {obs.artifact_uri} has no valid manifest; "
               f"delete the Job to rebuild")
        return {"phase": "Failed", "conditions": _failed(cond, "ArtifactMissing", msg, still)}
    return {"phase": "Building", "conditions": [
        cond(BUILT, False, "Building", f"build Job {obs.job_name} is building {obs.engine_version}"
             + (f"; it waits for its credentials: {obs.missing_credentials}" if obs.missing_credentials else "")),
        cond(READY, False, "Building", f"waiting for {obs.engine_version} to build{still}")]}


def _rollout(obs: Observation, cond: Cond, still: str) -> dict[str, Any]:
    """replicas, phase and conditions once the wanted version is built: Ready follows its rollout."""
    out: dict[str, Any] = {}
    built = cond(BUILT, True, "ArtifactAvailable", f"{obs.artifact_uri} is published and verified")
    replicas = obs.replicas
    if obs.replica_status is not None:  # scale out: current vs desired, and who decides
        out["replicas"] = obs.replica_status
        replicas = obs.replica_status["desired"] if obs.autoscaled else replicas
    if obs.prerequisite is not None:
        phase, ready = "Failed", cond(READY, False, "PrerequisiteMissing", obs.prerequisite + still)
    elif obs.pool is not None:
        phase, ready = _pooled(obs, obs.pool, cond, still)
    elif obs.serving == obs.engine_version:
        phase, ready = "Ready", cond(READY, True, "Serving", f"all {replicas} replica(s) serve {obs.engine_version}")
    elif replicas == 0:
        owner = (obs.replica_status or {}).get("owner", "the autoscaler")
        why = (f"scaled to zero by {owner}; a request through the KEDA HTTP add-on's interceptor starts a pod"
               if obs.autoscaled else "spec.serving.replicas is 0; nothing serves")
        phase, ready = "Ready", cond(READY, False, SCALED_TO_ZERO, why)
    elif obs.unschedulable is not None:
        phase, ready = "Deploying", cond(READY, False, *obs.unschedulable)
    else:
        phase, ready = "Deploying", cond(READY, False, "RollingOut", f"rolling out {obs.engine_version}{still}")
    out.update(phase=phase, conditions=[built, ready])
    return out


def _pooled(obs: Observation, pool: PoolView, cond: Cond, still: str) -> tuple[str, dict[str, Any]]:
    """phase and Ready of a built engine of a pool (kiln.operator.pool_member): Ready once the pool serves the
    wanted version; Failed when the pool refuses it; Deploying while there is no such pool or it does not list
    the version yet (an own Deployment from before it joined keeps serving meanwhile)."""
    version = obs.engine_version
    if not pool.found:
        return "Deploying", cond(READY, False, "PoolNotFound", not_found_message(pool) + still)
    if pool.lists(version) == "Refused":
        message = pool.message or f"LLMEnginePool {pool.name} refuses it"
        return "Failed", cond(READY, False, pool.refusal or POOL_MISMATCH, message + still)
    if pool.serves and pool.version == version:
        return "Ready", cond(READY, *pool.serving(version))
    reason = "PoolNotReady" if pool.lists(version) == "Listed" else "PoolListing"
    return "Deploying", cond(READY, False, reason, listing_message(pool, version) + still)
