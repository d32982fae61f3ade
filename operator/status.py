"""Status as pure functions of what the operator observed.

``servingVersion`` is derived, never hoped for: a Deployment serves its
template's version only once the rollout has fully landed (observedGeneration
current, updated == desired == available replicas, no old pods left). While a
rollout is in flight the old pods serve, so the previous ``servingVersion``
stands. ``Ready`` is True only when the *wanted* version is the one serving.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kiln.operator.naming import ANNOTATION_VERSION

BUILT, READY = "Built", "Ready"
MESSAGE_TAIL = 2000


@dataclass(frozen=True)
class JobState:
    state: str  # "running" | "succeeded" | "failed"
    reason: str = ""
    message: str = ""


def now_iso() -> str:
    return datetime.now(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


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


def termination_message(pods: list[dict[str, Any]], limit: int = MESSAGE_TAIL) -> str:
    """The tail of the newest terminated builder container's message (or its log, by FallbackToLogsOnError)."""
    found: list[tuple[str, str]] = []
    for pod in pods:
        status = pod.get("status") or {}
        # The fetch init container fails first when the model cannot be read; the build container after it.
        for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
            term = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")
            if term and term.get("message"):
                found.append((term.get("finishedAt") or "", term["message"].strip()))
    if not found:
        return ""
    message = max(found)[1]
    return message if len(message) <= limit else "…" + message[-limit:]


def job_duration_seconds(job: dict[str, Any]) -> float | None:
    status = job.get("status") or {}
    start, end = status.get("startTime"), status.get("completionTime")
    if not start or not end:
        return None
    parse = lambda s: datetime.fromisoformat(s.replace("Z", "+00:00"))  # noqa: E731
    return (parse(end) - parse(start)).total_seconds()


def rollout_complete(workload: dict[str, Any]) -> bool:
    """Every replica runs the current template and is available, and no old one is left.

    A LeaderWorkerSet counts groups: ``readyReplicas`` are groups whose leader is Ready and whose
    workers' StatefulSet is ready (the leader's ``/ready`` already waits for every rank), and
    ``replicas`` includes a surge group until the rolling update has removed it."""
    spec, status = workload.get("spec") or {}, workload.get("status") or {}
    generation = (workload.get("metadata") or {}).get("generation") or 0
    wanted = spec.get("replicas", 1)
    available = "readyReplicas" if workload.get("kind") == "LeaderWorkerSet" else "availableReplicas"
    return (
        (status.get("observedGeneration") or 0) >= generation
        and (status.get("updatedReplicas") or 0) == wanted
        and (status.get(available) or 0) == wanted
        and (status.get("replicas") or 0) == wanted
    )


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


FAILURE_REASONS = {"InvalidSpec", "BuildFailed", "ArtifactMissing", "ArtifactUntrusted", "LeaderWorkerSetMissing"}
FAILURE_REASONS |= {"PrerequisiteMissing", "InsufficientGPU", "Unschedulable"}  # scale out


def same_status(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether writing ``new`` would change nothing the operator owns in ``old``."""
    return all(old.get(key) == value for key, value in new.items())


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
    job: JobState | None = None  # the build Job, when not built
    job_name: str | None = None
    failure_detail: str = ""  # tail of the builder's termination message
    serving: str | None = None  # derived servingVersion
    replicas: int = 1
    endpoint: str | None = None
    history: list[dict[str, Any]] | None = None
    # -- scale out (docs/scale-out.md) --
    replica_status: dict[str, Any] | None = None  # status.replicas (kiln.operator.scale_out.replica_status)
    autoscaled: bool = False  # the autoscaler owns the replica count
    unschedulable: tuple[str, str] | None = None  # (reason, message) of new pods the scheduler cannot place
    prerequisite: str | None = None  # a missing CRD the spec needs (kiln.operator.scale_out)


def compose_status(obs: Observation, now: str | None = None) -> dict[str, Any]:
    prev = obs.old.get("conditions") or []
    gen = obs.generation

    def cond(type_: str, ok: bool | None, reason: str, message: str) -> dict[str, Any]:
        return condition(type_, ok, reason, message, gen, prev, now)

    status: dict[str, Any] = {"observedGeneration": gen, "servingVersion": obs.serving}
    still = f"; {obs.serving} keeps serving" if obs.serving and obs.serving != obs.engine_version else ""
    if obs.invalid is not None:  # the spec builds nothing: no wanted version
        status.update(phase="Failed", engineVersion=None, artifactURI=None, conditions=[
            cond(BUILT, False, "InvalidSpec", obs.invalid),
            cond(READY, False, "InvalidSpec", obs.invalid + still)])
        return status
    status.update(engineVersion=obs.engine_version, artifactURI=obs.artifact_uri)
    if obs.history is not None:
        status["history"] = obs.history
    status["endpoint"] = obs.endpoint if obs.serving else None  # None: a merge patch removes it
    if obs.missing_api is not None:  # nothing is built or rolled out until the API is there
        status.update(phase="Failed", conditions=[
            cond(BUILT, False, "LeaderWorkerSetMissing", obs.missing_api),
            cond(READY, False, "LeaderWorkerSetMissing", obs.missing_api + still)])
        return status
    if obs.untrusted is not None:
        store = (obs.artifact_uri or "").rpartition("/engines/")[0] or "<store>"
        msg = (f"{obs.artifact_uri} is in the store but {obs.untrusted}, so this operator will not serve it, "
               f"and a build cannot replace a published version; remove it (`kiln cache rm {obs.engine_version} "
               f"--store {store}`) and the operator rebuilds it")
        status.update(phase="Failed", conditions=[
            cond(BUILT, False, "ArtifactUntrusted", msg), cond(READY, False, "ArtifactUntrusted", msg + still)])
        return status
    if not obs.built:
        job = obs.job or JobState("running")
        if job.state == "failed":
            detail = f"build Job {obs.job_name} failed ({job.reason}): {job.message}".rstrip(": ")
            if obs.failure_detail:
                detail += f"; builder said: {obs.failure_detail}"
            built = cond(BUILT, False, "BuildFailed", detail)
            ready = cond(READY, False, "BuildFailed", f"{obs.engine_version} failed to build{still}")
            status.update(phase="Failed", conditions=[built, ready])
        elif job.state == "succeeded":
            msg = (f"build Job {obs.job_name} succeeded but {obs.artifact_uri} has no valid manifest; "
                   f"delete the Job to rebuild")
            status.update(phase="Failed", conditions=[
                cond(BUILT, False, "ArtifactMissing", msg), cond(READY, False, "ArtifactMissing", msg + still)])
        else:
            status.update(phase="Building", conditions=[
                cond(BUILT, False, "Building", f"build Job {obs.job_name} is building {obs.engine_version}"),
                cond(READY, False, "Building", f"waiting for {obs.engine_version} to build{still}")])
        return status
    built = cond(BUILT, True, "ArtifactAvailable", f"{obs.artifact_uri} is published and verified")
    replicas = obs.replicas
    if obs.replica_status is not None:  # scale out: current vs desired, and who decides
        status["replicas"] = obs.replica_status
        replicas = obs.replica_status["desired"] if obs.autoscaled else replicas
    if obs.prerequisite is not None:
        ready = cond(READY, False, "PrerequisiteMissing", obs.prerequisite + still)
        status.update(phase="Failed", conditions=[built, ready])
    elif obs.serving == obs.engine_version:
        ready = cond(READY, True, "Serving", f"all {replicas} replica(s) serve {obs.engine_version}")
        status.update(phase="Ready", conditions=[built, ready])
    elif replicas == 0:
        owner = (obs.replica_status or {}).get("owner", "the autoscaler")
        why = (f"scaled to zero by {owner}; a request through the KEDA HTTP add-on's interceptor starts a pod"
               if obs.autoscaled else "spec.serving.replicas is 0; nothing serves")
        ready = cond(READY, False, "ScaledToZero", why)
        status.update(phase="Ready", conditions=[built, ready])
    elif obs.unschedulable is not None:
        ready = cond(READY, False, *obs.unschedulable)
        status.update(phase="Deploying", conditions=[built, ready])
    else:
        ready = cond(READY, False, "RollingOut", f"rolling out {obs.engine_version}{still}")
        status.update(phase="Deploying", conditions=[built, ready])
    return status
