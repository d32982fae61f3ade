"""Rollouts that fit the GPUs a cluster has: the Deployment strategy, and why a new pod cannot be placed.

``spec.serving.rolloutStrategy``:

- ``Surge`` (default): maxSurge 1, maxUnavailable 0. A new pod starts beside the old ones, which serve until
  it is Ready. Needs one pod's worth of spare GPUs (``tensorParallel x pipelineParallel`` of the SKU, at most
  ``gpusPerNode``) for the length of the rollout; on a cluster without them the new pod stays Pending forever
  and the rollout never moves.
- ``RecreateOneAtATime``: maxSurge 0, maxUnavailable 1. An old pod is stopped first and its GPUs go to its
  replacement, one pod at a time. No spare GPU is needed; capacity drops by one pod during each step, and
  with one replica the engine does not serve between the old pod's stop and the new pod's readiness (with
  KEDA's HTTP add-on in front, requests wait in the interceptor instead of failing).

When a new-version pod is Pending with ``PodScheduled=False, reason=Unschedulable``, :func:`unschedulable`
turns the scheduler's message into the engine's condition: ``InsufficientGPU`` (naming the SKU and the GPUs
one pod wants) when the scheduler ran out of ``nvidia.com/gpu``, ``Unschedulable`` otherwise.
"""

from __future__ import annotations

from typing import Any

from kiln.operator.jobs import pod_gpus
from kiln.operator.naming import LABEL_VERSION, selector_labels, version_label
from kiln.operator.settings import OperatorConfig

from kiln.api import LLMEngineSpec

GPU_RESOURCE = "nvidia.com/gpu"
INSUFFICIENT_GPU, UNSCHEDULABLE = "InsufficientGPU", "Unschedulable"


def rollout_strategy(spec: LLMEngineSpec) -> dict[str, Any]:
    if spec.serving.rollout_strategy == "RecreateOneAtATime":
        return {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}}
    return {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}


def new_pods_selector(name: str, version: str) -> str:
    """Label selector of the engine's pods that run ``version``."""
    return ",".join(f"{k}={v}" for k, v in {**selector_labels(name), LABEL_VERSION: version_label(version)}.items())


def _unschedulable_message(pod: dict[str, Any]) -> str | None:
    status = pod.get("status") or {}
    if status.get("phase") not in (None, "Pending") or (pod.get("metadata") or {}).get("deletionTimestamp"):
        return None
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" \
                and cond.get("reason") == "Unschedulable":
            return cond.get("message") or "no node fits"
    return None


def unschedulable(pods: list[dict[str, Any]], spec: LLMEngineSpec, version: str, config: OperatorConfig,
                  serving: str | None) -> tuple[str, str] | None:
    """(reason, message) when pods of ``version`` cannot be scheduled; None when all are placed (or none exist)."""
    stuck = sorted((p["metadata"]["name"], msg) for p in pods if (msg := _unschedulable_message(p)) is not None)
    if not stuck:
        return None
    gpu = spec.gpu_spec
    names = ", ".join(n for n, _ in stuck[:3]) + (f" and {len(stuck) - 3} more" if len(stuck) > 3 else "")
    said = stuck[0][1]
    keeps = f"; {serving} keeps serving" if serving and serving != version else ""
    if not gpu.is_cpu and f"Insufficient {GPU_RESOURCE}" in said:
        gpus = pod_gpus(spec)  # what each pod requests: tensorParallel x pipelineParallel, at most gpusPerNode
        selector = ", ".join(f"{k}={v}" for k, v in (config.node_selector(spec.gpu) or {}).items()) or "any node"
        fix = ("free or add GPUs of that SKU, or set spec.serving.rolloutStrategy: RecreateOneAtATime to replace "
               "pods in place without a spare GPU" if spec.serving.rollout_strategy == "Surge" and keeps
               else "free or add GPUs of that SKU, or lower spec.serving replicas/autoscaling.maxReplicas")
        return INSUFFICIENT_GPU, (
            f"pod(s) {names} of {version} cannot be scheduled: each needs {gpus} {spec.gpu} GPU(s) "
            f"({GPU_RESOURCE}: {gpus} on nodes with {selector}) and no node has them free; "
            f"the scheduler says: {said}{keeps}; {fix}")
    return UNSCHEDULABLE, (f"pod(s) {names} of {version} cannot be scheduled: {said}{keeps}; "
                           "check the pods' events (kubectl describe pod) for what no node offers")
