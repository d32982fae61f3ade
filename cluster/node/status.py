"""A pod's status from its containers, as the kubelet reports it: phase, conditions, container states.
Pure functions of what the worker knows; the worker sends the result as one merge patch."""

from __future__ import annotations

from kiln_cluster.node.containers import Container, now_rfc3339

IMAGE_ID = "kiln-local://checkout"  # every kiln image is the checkout's installed kiln


def phase(policy: str, init: list[Container], main: list[Container], sandbox_ready: bool) -> str:
    """Pending until the init containers are done and a main one started; Succeeded/Failed once every main
    container has ended and none will be restarted (restartPolicy); else Running."""
    if not sandbox_ready:
        return "Pending"
    for c in init:
        term = c.terminated
        if term is None or term["exitCode"] != 0:
            failed = term is not None and not c.should_restart(policy)
            return "Failed" if failed else "Pending"
    if not any(c.proc is not None or c.restarts for c in main):
        return "Pending"
    ended = [c.terminated for c in main]
    if all(ended) and not any(c.should_restart(policy) for c in main):
        return "Succeeded" if all(t["exitCode"] == 0 for t in ended) else "Failed"
    return "Running"


def _condition(kind: str, ok: bool, previous: dict[str, dict], reason: str = "") -> dict:
    status = "True" if ok else "False"
    old = previous.get(kind)
    since = old["lastTransitionTime"] if old and old.get("status") == status else now_rfc3339()
    cond = {"type": kind, "status": status, "lastTransitionTime": since, "lastProbeTime": None}
    if reason and not ok:
        cond["reason"] = reason
    return cond


def conditions(seen: list[dict], pod_phase: str, init: list[Container], main: list[Container],
               sandbox_ready: bool) -> list[dict]:
    """The pod's conditions; ``seen`` (the last ones reported) keeps each one's lastTransitionTime."""
    previous = {c["type"]: c for c in seen}
    done = pod_phase in ("Succeeded", "Failed")
    initialized = all(c.terminated and c.terminated["exitCode"] == 0 for c in init)
    ready = not done and bool(main) and all(c.ready for c in main)
    why = "PodCompleted" if done else "ContainersNotReady"
    out = [_condition("PodReadyToStartContainers", sandbox_ready, previous),
           _condition("Initialized", initialized, previous, "ContainersNotInitialized"),
           _condition("ContainersReady", ready, previous, why),
           _condition("Ready", ready, previous, why)]
    if "PodScheduled" in previous:
        out.append(previous["PodScheduled"])
    return out


def pod_status(seen: list[dict], *, ip: str | None, host_ip: str, policy: str, init: list[Container],
               main: list[Container], sandbox_ready: bool, start_time: str, message: str = "") -> dict:
    p = phase(policy, init, main, sandbox_ready)
    status = {"phase": p, "conditions": conditions(seen, p, init, main, sandbox_ready),
              "hostIP": host_ip, "hostIPs": [{"ip": host_ip}], "startTime": start_time,
              "initContainerStatuses": [c.status(IMAGE_ID) for c in init] or None,
              "containerStatuses": [c.status(IMAGE_ID) for c in main], "message": message or None}
    if ip:
        status |= {"podIP": ip, "podIPs": [{"ip": ip}]}
    return status
