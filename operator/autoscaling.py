"""Autoscaling objects: pure functions of (spec, names, config) -> KEDA ScaledObject / HTTPScaledObject or HPA v2.

Why these shapes (docs/scale-out.md has the whole story):

- The scaler follows the engine's queue, not CPU: ``kiln:num_requests_waiting`` (requests admitted but not
  yet running) per pod, aimed at ``targetWaitingRequests``. Queue depth alone would remove busy pods the
  moment nothing waits, so a second metric, ``kiln:num_requests_running`` per pod aimed at
  ``maxBatchSize``, keeps as many pods as the running requests fill; the HPA (and KEDA, which drives one)
  takes the larger of the two recommendations.
- KEDA (chart value ``autoscaling.engine: keda``, the default) reads both from Prometheus. With
  ``minReplicas: 0`` no pod exports anything at zero, so nothing could wake the engine and a request would
  fail: the KEDA HTTP add-on's interceptor holds it instead. kiln renders an ``HTTPScaledObject`` with
  ``httpscaledobject.keda.sh/skip-scaledobject-creation`` (the add-on then creates no ScaledObject of its
  own, which would fight ours for the Deployment) and adds the add-on's ``external-push`` trigger to its own
  ScaledObject: the interceptor's pending requests activate 0 -> 1, the queue metrics scale 1 -> N.
- The HPA (``autoscaling.engine: hpa``) reads the same two series as Pods metrics from a metrics adapter
  (prometheus-adapter renames ``kiln:x`` to ``kiln_x``; the prefix is chart value
  ``autoscaling.hpa.metricPrefix``). The HPA cannot scale to zero without an alpha feature gate, so
  ``minReplicas: 0`` is refused on such an operator (:func:`autoscaling_problem`).
- The operator writes the Deployment's ``replicas`` only on create (:func:`initial_replicas`); afterwards the
  scaler owns it (:data:`REPLICAS_OWNER`, honoured by :func:`kiln.operator.apply.apply`).
"""

from __future__ import annotations

from typing import Any

from kiln.operator.naming import (
    LWS_API_VERSION,
    LWS_KIND,
    lws_name,
    object_meta,
    service_name,
    serving_labels,
)
from kiln.operator.settings import OperatorConfig

from kiln.api import LLMEngineSpec
from kiln.serving_options import AutoscalingOptions

KEDA_API = "keda.sh/v1alpha1"
KEDA_HTTP_API = "http.keda.sh/v1alpha1"
HPA_API = "autoscaling/v2"
SKIP_SCALEDOBJECT = "httpscaledobject.keda.sh/skip-scaledobject-creation"
# On the Deployment: who owns spec.replicas ("autoscaler": the operator sets it on create only).
REPLICAS_OWNER = "serving.kiln.dev/replicas-owner"
POLLING_SECONDS = 15
RESPONSE_HEADER_TIMEOUT = "600s"  # a non-streaming completion sends headers only when done


def autoscaled(spec: LLMEngineSpec) -> bool:
    return spec.serving.autoscaling is not None


def initial_replicas(spec: LLMEngineSpec) -> int:
    """``replicas`` of a new Deployment. Autoscaled: at least one pod even when minReplicas is 0, so the first
    rollout proves the engine serves before the scaler may take it to zero."""
    scaling = spec.serving.autoscaling
    return spec.serving.replicas if scaling is None else max(scaling.min_replicas, 1)


def floor_replicas(spec: LLMEngineSpec) -> int:
    """The fewest pods the engine is meant to have (what a PodDisruptionBudget can count on)."""
    scaling = spec.serving.autoscaling
    return spec.serving.replicas if scaling is None else scaling.min_replicas


def autoscaling_problem(spec: LLMEngineSpec, config: OperatorConfig) -> str | None:
    """A spec this operator's autoscaler cannot run (depends on the chart, so not a CRD rule)."""
    return zero_problem(spec.serving.autoscaling, "spec.serving.autoscaling", config)


def zero_problem(scaling: AutoscalingOptions | None, field: str, config: OperatorConfig) -> str | None:
    """``minReplicas: 0`` of an engine's or a pool's ``field`` on an operator that renders HPAs (which cannot
    scale to zero), else None."""
    if scaling is not None and scaling.min_replicas == 0 and config.autoscaler == "hpa":
        return (f"{field}.minReplicas: 0 needs KEDA and its HTTP add-on, but this operator renders "
                "HorizontalPodAutoscalers (chart value autoscaling.engine: hpa), which cannot scale to zero; "
                "set minReplicas to 1 or more, or ask the operator's admin for autoscaling.engine: keda")
    return None


def per_pod_targets(spec: LLMEngineSpec) -> dict[str, int]:
    """What one pod is meant to carry, per queue metric (kiln's name without ``kiln:``): the one rule
    the KEDA triggers and the HPA's metrics both scale on."""
    assert spec.serving.autoscaling is not None
    return {"num_requests_waiting": spec.serving.autoscaling.target_waiting_requests,
            "num_requests_running": spec.max_batch_size}


QUEUE_METRICS = ("num_requests_waiting", "num_requests_running")  # the keys of per_pod_targets


def queue_queries(name: str, namespace: str) -> dict[str, str]:
    """PromQL of the two per-engine sums (``model_name`` is the served model name, which is the engine's name)."""
    match = f'namespace="{namespace}",model_name="{name}"'
    return {f"kiln:{metric}": f"sum(kiln:{metric}{{{match}}})" for metric in QUEUE_METRICS}


def _target(spec: LLMEngineSpec, name: str) -> dict[str, Any]:
    """What the scaler scales: the Deployment, or the LeaderWorkerSet of a multi-node engine (one replica
    is one group; LWS has the scale subresource)."""
    if spec.replica_shape.pods > 1:
        return {"apiVersion": LWS_API_VERSION, "kind": LWS_KIND, "name": lws_name(name)}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}


def scaled_object(spec: LLMEngineSpec, name: str, namespace: str, config: OperatorConfig,
                  owner: dict[str, Any] | None = None) -> dict[str, Any]:
    scaling = spec.serving.autoscaling
    assert scaling is not None
    queries = queue_queries(name, namespace)
    thresholds = per_pod_targets(spec)
    triggers: list[dict[str, Any]] = [
        {"type": "prometheus", "name": metric.split(":", 1)[1].replace("_", "-"), "metricType": "AverageValue",
         "metadata": {"serverAddress": config.prometheus_address, "query": query,
                      "threshold": str(thresholds[metric.removeprefix("kiln:")]), "activationThreshold": "0",
                      "ignoreNullValues": "true"}}
        for metric, query in queries.items()]
    if scaling.min_replicas == 0:  # the interceptor's held requests wake the engine from zero
        triggers.append(held_requests_trigger(name, config))
    stabilization = scaling.scale_down_stabilization_seconds
    return {
        "apiVersion": KEDA_API,
        "kind": "ScaledObject",
        "metadata": object_meta(name, namespace, serving_labels(name), owner),
        "spec": {
            "scaleTargetRef": _target(spec, name),
            "minReplicaCount": scaling.min_replicas,
            "maxReplicaCount": scaling.max_replicas,
            "pollingInterval": POLLING_SECONDS,
            "cooldownPeriod": stabilization,  # idle time before 1 -> 0
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(stabilization)}},
            "triggers": triggers,
        },
    }


def http_scaled_object(spec: LLMEngineSpec, name: str, namespace: str, config: OperatorConfig,
                       owner: dict[str, Any] | None = None) -> dict[str, Any]:
    """The KEDA HTTP add-on's routing entry: the interceptor holds requests for these hosts until a pod is Ready
    (up to the operator's startup timeout), then forwards them to the engine's Service."""
    scaling = spec.serving.autoscaling
    assert scaling is not None
    return held_requests(name, namespace, serving_labels(name), _target(spec, name), service_name(name),
                         spec.serving.port, scaling, spec.max_batch_size, config, owner)


def held_requests(name: str, namespace: str, labels: dict[str, str], target: dict[str, Any], svc: str, port: int,
                  scaling: AutoscalingOptions, concurrency: int, config: OperatorConfig,
                  owner: dict[str, Any] | None = None) -> dict[str, Any]:
    """The HTTPScaledObject ``name`` of an engine or a pool: requests for the Service ``svc``'s hosts wait in the
    interceptor until a pod of ``target`` is Ready; ``concurrency`` is what one pod is meant to run at once."""
    return {
        "apiVersion": KEDA_HTTP_API,
        "kind": "HTTPScaledObject",
        "metadata": object_meta(name, namespace, labels, owner, {SKIP_SCALEDOBJECT: "true"}),
        "spec": {
            "hosts": [f"{svc}.{namespace}.svc.cluster.local", f"{svc}.{namespace}.svc", f"{svc}.{namespace}"],
            "scaleTargetRef": {**target, "service": svc, "port": port},
            "replicas": {"min": scaling.min_replicas, "max": scaling.max_replicas},
            "scalingMetric": {"concurrency": {"targetValue": concurrency}},
            "scaledownPeriod": scaling.scale_down_stabilization_seconds,
            "timeouts": {"conditionWait": f"{config.startup_timeout_seconds}s",
                         "responseHeader": RESPONSE_HEADER_TIMEOUT},
        },
    }


def held_requests_trigger(name: str, config: OperatorConfig) -> dict[str, Any]:
    """The ScaledObject's trigger on the interceptor's held requests for the HTTPScaledObject ``name``: they
    wake the workload from zero."""
    return {"type": "external-push", "name": "held-requests", "metadata": {
        "scalerAddress": config.keda_http_scaler_address, "httpScaledObject": name}}


def horizontal_pod_autoscaler(spec: LLMEngineSpec, name: str, namespace: str, config: OperatorConfig,
                              owner: dict[str, Any] | None = None) -> dict[str, Any]:
    scaling = spec.serving.autoscaling
    assert scaling is not None

    def pods_metric(metric: str, per_pod: int) -> dict[str, Any]:
        return {"type": "Pods", "pods": {"metric": {"name": config.hpa_metric_prefix + metric},
                                         "target": {"type": "AverageValue", "averageValue": str(per_pod)}}}

    return {
        "apiVersion": HPA_API,
        "kind": "HorizontalPodAutoscaler",
        "metadata": object_meta(name, namespace, serving_labels(name), owner),
        "spec": {
            "scaleTargetRef": _target(spec, name),
            "minReplicas": max(scaling.min_replicas, 1),
            "maxReplicas": scaling.max_replicas,
            "metrics": [pods_metric(metric, per_pod) for metric, per_pod in per_pod_targets(spec).items()],
            "behavior": _behavior(scaling.scale_down_stabilization_seconds),
        },
    }


def _behavior(stabilization: int) -> dict[str, Any]:
    """Scale up at once (a queue is waiting), down slowly: at most one pod a minute, after the window."""
    return {
        "scaleUp": {"stabilizationWindowSeconds": 0, "selectPolicy": "Max",
                    "policies": [{"type": "Pods", "value": 4, "periodSeconds": 15},
                                 {"type": "Percent", "value": 100, "periodSeconds": 15}]},
        "scaleDown": {"stabilizationWindowSeconds": stabilization, "selectPolicy": "Min",
                      "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]},
    }


def autoscaling_objects(spec: LLMEngineSpec, name: str, namespace: str, config: OperatorConfig,
                        owner: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """What ``spec.serving.autoscaling`` asks for on this operator (nothing when it is unset)."""
    scaling = spec.serving.autoscaling
    if scaling is None:
        return []
    if config.autoscaler == "hpa":
        return [horizontal_pod_autoscaler(spec, name, namespace, config, owner)]
    objects = [scaled_object(spec, name, namespace, config, owner)]
    if scaling.min_replicas == 0:
        objects.append(http_scaled_object(spec, name, namespace, config, owner))
    return objects
