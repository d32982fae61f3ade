"""LoRA adapters on a cluster, as pure functions: each adapter's build Job, its phase, and the ConfigMap that
tells serving pods which adapters to hold (docs/lora.md, "On a cluster").

An adapter of ``spec.lora.adapters`` is an artifact of its own, ``<base version>-<name>-<hash>``
(:func:`kiln.envelope.adapter_version`), built by ``kiln build-adapter`` in a Job named after that version, the
way a base build Job is named after the engine version. Once the store holds it, the adapter is listed in the
engine's ConfigMap ``<engine>-adapters``; serving pods mount that ConfigMap as a volume (the kubelet updates
the file in place) and load or unload what it lists: nothing in the pod template depends on the list, so adding
or removing an adapter rolls no pod. The reconcile's observe step reads the store and the Jobs into
``World.adapters`` (:mod:`kiln.operator.adapter_steps`), ``decide`` asks :func:`plan_adapters` for an
:class:`AdapterPlan`, and the serve step carries it out; everything here decides from what was read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kiln.operator.jobs import ANNOTATION_REQUESTED_BY, PVC_MOUNT_ROOT, credentials_env_from, job_pod_spec
from kiln.operator.naming import COMMON_LABELS, GROUP, JOB_NAME_DIGITS, bounded_name, object_meta, version_label
from kiln.operator.settings import OperatorConfig
from kiln.operator.status import job_state

from kiln import adapter_list
from kiln.adapter_list import ADAPTER_VERSION_ENV, ADAPTERS_FILE_ENV
from kiln.api import LLMEngineSpec
from kiln.envelope import adapter_version
from kiln.lora_options import LoraAdapter

ADAPTERS_DIR = "/etc/kiln/lora"
ADAPTERS_FILE_KEY = "adapters.json"
LABEL_ADAPTER = f"{GROUP}/adapter"
ANNOTATION_ADAPTER_VERSION = f"{GROUP}/adapter-version"
BUILDING, READY, FAILED = "Building", "Ready", "Failed"


def configmap_name(engine: str) -> str:
    return bounded_name("", f"{engine}-adapters", 253)


def adapter_job_name(version: str) -> str:
    return bounded_name("kiln-adapter-", version, digits=JOB_NAME_DIGITS)


def adapters_volume(spec: LLMEngineSpec, engine: str) -> list[dict[str, Any]]:
    """The pod's view of the ConfigMap: ``optional`` (a pod starts before the first adapter is built), and the
    same whatever the ConfigMap lists, so the pod template never changes with the adapters."""
    if spec.lora is None:
        return []
    return [{"name": "lora-adapters", "configMap": {"name": configmap_name(engine), "optional": True}}]


def adapters_mount(spec: LLMEngineSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumeMounts, env) of the serving container: a directory mount (a subPath mount would never update)."""
    if spec.lora is None:
        return [], []
    return ([{"name": "lora-adapters", "mountPath": ADAPTERS_DIR, "readOnly": True}],
            [{"name": ADAPTERS_FILE_ENV, "value": f"{ADAPTERS_DIR}/{ADAPTERS_FILE_KEY}"}])


@dataclass(frozen=True)
class AdapterView:
    """What the reconcile read of one adapter for one base version: its artifact and its Job."""

    adapter: LoraAdapter
    base_version: str
    version: str
    artifact_uri: str
    built: bool  # the store holds a valid manifest of ``version`` this operator trusts
    untrusted: str | None = None  # why a manifest in the store is not served
    job: dict[str, Any] | None = None
    failure: str = ""  # the failed Job's termination message
    content_digest: str | None = None  # the digest pinned (listed in the ConfigMap): trusted at first sight
    conflict: str | None = None  # the Job under its name builds another version (naming.job_conflict): not taken


def adapter_phase(view: AdapterView) -> tuple[str, str | None]:
    """(phase, message) of one adapter: Ready once built; else its Job's state. A failed Job is not retried:
    a new revision or source makes a new version, hence a new Job (the base keeps serving meanwhile)."""
    if view.built:
        return READY, None
    if view.untrusted is not None:
        return FAILED, f"{view.artifact_uri}: not serving it: {view.untrusted}"
    if view.conflict is not None:
        return FAILED, view.conflict
    state = job_state(view.job or {})
    if state.state == "failed":
        return FAILED, view.failure or state.message or f"adapter build Job {adapter_job_name(view.version)} failed"
    return BUILDING, None


def adapter_statuses(views: list[AdapterView]) -> list[dict[str, Any]]:
    """``status.adapters``: one entry per adapter of the spec, for the version the spec builds to."""
    out = []
    for view in views:
        phase, message = adapter_phase(view)
        entry = {"name": view.adapter.name, "phase": phase, "version": view.version,
                 "artifactURI": view.artifact_uri, "jobName": adapter_job_name(view.version)}
        if message:
            entry["message"] = message[:4096]
        out.append(entry)
    return out


def wants_job(view: AdapterView) -> bool:
    return not view.built and view.untrusted is None and view.conflict is None and view.job is None


def adapters_document(views: list[AdapterView]) -> dict[str, Any]:
    """The file pods read (docs/lora.md): every pinned adapter (built, and trusted when first read), for each
    base version still served, with the content digest pods must find (they refuse any other)."""
    listed = [{"name": v.adapter.name, "artifactURI": v.artifact_uri, "version": v.version,
               "baseEngineVersion": v.base_version, "contentDigest": v.content_digest}
              for v in views if v.content_digest]
    return adapter_list.document(listed)


def build_configmap(engine: str, namespace: str, views: list[AdapterView], owner: dict[str, Any] | None
                    ) -> dict[str, Any]:
    labels = {**COMMON_LABELS, "app.kubernetes.io/instance": engine, "app.kubernetes.io/component": "lora-adapters"}
    text = json.dumps(adapters_document(views), indent=2, sort_keys=True) + "\n"
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": object_meta(configmap_name(engine), namespace,
                                                                              labels, owner),
            "data": {ADAPTERS_FILE_KEY: text}}


@dataclass(frozen=True)
class AdapterPlan:
    """What a served engine's adapters need (:func:`plan_adapters`); the serve step carries it out."""

    jobs: tuple[AdapterView, ...] = ()  # adapters of the wanted base whose build Job to create
    building: tuple[AdapterView, ...] = ()  # ... whose Job runs: the credentials it names are copied next to it
    configmap: dict[str, Any] | None = None  # the <engine>-adapters ConfigMap to apply
    delete_configmap: bool = False  # spec.lora was removed: the ConfigMap goes
    statuses: list[dict[str, Any]] | None = None  # status.adapters (None removes it)


def plan_adapters(spec: LLMEngineSpec, name: str, namespace: str, version: str, views: tuple[AdapterView, ...],
                  old: dict[str, Any], owner: dict[str, Any] | None) -> AdapterPlan:
    """The adapters' plan once the base ``version`` serves: a Job for each of its adapters neither built, refused
    nor building; a ConfigMap listing the wanted base's pinned adapters and the old base's built ones (kept while
    its pods serve); ``status.adapters`` for the wanted base. Without ``spec.lora``: drop the ConfigMap (when a
    status says there were adapters) and ``status.adapters``."""
    if spec.lora is None:
        return AdapterPlan(delete_configmap=old.get("adapters") is not None)
    current = [v for v in views if v.base_version == version]
    listed = [v for v in views if v.base_version == version or v.built]
    building = tuple(v for v in current if v.job is not None and job_state(v.job).state == "running")
    return AdapterPlan(jobs=tuple(v for v in current if wants_job(v)), building=building,
                       configmap=build_configmap(name, namespace, listed, owner), statuses=adapter_statuses(current))


def wanted_views(spec: LLMEngineSpec, bases: list[str]) -> list[tuple[LoraAdapter, str, str]]:
    """(adapter, base version, adapter version) for every adapter of the spec and every base still wanted."""
    assert spec.lora is not None
    return [(a, base, adapter_version(base, a)) for base in bases for a in spec.lora.adapters]


def build_adapter_job(spec: LLMEngineSpec, name: str, namespace: str, view: AdapterView,
                      config: OperatorConfig) -> dict[str, Any]:
    """The base build Job's pod (two containers, model credentials apart from the store's and the signing key),
    running ``kiln build-adapter --adapter <name>``: the fetch container holds the adapter's credentials and the
    model's (the quality gate compares against the base checkpoint)."""
    labels = {**COMMON_LABELS, "app.kubernetes.io/component": "adapter-build",
              LABEL_ADAPTER: version_label(view.version)}
    pod = job_pod_spec(spec, name, namespace, view.base_version, config)
    fetch, build = pod["initContainers"][0], pod["containers"][0]
    extra_env = {"name": ADAPTER_VERSION_ENV, "value": view.version}
    for container, args in ((fetch, ["--fetch-only"]), (build, ["--prefetched", "--store", "$(KILN_STORE_URI)"])):
        container["command"] = ["kiln", "build-adapter"]
        container["args"] = ["--adapter", view.adapter.name, *args]
        container["env"] = [*container["env"], extra_env]
    _mount_adapter_claim(pod, view.adapter)
    fetch.pop("envFrom", None)
    if secrets := adapter_secrets(spec, view.adapter):
        fetch["envFrom"] = credentials_env_from(namespace, secrets)
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": adapter_job_name(view.version), "namespace": config.jobs_namespace, "labels": labels,
                     "annotations": {ANNOTATION_ADAPTER_VERSION: view.version,
                                     f"{GROUP}/artifact-uri": view.artifact_uri,
                                     ANNOTATION_REQUESTED_BY: f"{namespace}/{name}"}},
        "spec": {"backoffLimit": config.build_backoff_limit, "activeDeadlineSeconds": spec.build.timeout_seconds,
                 "ttlSecondsAfterFinished": config.build_ttl_seconds,
                 "template": {"metadata": {"labels": labels}, "spec": pod}},
    }


def adapter_secrets(spec: LLMEngineSpec, adapter: LoraAdapter) -> list[str]:
    """The credentials Secrets an adapter build fetches with: the model's (the gate reads the base) and the adapter's."""
    return list(dict.fromkeys(s for s in (spec.model.credentials_secret, adapter.credentials_secret) if s))


def _mount_adapter_claim(pod: dict[str, Any], adapter: LoraAdapter) -> None:
    """A pvc:// adapter's claim, read-only in both containers, unless the model's or draft's mounts it already."""
    if adapter.model_source.scheme != "pvc":
        return
    claim = adapter.source.removeprefix("pvc://").split("/", 1)[0]
    if any((v.get("persistentVolumeClaim") or {}).get("claimName") == claim for v in pod["volumes"]):
        return
    pod["volumes"].append({"name": "adapter", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
    for container in (pod["initContainers"][0], pod["containers"][0]):
        container["volumeMounts"].append({"name": "adapter", "mountPath": f"{PVC_MOUNT_ROOT}/{claim}",
                                          "readOnly": True})


def pinned_digests(configmap: dict[str, Any] | None) -> dict[str, str]:
    """Adapter version -> the content digest this operator pinned, from the ConfigMap it wrote (it is the pin:
    a store rewritten later is compared with it, never re-pinned). An unreadable document pins nothing."""
    try:
        document = json.loads(((configmap or {}).get("data") or {}).get(ADAPTERS_FILE_KEY) or "{}")
        entries = document.get("adapters") or [] if isinstance(document, dict) else []
        return {e["version"]: e["contentDigest"] for e in entries
                if isinstance(e, dict) and isinstance(e.get("version"), str) and isinstance(e.get("contentDigest"), str)}
    except (ValueError, TypeError, AttributeError):
        return {}
