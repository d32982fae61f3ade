"""An engine pool's objects: pure functions of (pool spec, name, namespace, config[, engines]) -> the ConfigMap of
its engine list, its Deployment and its Service (docs/pools.md).

- ConfigMap ``<pool>-pool-engines``, key ``engines.json``: :func:`kiln.engine_list.document` of the listed members
  (name, artifact URI, the content digest the engine pinned); key ``adapters.json``: their pinned LoRA adapters
  (:mod:`kiln.adapter_list`, ``$KILN_LORA_ADAPTERS_FILE`` of the pods). The pods mount it as a directory (not a
  subPath), so the kubelet refreshes both files and ``kiln serve --engines-file`` follows them: an engine or an
  adapter joins or leaves without a restart. Nothing of either list is in the pod template, so a change never
  rolls the pods.
- Deployment ``<pool>-pool``: ``spec.replicas`` pods of ``kiln serve --engines-file`` plus the pool's settings
  (:func:`kiln.pool_api.serve_flags`), built from the same pieces as an engine's serving pod
  (:mod:`kiln.operator.workloads`: container, probes, preStop and drain, security contexts, the store's read
  credentials, the ``kiln-verify-key`` Secret every member's manifest must be signed by).
- Service ``<pool>-pool``: the pool's port; status.endpoint is its OpenAI base URL.
- With ``spec.autoscaling``: a KEDA ScaledObject or an HPA ``<pool>-pool`` (the operator's autoscaler) scaling the
  Deployment on the pool's queue (:func:`build_pool_scaler`); the Deployment's ``replicas`` is then set on create
  only. With ``minReplicas: 0`` (KEDA only) also the HTTP add-on's HTTPScaledObject ``<pool>-pool``, whose
  interceptor holds requests for the pool's Service while the pool is at zero and wakes it
  (:func:`build_pool_held_requests`), as an engine's (docs/scale-out.md).
- With ``spec.routing.inferencePool``: an InferencePool ``<pool>-pool`` over the pods
  (:func:`build_pool_inference_pool`).

A pool pod on a GPU SKU holds ``spec.resources.limits["nvidia.com/gpu"]`` GPUs (default 1); a member engine
needing more per pod is refused (:mod:`kiln.operator.pool_decide`).
"""

from __future__ import annotations

import json
from typing import Any

from kiln.operator.adapters import ADAPTERS_FILE_KEY
from kiln.operator.autoscaling import (
    HPA_API,
    KEDA_API,
    POLLING_SECONDS,
    REPLICAS_OWNER,
    _behavior,
    held_requests,
    held_requests_trigger,
    zero_problem,
)
from kiln.operator.jobs import shm_volumes, sku_placement
from kiln.operator.keys import verify_key_mount, verify_key_volume
from kiln.operator.naming import (
    object_meta,
    picker_name,
    pool_engines_name,
    pool_labels,
    pool_selector_labels,
    pool_workload_name,
)
from kiln.operator.network import network_policy, serving_port_only
from kiln.operator.routing import build_inference_pool
from kiln.operator.scheduling import GPU_RESOURCE
from kiln.operator.settings import OperatorConfig
from kiln.operator.trust import image_problem
from kiln.operator.validation import InvalidSpec, quantity_problem
from kiln.operator.workloads import (
    API_KEY_DIR,
    API_KEY_FILE,
    api_key_secret_volume,
    grace_seconds,
    server_container,
    server_env,
    server_mounts,
    server_pod_spec,
    server_volumes,
)
from pydantic import ValidationError

from kiln import adapter_list
from kiln.adapter_list import ADAPTERS_FILE_ENV
from kiln.api import LLMEngineSpec
from kiln.engine_list import EngineEntry, document
from kiln.manifest import validation_error_lines
from kiln.pool_api import LLMEnginePool, LLMEnginePoolSpec, pool_name_problem, serve_flags
from kiln.skus import GPU_SKUS

ENGINES_DIR = "/etc/kiln/pool"
ENGINES_KEY = "engines.json"
ENGINES_FILE = f"{ENGINES_DIR}/{ENGINES_KEY}"
ADAPTERS_FILE = f"{ENGINES_DIR}/{ADAPTERS_FILE_KEY}"  # the members' adapters, beside the engine list
DEFAULT_BATCH = LLMEngineSpec.model_fields["max_batch_size"].default  # a pod's concurrency with no member listed


def validate_pool(name: str, raw: dict[str, Any], config: OperatorConfig) -> LLMEnginePoolSpec:
    """The pool's spec, or :class:`InvalidSpec` naming the field and the fix (what the CRD schema cannot say, or
    an API server without it let through)."""
    if problem := pool_name_problem(name):
        raise InvalidSpec(problem)
    try:
        spec = LLMEnginePoolSpec.model_validate(raw)
    except ValidationError as exc:
        raise InvalidSpec("; ".join(f"spec.{line}" for line in validation_error_lines(exc, LLMEnginePoolSpec))) \
            from None
    try:
        spec.memory_limit_bytes  # noqa: B018 - parsed here, so a bad quantity is the pool's Failed, not a traceback
    except ValueError as exc:
        raise InvalidSpec(f"spec.{exc}") from None
    if spec.engines is not None:
        raise InvalidSpec("spec.engines: lists manifests for kiln up only; in a cluster an LLMEngine joins the pool "
                          f"with spec.serving.pool: {name}; remove spec.engines")
    if problem := image_problem("spec.image", spec.image, config) or quantity_problem("spec.resources",
                                                                                      spec.resources or {}):
        raise InvalidSpec(problem)
    if problem := zero_problem(spec.autoscaling, "spec.autoscaling", config):
        raise InvalidSpec(problem)
    if config.node_selector(spec.gpu) is None:
        known = ", ".join(sorted(config.sku_node_labels))
        raise InvalidSpec(f"spec.gpu: {spec.gpu} has no node label in this operator's SKU map ({known}); add it to "
                          "the chart value gpuNodeLabels (KILN_SKU_NODE_LABELS) or pick a listed SKU")
    given = ((spec.resources or {}).get("limits") or {}).get(GPU_RESOURCE)
    if given is not None and (GPU_SKUS[spec.gpu].is_cpu or not str(given).isdigit() or int(str(given)) < 1):
        raise InvalidSpec(f"spec.resources.limits: {GPU_RESOURCE} is {given!r}; on spec.gpu {spec.gpu} give a whole "
                          "number of GPUs of at least 1 for a GPU SKU, or remove it (cpu pools hold none)")
    return spec


def pool_gpus(spec: LLMEnginePoolSpec) -> int:
    """GPUs of one pool pod: none on a CPU SKU, else ``resources.limits["nvidia.com/gpu"]`` (default 1)."""
    if GPU_SKUS[spec.gpu].is_cpu:
        return 0
    return int(str(((spec.resources or {}).get("limits") or {}).get(GPU_RESOURCE, 1)))


def pool_endpoint(pool: str, namespace: str, spec: LLMEnginePoolSpec) -> str:
    return f"http://{pool_workload_name(pool)}.{namespace}.svc:{spec.port}/v1"


def _resources(spec: LLMEnginePoolSpec, config: OperatorConfig) -> dict[str, Any]:
    out = json.loads(json.dumps(spec.resources or config.serving_resources))
    if gpus := pool_gpus(spec):
        out.setdefault("limits", {})[GPU_RESOURCE] = gpus
    return out


def _placement(spec: LLMEnginePoolSpec, config: OperatorConfig) -> dict[str, Any]:
    placement = sku_placement(spec.gpu, config)
    if spec.node_selector:
        placement["nodeSelector"] = {**placement.get("nodeSelector", {}), **spec.node_selector}
    return placement


def pool_container(spec: LLMEnginePoolSpec, pool: str, config: OperatorConfig) -> dict[str, Any]:
    key_mount, key_env = verify_key_mount()  # every member's manifest must be signed by the operator's key
    env = [*server_env(pool, spec.max_queue_len, spec.drain_timeout_seconds), key_env,
           {"name": ADAPTERS_FILE_ENV, "value": ADAPTERS_FILE}]
    args = ["--engines-file", ENGINES_FILE, "--host", "0.0.0.0", "--port", str(spec.port), *serve_flags(spec)]
    mounts = [*server_mounts(), key_mount, {"name": "engines", "mountPath": ENGINES_DIR, "readOnly": True}]
    if spec.api_key_secret:  # a read-only file, as an engine's key (workloads.serving_container)
        mounts.append({"name": "api-key", "mountPath": API_KEY_DIR, "readOnly": True})
        args += ["--api-key-file", API_KEY_FILE]
    if pool_gpus(spec) > 1:
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    return server_container(spec.image or config.serving_image, spec.port, args, env, mounts,
                            _resources(spec, config), config)


def build_pool_deployment(spec: LLMEnginePoolSpec, pool: str, namespace: str, config: OperatorConfig,
                          owner: dict[str, Any] | None = None) -> dict[str, Any]:
    """The pool's pods. Their template carries nothing of the engine list (a member joining never rolls them)."""
    labels = pool_labels(pool)
    scaled = {REPLICAS_OWNER: "autoscaler"} if spec.autoscaling is not None else None  # apply: replicas on create
    volumes = [*server_volumes(), *shm_volumes(pool_gpus(spec)), verify_key_volume(),
               {"name": "engines", "configMap": {"name": pool_engines_name(pool)}},
               *api_key_secret_volume(spec.api_key_secret)]
    pod_spec = server_pod_spec(config, pool_container(spec, pool, config),
                               grace_seconds(spec.drain_timeout_seconds, config), volumes, _placement(spec, config))
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(pool_workload_name(pool), namespace, labels, owner, scaled),
        "spec": {
            # autoscaled: at least one pod on create, so the first rollout proves the pool serves (as an engine's)
            "replicas": spec.replicas if spec.autoscaling is None else max(spec.autoscaling.min_replicas, 1),
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": config.startup_timeout_seconds + 120,
            "selector": {"matchLabels": pool_selector_labels(pool)},
            # A new pod is Ready before an old one goes (as an engine's default Surge rollout).
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": labels, "annotations": {
                    "prometheus.io/scrape": "true", "prometheus.io/port": str(spec.port),
                    "prometheus.io/path": "/metrics"}},
                "spec": pod_spec,
            },
        },
    }


def build_pool_service(spec: LLMEnginePoolSpec, pool: str, namespace: str,
                       owner: dict[str, Any] | None = None) -> dict[str, Any]:
    """One Service answers every member's model name: the pods route by ``model``."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(pool_workload_name(pool), namespace, pool_labels(pool), owner),
        "spec": {
            "type": "ClusterIP",
            "selector": pool_selector_labels(pool),
            "ports": [{"name": "http", "port": spec.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def build_pool_pdb(spec: LLMEnginePoolSpec, pool: str, namespace: str,
                   owner: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """maxUnavailable 1 over the pool's pods from 2 pods up (``spec.replicas``, or autoscaled ``minReplicas``): a
    node drain takes them one at a time; none for fewer, which could never be evicted (the drain would hang), as an
    engine's (``workloads.build_pdb``)."""
    floor = spec.autoscaling.min_replicas if spec.autoscaling is not None else spec.replicas
    if floor < 2:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(pool_workload_name(pool), namespace, pool_labels(pool), owner),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": pool_selector_labels(pool)}},
    }


def build_pool_network_policy(spec: LLMEnginePoolSpec, pool: str, namespace: str,
                              owner: dict[str, Any] | None = None) -> dict[str, Any]:
    """The pool's pods admit their serving port alone (the OpenAI API, ``/metrics``, the probes), from anywhere:
    a pool's engines run in one pod each, so there are no rank ports to open (``network.build_network_policy``)."""
    return network_policy(object_meta(pool_workload_name(pool), namespace, pool_labels(pool), owner),
                          pool_selector_labels(pool), serving_port_only(spec.port))


def build_pool_inference_pool(spec: LLMEnginePoolSpec, pool: str, namespace: str,
                              owner: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """``spec.routing.inferencePool``: an InferencePool ``<pool>-pool`` over the pool's pods (None when off), scored
    by the picker Service ``spec.routing.endpointPicker`` (default ``<pool>-pool-epp``, hashed under 63 characters).
    A pool pod reports itself to the picker as one model server whose loaded engines are its active models
    (``kiln.serving.pool.metrics``)."""
    if not spec.routing.inference_pool:
        return None
    name = pool_workload_name(pool)
    return build_inference_pool(spec.routing, name, namespace, pool_labels(pool), pool_selector_labels(pool),
                                spec.port, picker_name(spec.routing, name), owner)


def pool_queue_query(pool: str, namespace: str, members: list[str]) -> str:
    """PromQL of the pool's queue: ``kiln:num_requests_waiting`` under the pool's name (requests waiting for their
    engine to be placed or loaded) and under each listed engine's (docs/pools.md, Metrics)."""
    names = "|".join(sorted({pool, *members}))  # DNS labels (each names a Service): nothing to escape
    return f'sum(kiln:num_requests_waiting{{namespace="{namespace}",model_name=~"{names}"}})'


def build_pool_scaler(spec: LLMEnginePoolSpec, pool: str, namespace: str, config: OperatorConfig,
                      members: list[str], owner: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """``spec.autoscaling`` as this operator renders it (None when unset): a KEDA ScaledObject on
    :func:`pool_queue_query`, or an HPA on the Pods metric of the same series (the metrics adapter sums a pod's
    series), each aiming at ``targetWaitingRequests`` per pod. The queue alone scales them, not the engines'
    running requests (scale-down waits the stabilization window)."""
    scaling = spec.autoscaling
    if scaling is None:
        return None
    name = pool_workload_name(pool)
    common = {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}}
    behavior = _behavior(scaling.scale_down_stabilization_seconds)
    target = str(scaling.target_waiting_requests)
    meta = object_meta(name, namespace, pool_labels(pool), owner)
    if config.autoscaler == "hpa":
        metric = {"name": config.hpa_metric_prefix + "num_requests_waiting"}
        return {"apiVersion": HPA_API, "kind": "HorizontalPodAutoscaler", "metadata": meta, "spec": {
            **common, "minReplicas": scaling.min_replicas, "maxReplicas": scaling.max_replicas, "behavior": behavior,
            "metrics": [{"type": "Pods", "pods": {"metric": metric,
                                                  "target": {"type": "AverageValue", "averageValue": target}}}]}}
    triggers = [{"type": "prometheus", "name": "num-requests-waiting", "metricType": "AverageValue", "metadata": {
        "serverAddress": config.prometheus_address, "query": pool_queue_query(pool, namespace, members),
        "threshold": target, "activationThreshold": "0", "ignoreNullValues": "true"}}]
    if scaling.min_replicas == 0:  # the interceptor's held requests wake the pool from zero
        triggers.append(held_requests_trigger(name, config))
    return {"apiVersion": KEDA_API, "kind": "ScaledObject", "metadata": meta, "spec": {
        **common, "minReplicaCount": scaling.min_replicas, "maxReplicaCount": scaling.max_replicas,
        "pollingInterval": POLLING_SECONDS, "cooldownPeriod": scaling.scale_down_stabilization_seconds,
        "advanced": {"horizontalPodAutoscalerConfig": {"behavior": behavior}}, "triggers": triggers}}


def build_pool_held_requests(spec: LLMEnginePoolSpec, pool: str, namespace: str, config: OperatorConfig,
                             batches: list[int] | None = None,
                             owner: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """With ``spec.autoscaling.minReplicas: 0`` on KEDA, the HTTP add-on's HTTPScaledObject over the pool's Service
    (None otherwise): a request sent through the interceptor while the pool is at zero waits there until a pod is
    Ready. One pod is meant to run the largest listed member's ``maxBatchSize`` (``batches``) at once."""
    scaling = spec.autoscaling
    if scaling is None or scaling.min_replicas > 0 or config.autoscaler != "keda":
        return None
    name = pool_workload_name(pool)
    target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
    return held_requests(name, namespace, pool_labels(pool), target, name, spec.port, scaling,
                         max(batches or [], default=DEFAULT_BATCH), config, owner)


def build_engines_configmap(pool: str, namespace: str, entries: list[EngineEntry],
                            owner: dict[str, Any] | None = None,
                            adapters: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """The engine list the pool's pods follow (``kiln.engine_list``'s format), and beside it the adapter list
    (``kiln.adapter_list``'s: ``adapters``, the Listed members' pinned adapters, each naming its engine's version
    as its base)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(pool_engines_name(pool), namespace, pool_labels(pool), owner),
        "data": {ENGINES_KEY: json.dumps(document(entries), indent=1, sort_keys=True),
                 ADAPTERS_FILE_KEY: json.dumps(adapter_list.document(list(adapters or [])), indent=1, sort_keys=True)},
    }


def render_pool(pool_body_or_spec: Any, name: str, namespace: str, config: OperatorConfig,
                entries: list[EngineEntry] | None = None) -> list[dict[str, Any]]:
    """The objects the operator applies for a pool (``kiln render``): the engine-list ConfigMap (``entries``:
    none unless given; the operator lists the members it finds), the Deployment, the Service, from 2 pods up its
    PodDisruptionBudget, its NetworkPolicy (chart value ``networkPolicy``), with ``spec.autoscaling`` its
    ScaledObject (and at ``minReplicas: 0`` its HTTPScaledObject) or HPA, and with ``spec.routing.inferencePool``
    its InferencePool. Takes the LLMEnginePool (a dict with ``spec``, or :class:`LLMEnginePool`), its spec (dict or
    :class:`LLMEnginePoolSpec`); :class:`InvalidSpec` naming the field as the operator. No ownerReferences (the
    pool's uid is the cluster's), no ``rendered-hash`` annotation; the HTTPScaledObject's concurrency is the
    default ``maxBatchSize`` (the operator's takes the listed members')."""
    raw = pool_body_or_spec
    if isinstance(raw, LLMEnginePool):
        raw = raw.spec
    if isinstance(raw, LLMEnginePoolSpec):
        raw = raw.to_k8s()
    elif isinstance(raw, dict) and {"spec", "kind", "metadata", "apiVersion"} & raw.keys():
        raw = raw.get("spec") or {}
    spec = validate_pool(name, raw, config)
    objects = [build_engines_configmap(name, namespace, list(entries or [])),
               build_pool_deployment(spec, name, namespace, config), build_pool_service(spec, name, namespace)]
    if (pdb := build_pool_pdb(spec, name, namespace)) is not None:
        objects.append(pdb)
    if config.network_policy:
        objects.append(build_pool_network_policy(spec, name, namespace))
    if (scaler := build_pool_scaler(spec, name, namespace, config, [e.name for e in entries or []])) is not None:
        objects.append(scaler)
    if (held := build_pool_held_requests(spec, name, namespace, config)) is not None:
        objects.append(held)
    if (routing := build_pool_inference_pool(spec, name, namespace)) is not None:
        objects.append(routing)
    return [json.loads(json.dumps(obj)) for obj in objects]
