"""Serving objects: pure functions of (engine, version, config) -> Deployment, Service, PDB dicts.

The engine version appears in the pod template (a label and an annotation) and
nowhere else that changes with it, so a version change rolls the pods and a
replicas or label edit does not. The rollout keeps every old pod until a new one
is Ready (maxUnavailable 0, maxSurge 1): the old version serves until the new
one can. Shutdown order: the preStop sleep lets Endpoints drop the pod before
SIGTERM arrives; the server then drains in-flight requests for
``drainTimeoutSeconds``; the grace period covers both with a margin.
"""

from __future__ import annotations

import math
from typing import Any

from kiln.operator.autoscaling import REPLICAS_OWNER, autoscaled, floor_replicas, initial_replicas
from kiln.operator.jobs import (
    container_security_context,
    gpu_placement,
    pod_security_context,
    secret_env_from,
    shm_volume,
    with_gpus,
)
from kiln.operator.naming import (
    ANNOTATION_ARTIFACT,
    ANNOTATION_VERSION,
    LABEL_VERSION,
    selector_labels,
    service_name,
    serving_labels,
)
from kiln.operator.scheduling import rollout_strategy
from kiln.operator.settings import OperatorConfig
from kiln.operator.trust import serving_image

from kiln.api import LLMEngineSpec
from kiln.artifact_manifest import EXPECT_ENV, ArtifactExpectation

CACHE_DIR = "/var/cache/kiln"
API_KEY_DIR = "/var/run/secrets/kiln/api-key"
API_KEY_FILE = f"{API_KEY_DIR}/api-key"
API_KEY_SECRET_KEY = "KILN_API_KEY"  # the key inside spec.serving.apiKeySecret
GRACE_MARGIN_SECONDS = 15
PROBE_PERIOD_SECONDS = 10


def grace_period(spec: LLMEngineSpec, config: OperatorConfig) -> int:
    return config.prestop_sleep_seconds + spec.serving.drain_timeout_seconds + GRACE_MARGIN_SECONDS


def endpoint(name: str, namespace: str, spec: LLMEngineSpec) -> str:
    return f"http://{service_name(name)}.{namespace}.svc:{spec.serving.port}/v1"


def _probe(path: str, **extra: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, **extra}


def serving_container(spec: LLMEngineSpec, name: str, artifact_uri: str, config: OperatorConfig,
                      expect: ArtifactExpectation | None = None) -> dict[str, Any]:
    env: list[dict[str, Any]] = [
        {"name": "KILN_SERVED_MODEL_NAME", "value": name},  # clients send model=<LLMEngine name>
        {"name": "KILN_CACHE_DIR", "value": CACHE_DIR},
        {"name": "KILN_MAX_QUEUE_LEN", "value": str(spec.serving.max_queue_len)},
        {"name": "KILN_DRAIN_TIMEOUT_SECONDS", "value": str(spec.serving.drain_timeout_seconds)},
        {"name": "HOME", "value": "/tmp"},
    ]
    if expect is not None:  # the build the operator verified; the pod refuses any other artifact
        env.append({"name": EXPECT_ENV, "value": expect.to_env()})
    args = ["--artifact", artifact_uri, "--host", "0.0.0.0", "--port", str(spec.serving.port)]
    mounts = [{"name": "cache", "mountPath": CACHE_DIR}, {"name": "tmp", "mountPath": "/tmp"}]
    if spec.serving.api_key_secret:  # a read-only file, not an env var (env leaks into /proc, dumps, logs)
        mounts.append({"name": "api-key", "mountPath": API_KEY_DIR, "readOnly": True})
        args += ["--api-key-file", API_KEY_FILE]
    if spec.tensor_parallel > 1:
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    container: dict[str, Any] = {
        "name": "serve",
        "image": serving_image(spec, config),
        "imagePullPolicy": config.image_pull_policy,
        "command": ["kiln", "serve"],
        "args": args,
        "ports": [{"name": "http", "containerPort": spec.serving.port, "protocol": "TCP"}],
        "env": env,
        "resources": with_gpus(spec.serving.resources or config.serving_resources, spec),
        "readinessProbe": _probe("/ready", periodSeconds=5, failureThreshold=3),
        "livenessProbe": _probe("/health", periodSeconds=PROBE_PERIOD_SECONDS, failureThreshold=3,
                                timeoutSeconds=5),
        # Downloading and loading a large artifact takes minutes; liveness waits for this.
        "startupProbe": _probe("/health", periodSeconds=PROBE_PERIOD_SECONDS,
                               failureThreshold=math.ceil(config.startup_timeout_seconds / PROBE_PERIOD_SECONDS)),
        "lifecycle": {"preStop": {"sleep": {"seconds": config.prestop_sleep_seconds}}},
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if config.serving_secret:
        container["envFrom"] = secret_env_from(config.serving_secret)
    return container


def api_key_volume(spec: LLMEngineSpec) -> list[dict[str, Any]]:
    if not spec.serving.api_key_secret:
        return []
    # 0440 with the pod's fsGroup: readable by the server's group, by no one else.
    return [{"name": "api-key", "secret": {"secretName": spec.serving.api_key_secret, "defaultMode": 0o440,
                                            "items": [{"key": API_KEY_SECRET_KEY, "path": "api-key"}]}}]


def build_deployment(spec: LLMEngineSpec, name: str, namespace: str, version: str, artifact_uri: str,
                     config: OperatorConfig, owner: dict[str, Any] | None = None,
                     expect: ArtifactExpectation | None = None) -> dict[str, Any]:
    """``expect``: the build the operator verified (reconcile passes it; ``None`` renders no check)."""
    labels = serving_labels(name)
    pod_labels = {**labels, LABEL_VERSION: version}
    pod_spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": grace_period(spec, config),
        "securityContext": pod_security_context(),
        # The server never talks to the Kubernetes API: no token in the pod to steal.
        "automountServiceAccountToken": False,
        "containers": [serving_container(spec, name, artifact_uri, config, expect)],
        "volumes": [{"name": "cache", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}, *shm_volume(spec),
                    *api_key_volume(spec)],
        **gpu_placement(spec, config),
    }
    if config.serving_service_account:
        pod_spec["serviceAccountName"] = config.serving_service_account
    owner_of_replicas = {REPLICAS_OWNER: "autoscaler"} if autoscaled(spec) else {}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(name, namespace, labels, owner,
                          {ANNOTATION_VERSION: version, ANNOTATION_ARTIFACT: artifact_uri, **owner_of_replicas}),
        "spec": {
            "replicas": initial_replicas(spec),  # autoscaled: create only (reconcile.apply), then the scaler's
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": config.startup_timeout_seconds + 120,
            "selector": {"matchLabels": selector_labels(name)},
            "strategy": rollout_strategy(spec),
            "template": {
                "metadata": {"labels": pod_labels, "annotations": {
                    ANNOTATION_VERSION: version,
                    "prometheus.io/scrape": "true", "prometheus.io/port": str(spec.serving.port),
                    "prometheus.io/path": "/metrics"}},
                "spec": pod_spec,
            },
        },
    }


def build_service(spec: LLMEngineSpec, name: str, namespace: str,
                  owner: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(service_name(name), namespace, serving_labels(name), owner),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name),
            "ports": [{"name": "http", "port": spec.serving.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def build_pdb(spec: LLMEngineSpec, name: str, namespace: str,
              owner: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """maxUnavailable 1 from 2 replicas up; none for 0 or 1 replica, which could never be evicted
    (a node drain would hang) and cannot stay available through one anyway."""
    if floor_replicas(spec) < 2:  # autoscaled: the scaler's minReplicas
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(name, namespace, serving_labels(name), owner),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name)}},
    }


def _meta(name: str, namespace: str, labels: dict[str, str], owner: dict[str, Any] | None,
          annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(labels)}
    if annotations:
        meta["annotations"] = annotations
    if owner:
        meta["ownerReferences"] = [owner]
    return meta
