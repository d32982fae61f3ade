"""Names, labels and owner references of everything the operator creates.

A build Job's name is a function of the engine version only, so every operator
replica, every restart and every LLMEngine with the same build envelope asks
for the same object and the API server's AlreadyExists makes the build unique.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from kiln.api import API_VERSION, GROUP, KIND
from kiln.api_base import DNS1035_LABEL, MAX_NAME
from kiln.pool_api import POOL_KIND

LABEL_VERSION = f"{GROUP}/engine-version"
LABEL_ENGINE = f"{GROUP}/engine"
ANNOTATION_VERSION = f"{GROUP}/engine-version"
ANNOTATION_ARTIFACT = f"{GROUP}/artifact-uri"
MANAGED_BY = "kiln-operator"
COMMON_LABELS = {"app.kubernetes.io/name": "kiln", "app.kubernetes.io/part-of": "kiln",
                 "app.kubernetes.io/managed-by": MANAGED_BY}


def bounded_name(prefix: str, key: str, limit: int = MAX_NAME, digits: int = 8) -> str:
    """``prefix + key`` if it fits in ``limit``, else a truncation plus ``digits`` hex of a hash of ``key``."""
    name = prefix + key
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(key.encode()).hexdigest()[:digits]
    head = (prefix + key)[: limit - len(digest) - 1].rstrip("-")
    return f"{head}-{digest}"


JOB_NAME_DIGITS = 16  # build Jobs of every namespace share the jobs namespace: 64 bits of the version's hash


def job_name(version: str) -> str:
    return bounded_name("kiln-build-", version, digits=JOB_NAME_DIGITS)


def job_conflict(job: dict[str, Any], annotation: str, version: str) -> str | None:
    """Why a Job found under ``version``'s Job name is not that version's build (its ``annotation`` names
    another version): never adopted, the engine's condition says which Job to delete. None when it is."""
    theirs = ((job.get("metadata") or {}).get("annotations") or {}).get(annotation)
    if theirs == version:
        return None
    meta = job.get("metadata") or {}
    name, namespace = meta.get("name"), meta.get("namespace")
    return (f"build Job {namespace}/{name} is named for this build but its {annotation} annotation is "
            f"{theirs or 'missing'}, not {version}, so the operator will not take it as this build; delete it "
            f"(kubectl delete job {name} -n {namespace}) and the operator creates this version's Job")


def version_label(version: str) -> str:
    """A version as a label value (at most 63 characters): the version itself when it fits, else its head and a
    hash of the whole (a version carries a 64-hex digest, so most do not fit). For selecting and reading only:
    the full version is in the ``ANNOTATION_VERSION`` annotation and ``status.version``."""
    return bounded_name("", version)


def service_name(engine: str) -> str:
    """Service names are DNS-1035 labels (start with a letter); LLMEngine names may start with a digit."""
    return engine if re.match(r"^[a-z]", engine) else bounded_name("llme-", engine)


def picker_name(routing: Any, service: str) -> str:
    """The endpoint picker Service of an InferencePool over the Service ``service`` (an engine's or a pool's):
    ``routing.endpointPicker`` (a Service name by its field's type, ``kiln.api_base.ServiceName``), else
    ``<service>-epp``, shortened with a hash where it would pass 63 characters: either way a Service that can exist."""
    return routing.endpoint_picker or bounded_name("", service, MAX_NAME - len("-epp")) + "-epp"


DNS_1035_LABEL = re.compile(DNS1035_LABEL)


def engine_name_problem(name: str) -> str | None:
    """Why an LLMEngine called ``name`` cannot have its children (Deployment, Service, PDB, pod labels); None if
    it can. LLMEngine names are DNS-1123 subdomains (up to 253 characters, dots allowed); the children need less."""
    if len(name) > MAX_NAME:
        return (f"metadata.name: {name!r} is {len(name)} characters, but it names this engine's Deployment and "
                f"Service and is a label value on its pods, which allow at most {MAX_NAME}; "
                f"recreate the LLMEngine with a name of at most {MAX_NAME} characters")
    if "." in name:
        return (f"metadata.name: {name!r} contains '.', but it names this engine's Service, which must be a "
                "DNS-1035 label (lowercase letters, digits and '-'); recreate the LLMEngine with '-' instead of '.'")
    if not DNS_1035_LABEL.match(service_name(name)):
        return (f"metadata.name: {name!r} cannot name a Service (a DNS-1035 label: lowercase letters, digits and "
                "'-', starting with a letter, ending with a letter or digit); recreate the LLMEngine with such a name")
    return None


# LeaderWorkerSet names prefix its StatefulSets (<lws>-<group>), pods (<lws>-<group>-<worker>) and their
# controller-revision-hash label values (<statefulset>-<10-char hash>), which must stay within 63 characters.
MAX_LWS_NAME = 40


LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
LWS_PLURAL = "leaderworkersets"


def lws_name(engine: str) -> str:
    """The LeaderWorkerSet of a multi-node engine. Not the engine's own name: the LWS controller creates a
    headless Service named after the LWS (the pods' DNS subdomain), and ``service_name(engine)`` is kiln's."""
    return bounded_name("", f"{service_name(engine)}-lws", MAX_LWS_NAME)


# In each engine's namespace (a pod mounts Secrets of its own namespace only), copies of the operator's key pair:
# the private key alone for build Jobs' publishing container, the public key alone for serving pods.
BUILD_KEY_SECRET = "kiln-build-signing-key"
VERIFY_KEY_SECRET = "kiln-verify-key"


def group_token_name(engine: str) -> str:
    """The Secret holding the token every rank of a multi-node engine shows its peers ($KILN_GROUP_TOKEN)."""
    return bounded_name("", f"{engine}-group-token", 253)


def build_labels(version: str) -> dict[str, str]:
    return {**COMMON_LABELS, "app.kubernetes.io/component": "build", LABEL_VERSION: version_label(version)}


def selector_labels(engine: str) -> dict[str, str]:
    """Immutable Deployment selector: never includes the version (that would orphan old pods)."""
    return {LABEL_ENGINE: engine, "app.kubernetes.io/component": "serving"}


def serving_labels(engine: str) -> dict[str, str]:
    return {**COMMON_LABELS, "app.kubernetes.io/instance": engine, **selector_labels(engine)}


def engine_pod_labels(engine: str) -> dict[str, str]:
    """Every serving pod of an engine, API-serving or not (a multi-node engine's PodDisruptionBudget)."""
    return {LABEL_ENGINE: engine}


def worker_labels(engine: str) -> dict[str, str]:
    """Pods of a LeaderWorkerSet group other than the leader: they only compute, so a different component
    keeps them out of the Service (which selects :func:`selector_labels`: Deployment pods and LWS leaders)."""
    return {**COMMON_LABELS, "app.kubernetes.io/instance": engine, LABEL_ENGINE: engine,
            "app.kubernetes.io/component": "serving-worker"}


# -- engine pools (an LLMEnginePool: docs/pools.md) ----------------------------------------------------------
LABEL_POOL = f"{GROUP}/pool"  # on a pool's objects and pods (the Service selects it)


def pool_workload_name(pool: str) -> str:
    """The pool's Deployment and Service."""
    return f"{pool}-pool"


def pool_engines_name(pool: str) -> str:
    """The ConfigMap holding the pool's engine list (``engines.json``), which its pods follow."""
    return f"{pool}-pool-engines"


def pool_selector_labels(pool: str) -> dict[str, str]:
    """The pool Deployment's (immutable) selector and its Service's: no engine label, so no engine's Service
    selects a pool pod, nor the pool's Service an engine's."""
    return {LABEL_POOL: pool, "app.kubernetes.io/component": "serving"}


def pool_labels(pool: str) -> dict[str, str]:
    return {**COMMON_LABELS, "app.kubernetes.io/instance": pool, **pool_selector_labels(pool)}


def controller_of(obj: dict[str, Any] | None) -> dict[str, Any] | None:
    """The ownerReference marked ``controller`` on ``obj``; None when absent or nothing controls it."""
    refs = ((obj or {}).get("metadata") or {}).get("ownerReferences") or []
    return next((ref for ref in refs if ref.get("controller")), None)


def same_owner(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two ownerReferences name the same owner: kind and name (a uid changes when it is created again)."""
    return (a.get("kind"), a.get("name")) == (b.get("kind"), b.get("name"))


def taken_name(obj: dict[str, Any] | None, owner: dict[str, Any]) -> str | None:
    """Why the live ``obj``, under a name ``owner`` (an LLMEngine or LLMEnginePool body) renders, is not its to
    change: another object controls it (an LLMEnginePool ``P`` names its Deployment and Service ``P-pool``, so an
    LLMEngine called ``P-pool`` wants the same names). None when ``owner`` controls it, or an earlier object of its
    kind and name does (deleted and created again before the garbage collector came: it is adopted), or nothing does.
    """
    ctrl, kind = controller_of(obj), owner.get("kind") or KIND
    if obj is None or ctrl is None or same_owner(ctrl, {"kind": kind, "name": owner["metadata"]["name"]}):
        return None
    live = obj["metadata"]
    return (f"{obj.get('kind') or 'the object'} {live.get('namespace')}/{live.get('name')} belongs to "
            f"{ctrl.get('kind')} {ctrl.get('name')}, and this {kind} names its own the same (an {POOL_KIND} P names "
            f"its Deployment and Service P-pool, an {KIND} E names its E), so the operator leaves it as it is and "
            f"serves nothing for this {kind}; recreate this {kind} (or the other) under another name")


def owner_reference(body: dict[str, Any], controller: bool = True) -> dict[str, Any]:
    """An ownerReference to an LLMEngine; ``controller=False`` for shared objects (build Jobs)."""
    meta = body["metadata"]
    return {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": controller, "blockOwnerDeletion": controller}


def pool_owner_reference(body: dict[str, Any]) -> dict[str, Any]:
    """The controller ownerReference to an LLMEnginePool (its Deployment, Service and ConfigMap)."""
    return {**owner_reference(body), "kind": POOL_KIND}


def object_meta(name: str, namespace: str, labels: dict[str, str], owner: dict[str, Any] | None,
                annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """``metadata`` of an object the operator creates: its labels, annotations and owner."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(labels)}
    if annotations:
        meta["annotations"] = annotations
    if owner:
        meta["ownerReferences"] = [owner]
    return meta
