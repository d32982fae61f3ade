"""The build Job: a pure function of (engine, version, config) -> a batch/v1 Job dict.

Two containers, so that the model's credentials and the store's never share an
environment (docs/operator-trust.md):

- init container ``fetch``: ``kiln build --fetch-only``, with the user's
  ``spec.model.credentialsSecret`` (HF_TOKEN or AWS_*) and no store settings:
  downloads the checkpoint into the shared ``work`` emptyDir.
- container ``build``: ``kiln build --prefetched --store $(KILN_STORE_URI)``, with
  the store Secret and no model credentials: builds from that local checkpoint
  and publishes, recording ``$KILN_BUILT_BY`` (image + operator) in the manifest
  and signing it with the operator's private key, which only this container
  mounts (``$KILN_SIGNING_KEY``; :mod:`kiln.operator.keys`).

Both read the manifest as JSON in ``KILN_SPEC`` and the expected version in
``KILN_ENGINE_VERSION`` (``builder_job/manifest_input.py``; tests/builder/test_job_contract.py
runs each container's command with that container's env only). A Job is shared by every LLMEngine that wants its
version, so it carries no controller owner; each of those engines adds itself
as a plain owner (see reconcile.py) and Kubernetes' garbage collector deletes
the Job once the last of them is gone.
"""

from __future__ import annotations

import json
from typing import Any

from kiln.operator.keys import credentials_copy_name, signing_key_mount, signing_key_volume
from kiln.operator.naming import ANNOTATION_ARTIFACT, ANNOTATION_VERSION, build_labels, job_name
from kiln.operator.settings import OperatorConfig
from kiln.operator.trust import builder_image, built_by

from kiln.api import API_VERSION, GROUP, KIND, LLMEngineSpec
from kiln.artifact_manifest import BUILT_BY_ENV
from kiln.model_source import PVC_ROOT_ENV
from kiln.skus import GPU_SKUS

WORK_DIR = "/var/lib/kiln"
# A build Job runs in the jobs namespace, where no engine can own it: this names the engine that created it.
ANNOTATION_REQUESTED_BY = f"{GROUP}/requested-by"
PVC_MOUNT_ROOT = f"{WORK_DIR}/pvc"


def pod_security_context() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532,
            "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]}}


def gpu_placement(spec: LLMEngineSpec, config: OperatorConfig) -> dict[str, Any]:
    """nodeSelector + tolerations for the SKU (validated beforehand to have a node-label entry)."""
    return sku_placement(spec.gpu, config)


def sku_placement(gpu: str, config: OperatorConfig) -> dict[str, Any]:
    """nodeSelector + tolerations of pods for the SKU ``gpu`` (an engine's, or an engine pool's)."""
    placement: dict[str, Any] = {}
    selector = config.node_selector(gpu) or {}
    if selector:
        placement["nodeSelector"] = dict(selector)
    tolerations = [*config.tolerations, *([] if GPU_SKUS[gpu].is_cpu else config.gpu_tolerations)]
    if tolerations:
        placement["tolerations"] = tolerations
    return placement


def pod_gpus(spec: LLMEngineSpec) -> int:
    """GPUs of one serving pod, and of the build Job: the ranks one pod holds
    (``tensorParallel x pipelineParallel``, at most ``gpusPerNode``: :func:`kiln.skus.replica_shape`).

    A multi-node engine is built on one node with that node's GPUs: the builder converts and shards
    every (stage, TP rank) file in host memory, so the node must hold the checkpoint in RAM and on its
    work volume (docs/multi-node-cluster.md)."""
    return spec.replica_shape.ranks_per_pod


def with_gpus(resources: dict[str, Any] | None, spec: LLMEngineSpec) -> dict[str, Any]:
    """``resources`` plus ``nvidia.com/gpu: <the pod's ranks>`` in limits (GPUs go in limits only)."""
    out = json.loads(json.dumps(resources or {}))
    if not spec.gpu_spec.is_cpu:
        out.setdefault("limits", {})["nvidia.com/gpu"] = pod_gpus(spec)
    return out


def shm_volume(spec: LLMEngineSpec) -> list[dict[str, Any]]:
    """Ranks in one pod exchange tensors through /dev/shm, which is 64 MiB by default."""
    return shm_volumes(pod_gpus(spec))


def shm_volumes(ranks: int) -> list[dict[str, Any]]:
    """The /dev/shm volume of a pod holding ``ranks`` ranks (none for one)."""
    return [] if ranks <= 1 else [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}]


def secret_env_from(secret: str | None) -> list[dict[str, Any]]:
    return [{"secretRef": {"name": secret}}] if secret else []


def credentials_env_from(namespace: str, secrets: list[str]) -> list[dict[str, Any]]:
    """The fetch container's credentials: the jobs namespace's copies of the engine namespace's ``secrets``."""
    return [ref for secret in dict.fromkeys(secrets) for ref in secret_env_from(credentials_copy_name(namespace,
                                                                                                      secret))]


def model_secrets(spec: LLMEngineSpec) -> list[str]:
    """The credentials Secrets a build fetches with: the model's and a draft model's (kiln.speculative_options)."""
    return list(dict.fromkeys(m.credentials_secret for m in spec.sources.values() if m.credentials_secret))


def manifest_json(spec: LLMEngineSpec, name: str, namespace: str) -> str:
    return json.dumps({"apiVersion": API_VERSION, "kind": KIND,
                       "metadata": {"name": name, "namespace": namespace}, "spec": spec.to_k8s()},
                      sort_keys=True, separators=(",", ":"))


def job_volumes(spec: LLMEngineSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod's volumes, and the read-only mounts of the PVCs that hold the checkpoint and a speculative
    draft model's (one volume per claim; both containers mount them)."""
    volumes: list[dict[str, Any]] = [{"name": "work", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}},
                                     {"name": "fetch-tmp", "emptyDir": {}}, *shm_volume(spec),
                                     signing_key_volume()]
    model_mounts: list[dict[str, Any]] = []
    claims = list(dict.fromkeys(m.source.removeprefix("pvc://").split("/", 1)[0] for m in spec.sources.values()
                                if m.scheme == "pvc"))
    for i, claim in enumerate(claims):
        volume = "model" if i == 0 else f"model-{i}"
        volumes.append({"name": volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        model_mounts.append({"name": volume, "mountPath": f"{PVC_MOUNT_ROOT}/{claim}", "readOnly": True})
    return volumes, model_mounts


def job_env(spec: LLMEngineSpec, name: str, namespace: str, version: str) -> list[dict[str, Any]]:
    """What both containers read: the manifest, the version it must hash to, and where to work."""
    return [
        {"name": "KILN_ENGINE_VERSION", "value": version},
        {"name": "KILN_SPEC", "value": manifest_json(spec, name, namespace)},
        {"name": "KILN_WORK_DIR", "value": WORK_DIR},
        {"name": PVC_ROOT_ENV, "value": PVC_MOUNT_ROOT},
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": f"{WORK_DIR}/hf"},
    ]


def fetch_container(spec: LLMEngineSpec, namespace: str, config: OperatorConfig, env: list[dict[str, Any]],
                    model_mounts: list[dict[str, Any]]) -> dict[str, Any]:
    """The init container: the user's model credentials, only here, with no store settings or credentials."""
    fetch: dict[str, Any] = {
        "name": "fetch",
        "image": builder_image(spec, config),
        "imagePullPolicy": config.image_pull_policy,
        "command": ["kiln", "build"],
        "args": ["--fetch-only"],
        "env": env,
        "resources": json.loads(json.dumps(config.build_resources or {})),
        "volumeMounts": [{"name": "work", "mountPath": WORK_DIR}, {"name": "fetch-tmp", "mountPath": "/tmp"},
                         *model_mounts],
        "securityContext": container_security_context(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if secrets := model_secrets(spec):
        fetch["envFrom"] = credentials_env_from(namespace, secrets)
    return fetch


def build_container(spec: LLMEngineSpec, config: OperatorConfig, env: list[dict[str, Any]],
                    model_mounts: list[dict[str, Any]]) -> dict[str, Any]:
    """The main container: the store's credentials and the signing key, only here, with no model credentials."""
    key_mount, key_env = signing_key_mount()
    mounts: list[dict[str, Any]] = [{"name": "work", "mountPath": WORK_DIR}, {"name": "tmp", "mountPath": "/tmp"},
                                    *model_mounts, key_mount]
    if pod_gpus(spec) > 1:
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    container: dict[str, Any] = {
        "name": "build",
        "image": builder_image(spec, config),
        "imagePullPolicy": config.image_pull_policy,
        "command": ["kiln", "build"],
        "args": ["--prefetched", "--store", "$(KILN_STORE_URI)"],
        "env": [{"name": "KILN_STORE_URI", "value": config.store_uri}, *env,
                {"name": BUILT_BY_ENV, "value": built_by(spec, config).model_dump_json()}, key_env],
        "resources": with_gpus(config.build_resources, spec),
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if config.store_secret:
        container["envFrom"] = secret_env_from(config.store_secret)
    return container


def job_pod_spec(spec: LLMEngineSpec, name: str, namespace: str, version: str,
                 config: OperatorConfig) -> dict[str, Any]:
    volumes, model_mounts = job_volumes(spec)
    env = job_env(spec, name, namespace, version)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "securityContext": pod_security_context(),
        # Nothing in a build talks to the Kubernetes API: no token in the pod to steal.
        "automountServiceAccountToken": False,
        "initContainers": [fetch_container(spec, namespace, config, env, model_mounts)],
        "containers": [build_container(spec, config, env, model_mounts)],
        "volumes": volumes,
        **gpu_placement(spec, config),
    }
    if config.builder_service_account:
        pod_spec["serviceAccountName"] = config.builder_service_account
    return pod_spec


def build_job(spec: LLMEngineSpec, name: str, namespace: str, version: str,
              config: OperatorConfig) -> dict[str, Any]:
    labels = build_labels(version)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": job_name(version),
            "namespace": config.jobs_namespace,
            "labels": labels,
            "annotations": {ANNOTATION_VERSION: version, ANNOTATION_ARTIFACT: _artifact_uri(config, version),
                            ANNOTATION_REQUESTED_BY: f"{namespace}/{name}"},
        },
        "spec": {
            "backoffLimit": config.build_backoff_limit,
            "activeDeadlineSeconds": spec.build.timeout_seconds,
            "ttlSecondsAfterFinished": config.build_ttl_seconds,
            "template": {"metadata": {"labels": labels}, "spec": job_pod_spec(spec, name, namespace, version, config)},
        },
    }


def _artifact_uri(config: OperatorConfig, version: str) -> str:
    return f"{config.store_uri.rstrip('/')}/engines/{version}"
