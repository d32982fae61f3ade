"""Serving objects: pure functions of (engine, version, config) -> Deployment or LeaderWorkerSet, Service, PDB.

A replica that fits one pod (:func:`kiln.skus.replica_shape`) is a Deployment; one that spans
pods is a ``leaderworkerset.x-k8s.io/v1`` LeaderWorkerSet group of ``pods`` pods (see
:func:`build_leader_worker_set` for its readiness and restart design).

The engine version appears in the pod template (a label and an annotation) and nowhere else that changes with
it, so a version change rolls the pods and a replicas or label edit does not. The rollout keeps every old pod
until a new one is Ready (maxUnavailable 0, maxSurge 1): the old version serves until the new one can. Shutdown
order: the preStop sleep lets Endpoints drop the pod before SIGTERM arrives; the server then drains in-flight
requests for ``drainTimeoutSeconds``; the grace period covers both with a margin.
"""

from __future__ import annotations

import json
import math
from typing import Any

from kiln.operator.adapters import adapters_mount, adapters_volume
from kiln.operator.autoscaling import REPLICAS_OWNER, autoscaled, floor_replicas, initial_replicas
from kiln.operator.jobs import (
    container_security_context,
    gpu_placement,
    pod_gpus,
    pod_security_context,
    secret_env_from,
    shm_volume,
    with_gpus,
)
from kiln.operator.keys import LABEL_RANK_GROUP, group_token_env, verify_key_mount, verify_key_volume
from kiln.operator.naming import (
    ANNOTATION_ARTIFACT,
    ANNOTATION_VERSION,
    LABEL_VERSION,
    LWS_API_VERSION,
    LWS_KIND,
    engine_pod_labels,
    lws_name,
    object_meta,
    selector_labels,
    service_name,
    serving_labels,
    version_label,
    worker_labels,
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
# Where rank 0 (the leader pod's process) meets the other ranks (kiln serve --leader-port / KILN_LEADER_PORT).
RENDEZVOUS_PORT = 29500


def grace_period(spec: LLMEngineSpec, config: OperatorConfig) -> int:
    return grace_seconds(spec.serving.drain_timeout_seconds, config)


def grace_seconds(drain_timeout_seconds: int, config: OperatorConfig) -> int:
    """A serving pod's termination grace: the preStop sleep, the server's drain and a margin."""
    return config.prestop_sleep_seconds + drain_timeout_seconds + GRACE_MARGIN_SECONDS


def endpoint(name: str, namespace: str, spec: LLMEngineSpec) -> str:
    return f"http://{service_name(name)}.{namespace}.svc:{spec.serving.port}/v1"


def _probe(path: str, **extra: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, **extra}


def server_env(served_name: str, max_queue_len: int, drain_timeout_seconds: int) -> list[dict[str, Any]]:
    """What every serving container's environment starts with (an engine's and an engine pool's)."""
    return [
        {"name": "KILN_SERVED_MODEL_NAME", "value": served_name},  # clients send model=<LLMEngine name>
        {"name": "KILN_CACHE_DIR", "value": CACHE_DIR},
        {"name": "KILN_MAX_QUEUE_LEN", "value": str(max_queue_len)},
        {"name": "KILN_DRAIN_TIMEOUT_SECONDS", "value": str(drain_timeout_seconds)},
        {"name": "HOME", "value": "/tmp"},
    ]


def server_mounts() -> list[dict[str, Any]]:
    """The writable cache and /tmp every serving container mounts (its root filesystem is read-only)."""
    return [{"name": "cache", "mountPath": CACHE_DIR}, {"name": "tmp", "mountPath": "/tmp"}]


def server_volumes() -> list[dict[str, Any]]:
    return [{"name": "cache", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]


def serving_container(spec: LLMEngineSpec, name: str, artifact_uri: str, config: OperatorConfig,
                      expect: ArtifactExpectation | None = None) -> dict[str, Any]:
    env = server_env(name, spec.serving.max_queue_len, spec.serving.drain_timeout_seconds)
    if expect is not None:  # the build the operator pinned; the pod refuses any other artifact
        env.append({"name": EXPECT_ENV, "value": expect.to_env()})
    key_mount, key_env = verify_key_mount()  # the public key: a manifest not signed by it is refused
    env.append(key_env)
    args = ["--artifact", artifact_uri, "--host", "0.0.0.0", "--port", str(spec.serving.port),
            *spec.serving.serve_flags()]
    mounts = [*server_mounts(), key_mount]
    if spec.serving.api_key_secret:  # a read-only file, not an env var (env leaks into /proc, dumps, logs)
        mounts.append({"name": "api-key", "mountPath": API_KEY_DIR, "readOnly": True})
        args += ["--api-key-file", API_KEY_FILE]
    if pod_gpus(spec) > 1:
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    lora_mounts, lora_env = adapters_mount(spec)  # the same whatever adapters are listed: no restart
    mounts += lora_mounts
    env += lora_env
    return server_container(serving_image(spec, config), spec.serving.port, args, env, mounts,
                            with_gpus(spec.serving.resources or config.serving_resources, spec), config)


def server_container(image: str, port: int, args: list[str], env: list[dict[str, Any]],
                     mounts: list[dict[str, Any]], resources: dict[str, Any], config: OperatorConfig) -> dict[str, Any]:
    """A ``kiln serve`` container: its port, probes, preStop, security context and the store's read credentials
    (an engine's serving pod and an engine pool's alike)."""
    container: dict[str, Any] = {
        "name": "serve",
        "image": image,
        "imagePullPolicy": config.image_pull_policy,
        "command": ["kiln", "serve"],
        "args": args,
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "env": env,
        "resources": resources,
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
    return api_key_secret_volume(spec.serving.api_key_secret)


def api_key_secret_volume(secret: str | None) -> list[dict[str, Any]]:
    """The volume of an API-key Secret (an engine's spec.serving.apiKeySecret, or a pool's spec.apiKeySecret)."""
    if not secret:
        return []
    # 0440 with the pod's fsGroup: readable by the server's group, by no one else.
    return [{"name": "api-key", "secret": {"secretName": secret, "defaultMode": 0o440,
                                            "items": [{"key": API_KEY_SECRET_KEY, "path": "api-key"}]}}]


def build_deployment(spec: LLMEngineSpec, name: str, namespace: str, version: str, artifact_uri: str,
                     config: OperatorConfig, owner: dict[str, Any] | None = None,
                     expect: ArtifactExpectation | None = None) -> dict[str, Any]:
    """``expect``: the build the operator verified (reconcile passes it; ``None`` renders no check)."""
    labels = serving_labels(name)
    pod_labels = {**labels, LABEL_VERSION: version_label(version)}
    # The server never talks to the Kubernetes API: no token in the pod to steal (_pod_spec).
    pod_spec = _pod_spec(spec, config, serving_container(spec, name, artifact_uri, config, expect), name)
    owner_of_replicas = {REPLICAS_OWNER: "autoscaler"} if autoscaled(spec) else {}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(name, namespace, labels, owner,
                          {ANNOTATION_VERSION: version, ANNOTATION_ARTIFACT: artifact_uri, **owner_of_replicas}),
        "spec": {
            "replicas": initial_replicas(spec),  # autoscaled: create only (apply.py), then the scaler's
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


def _pod_spec(spec: LLMEngineSpec, config: OperatorConfig, container: dict[str, Any], name: str) -> dict[str, Any]:
    volumes = [*server_volumes(), *shm_volume(spec), verify_key_volume(), *api_key_volume(spec),
               *adapters_volume(spec, name)]
    return server_pod_spec(config, container, grace_period(spec, config), volumes, gpu_placement(spec, config))


def server_pod_spec(config: OperatorConfig, container: dict[str, Any], grace: int, volumes: list[dict[str, Any]],
                    placement: dict[str, Any]) -> dict[str, Any]:
    """A serving pod: one ``kiln serve`` container, the pod security context, no service account token (the server
    never talks to the Kubernetes API: no token in the pod to steal), placed on its SKU's nodes."""
    pod_spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": grace,
        "securityContext": pod_security_context(),
        "automountServiceAccountToken": False,
        "containers": [container],
        "volumes": volumes,
        **placement,
    }
    if config.serving_service_account:
        pod_spec["serviceAccountName"] = config.serving_service_account
    return pod_spec


def worker_container(leader: dict[str, Any]) -> dict[str, Any]:
    """A worker pod's container: the leader's command and artifact, no HTTP.

    ``kiln serve`` reads ``LWS_WORKER_INDEX`` (set by the LWS controller): a non-zero index hosts its
    ranks and only computes. Workers have no probes, on purpose: they open no port to probe, every
    failure makes them exit (every wait on another rank is bounded; docs/multi-node.md), and an exited
    container restarts, which with ``RecreateGroupOnPodRestart`` recreates the whole group. A worker
    that hangs instead is found by the leader within the distributed timeout: the leader's ``/health``
    turns 503 and it exits, which recreates the group the same way.
    """
    worker = {k: json.loads(json.dumps(v)) for k, v in leader.items()
              if k not in ("ports", "readinessProbe", "livenessProbe", "startupProbe", "lifecycle")}
    worker["name"] = "worker"
    args = list(leader["args"])
    if "--api-key-file" in args:  # workers serve no requests
        i = args.index("--api-key-file")
        del args[i:i + 2]
    for flag in ("--host", "--port"):
        i = args.index(flag)
        del args[i:i + 2]
    worker["args"] = args
    worker["volumeMounts"] = [m for m in leader["volumeMounts"] if m["name"] != "api-key"]
    return worker


def build_leader_worker_set(spec: LLMEngineSpec, name: str, namespace: str, version: str, artifact_uri: str,
                            config: OperatorConfig, owner: dict[str, Any] | None = None,
                            expect: ArtifactExpectation | None = None, rank_group: str | None = None) -> dict[str, Any]:
    """A ``leaderworkerset.x-k8s.io/v1`` LeaderWorkerSet: ``spec.serving.replicas`` groups of
    ``replica_shape.pods`` pods, pod ``i`` holding ranks ``i*k .. i*k+k-1`` on its ``k`` GPUs.

    - Readiness: the leader (worker index 0, rank 0) serves HTTP and its ``/ready`` is 503 until every
      rank has joined, loaded its shard and run a warm-up step through every stage; a group is Ready,
      and the Service routes to it, only when all of it is. Workers: see :func:`worker_container`.
    - ``startupPolicy: LeaderCreated``: workers start with the leader. ``LeaderReady`` would deadlock:
      the leader is not Ready until the workers have joined.
    - ``restartPolicy: RecreateGroupOnPodRestart``: any pod or container restart recreates the group;
      a broken collective group heals no other way.
    - ``rolloutStrategy``: RollingUpdate, maxUnavailable 0, maxSurge 1: as the Deployment, a new group
      must be Ready before an old one goes, so the old version serves until the new one can.
    - Every pod carries ``rank_group`` (:func:`kiln.operator.keys.rank_group_label`), what the NetworkPolicy admits.
    """
    shape = spec.replica_shape
    ranks = {LABEL_RANK_GROUP: rank_group} if rank_group else {}
    leader = serving_container(spec, name, artifact_uri, config, expect)
    leader["ports"] = [*leader["ports"],
                       {"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"}]
    # Every rank (leader and workers: worker_container copies the env) shows its peers the group's token.
    leader["env"] = [*leader["env"], {"name": "KILN_LEADER_PORT", "value": str(RENDEZVOUS_PORT)},
                     group_token_env(name)]
    worker = worker_container(leader)
    annotations = {ANNOTATION_VERSION: version, "prometheus.io/scrape": "true",
                   "prometheus.io/port": str(spec.serving.port), "prometheus.io/path": "/metrics"}
    worker_pod = _pod_spec(spec, config, worker, name)
    worker_pod["volumes"] = [v for v in worker_pod["volumes"] if v["name"] != "api-key"]
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": object_meta(lws_name(name), namespace, serving_labels(name), owner,
                          {ANNOTATION_VERSION: version, ANNOTATION_ARTIFACT: artifact_uri,
                           **({REPLICAS_OWNER: "autoscaler"} if autoscaled(spec) else {})}),
        "spec": {
            "replicas": initial_replicas(spec),  # autoscaled: create only (apply.py), then the scaler's
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {"type": "RollingUpdate",
                                "rollingUpdateConfiguration": {"maxUnavailable": 0, "maxSurge": 1}},
            "leaderWorkerTemplate": {
                "size": shape.pods,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": {
                    "metadata": {"labels": {**serving_labels(name), LABEL_VERSION: version_label(version), **ranks},
                                 "annotations": annotations},
                    "spec": _pod_spec(spec, config, leader, name),
                },
                "workerTemplate": {
                    "metadata": {"labels": {**worker_labels(name), LABEL_VERSION: version_label(version), **ranks},
                                 "annotations": {ANNOTATION_VERSION: version}},
                    "spec": worker_pod,
                },
            },
        },
    }


def build_workload(spec: LLMEngineSpec, name: str, namespace: str, version: str, artifact_uri: str,
                   config: OperatorConfig, owner: dict[str, Any] | None = None,
                   expect: ArtifactExpectation | None = None, rank_group: str | None = None) -> dict[str, Any]:
    """The serving workload of a spec: a LeaderWorkerSet when a replica spans pods, else a Deployment.
    ``rank_group``: the multi-node engine's rank label value (:func:`kiln.operator.keys.rank_group_label`)."""
    if spec.replica_shape.multi_node:
        return build_leader_worker_set(spec, name, namespace, version, artifact_uri, config, owner, expect, rank_group)
    return build_deployment(spec, name, namespace, version, artifact_uri, config, owner, expect)


def build_service(spec: LLMEngineSpec, name: str, namespace: str,
                  owner: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(service_name(name), namespace, serving_labels(name), owner),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name),
            "ports": [{"name": "http", "port": spec.serving.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def build_pdb(spec: LLMEngineSpec, name: str, namespace: str,
              owner: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """maxUnavailable 1 from 2 replicas up; none for 0 or 1 replica, which could never be evicted
    (a node drain would hang) and cannot stay available through one anyway.

    A multi-node engine's budget covers every pod of every group: evicting one pod recreates its whole
    group, whose pods are then all unavailable, so the budget admits the next eviction only once that
    group is back: one group at a time."""
    if floor_replicas(spec) < 2:  # autoscaled: the scaler's minReplicas
        return None
    if spec.replica_shape.multi_node:
        return {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": object_meta(name, namespace, serving_labels(name), owner),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": engine_pod_labels(name)}},
        }
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(name, namespace, serving_labels(name), owner),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name)}},
    }
