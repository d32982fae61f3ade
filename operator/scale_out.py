"""Scale out, as the operator applies it: the autoscaler and routing objects of one engine, kept converged.

:func:`extra_objects` is the pure entry point (``kiln render`` prints it beside the Deployment and Service);
:func:`converge` is what a reconcile runs: create or patch the objects the spec wants, delete the kinds it
no longer wants (an engine that drops ``autoscaling`` gives the replica count back to the operator; one
that drops ``routing.inferencePool`` loses its pool), and report a missing prerequisite (the API server has
no such resource: KEDA, its HTTP add-on or the Inference Extension CRDs are not installed) as one message
naming the field and the fix instead of an error loop.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from kiln.operator.autoscaling import (
    HPA_API,
    KEDA_API,
    KEDA_HTTP_API,
    autoscaling_objects,
)
from kiln.operator.kube import ApiError, KubeClient, api_path
from kiln.operator.routing import INFERENCE_API, inference_pool
from kiln.operator.settings import OperatorConfig

from kiln.api import LLMEngineSpec

# kind -> (apiVersion, plural, the spec field that asks for it, what to install when the cluster lacks it)
KINDS: dict[str, tuple[str, str, str, str]] = {
    "ScaledObject": (KEDA_API, "scaledobjects", "spec.serving.autoscaling",
                     "install KEDA (https://keda.sh/docs/latest/deploy/)"),
    "HTTPScaledObject": (KEDA_HTTP_API, "httpscaledobjects", "spec.serving.autoscaling.minReplicas: 0",
                         "install the KEDA HTTP add-on (https://github.com/kedacore/http-add-on), or set "
                         "minReplicas to 1 or more"),
    "HorizontalPodAutoscaler": (HPA_API, "horizontalpodautoscalers", "spec.serving.autoscaling",
                                "use a cluster that serves autoscaling/v2 (Kubernetes 1.23+)"),
    "InferencePool": (INFERENCE_API, "inferencepools", "spec.serving.routing.inferencePool",
                      "install the Gateway API Inference Extension CRDs (https://gateway-api-inference-extension."
                      "sigs.k8s.io/), or set spec.serving.routing.inferencePool: false"),
}
PLURALS = {kind: plural for kind, (_, plural, _, _) in KINDS.items()}
Apply = Callable[[KubeClient, dict[str, Any]], Awaitable[dict[str, Any]]]


def extra_objects(spec: LLMEngineSpec, name: str, namespace: str, version: str | None, config: OperatorConfig,
                  owner: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The ScaledObject/HTTPScaledObject or HPA, and the InferencePool, this engine asks for (in apply order).

    ``version`` is accepted so ``kiln render`` can call every renderer alike; none of these objects changes
    with the engine version (they select pods by engine, not version, and survive rollouts)."""
    del version
    objects = autoscaling_objects(spec, name, namespace, config, owner)
    if (pool := inference_pool(spec, name, namespace, owner)) is not None:
        objects.append(pool)
    return objects


def missing_prerequisite(kind: str, namespace: str, field: str | None = None, fix: str | None = None) -> str:
    """Why ``kind`` could not be applied: the field that asks for it and the fix (an engine's, unless a pool's are
    given)."""
    api_version, plural, engine_field, engine_fix = KINDS[kind]
    return (f"{field or engine_field} needs {kind} ({api_version}), which this cluster does not serve "
            f"(no {plural} in namespace {namespace}); {fix or engine_fix}")


async def converge(kube: KubeClient, apply: Apply, spec: LLMEngineSpec, name: str, namespace: str,
                   config: OperatorConfig, owner: dict[str, Any] | None) -> tuple[list[dict[str, Any]], str | None]:
    """Apply the wanted objects and delete the unwanted kinds. Returns (the live objects, a missing-prerequisite
    message or None). A 404 on create means the resource type does not exist; a 404 on delete is fine."""
    wanted = extra_objects(spec, name, namespace, None, config, owner)
    live: list[dict[str, Any]] = []
    problems: list[str] = []
    for obj in wanted:
        try:
            live.append(await apply(kube, obj))
        except ApiError as exc:
            if exc.status != 404:
                raise
            problems.append(missing_prerequisite(obj["kind"], namespace))
    wanted_kinds = {obj["kind"] for obj in wanted}
    for kind, (api_version, plural, _, _) in KINDS.items():
        if kind in wanted_kinds or not _could_exist(kind, config):
            continue
        await kube.delete(api_path(api_version, plural, namespace, name))
    return live, "; ".join(problems) or None


def _could_exist(kind: str, config: OperatorConfig) -> bool:
    """Only the kinds this operator renders are cleaned up (no calls for an API it never uses)."""
    if kind in ("ScaledObject", "HTTPScaledObject"):
        return config.autoscaler == "keda"
    if kind == "HorizontalPodAutoscaler":
        return config.autoscaler == "hpa"
    return True


def replica_status(deployment: dict[str, Any] | None, autoscaled: bool, autoscaler: str | None) -> dict[str, Any]:
    """``status.replicas``: what the owner of the count wants (the Deployment's spec.replicas, which the
    autoscaler writes when there is one) against what runs."""
    spec = (deployment or {}).get("spec") or {}
    status = (deployment or {}).get("status") or {}
    return {"desired": spec.get("replicas", 1) if deployment else 0, "current": status.get("replicas") or 0,
            "ready": status.get("readyReplicas") or 0, "updated": status.get("updatedReplicas") or 0,
            "owner": autoscaler if autoscaled else "operator"}
