"""The signing key pair and the per-group token: what the operator keeps, and the copies pods mount.

- The key pair lives in one Secret in the operator's namespace (``kiln-signing-key``, keys
  ``signing-key.pem`` and ``verify-key.pem``). The operator creates it on first need with a fresh
  Ed25519 pair (:func:`kiln.signing.new_key_pair_pem`), unless the chart names one (``signing.secretName``,
  bring your own): then it only reads it.
- The private key goes only where builds run: every build Job, engine and adapter alike, runs in the jobs
  namespace (``OperatorConfig.jobs_namespace``: the operator's unless the chart names ``build.namespace``), which
  holds ``kiln-build-signing-key`` (the private key alone; mounted only by the build Job's publishing container,
  ``$KILN_SIGNING_KEY``). No engine namespace ever holds it, so no one who can create pods there can mount it;
  a copy an older operator wrote into an engine namespace is deleted.
- Engine namespaces get ``kiln-verify-key`` (the public key alone; mounted by serving pods, ``$KILN_VERIFY_KEY``).
  A key pair rotated in the operator's Secret reaches the copies when the operator restarts.
- A build Job's fetch container reads the model's (and an adapter's) credentials Secret, which the user keeps in
  the engine's namespace: the operator copies it into the jobs namespace as ``kiln-cred-<namespace>.<secret>``,
  owned by the Job that names it (gone with it).
- A multi-node engine's ranks show each other a random token (``<engine>-group-token``, key ``token``,
  ``$KILN_GROUP_TOKEN``), created once, owned by the engine. Its pods carry ``LABEL_RANK_GROUP``, an HMAC of
  the token (:func:`rank_group_label`), the one label the NetworkPolicy admits to the rank ports. Renderers only
  name these Secrets and take that label value; the values are made here, in the act step.

Reads are by name only (the chart's RBAC grants ``get`` on the key Secrets' names, ``create`` on secrets, and in
engine namespaces ``get`` on the credentials Secrets specs name, and on the group token, read when AlreadyExists
says it is there).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Any

from kiln.operator.kube import ApiError, KubeClient, api_path
from kiln.operator.naming import (
    BUILD_KEY_SECRET,
    COMMON_LABELS,
    VERIFY_KEY_SECRET,
    bounded_name,
    group_token_name,
    object_meta,
)
from kiln.operator.settings import OperatorConfig

from kiln.api import GROUP
from kiln.signing import SIGNING_KEY_ENV, VERIFY_KEY_ENV, new_key_pair_pem

SIGNING_KEY_FILE, VERIFY_KEY_FILE = "signing-key.pem", "verify-key.pem"
SIGNING_DIR = "/var/run/secrets/kiln/signing"
VERIFY_DIR = "/var/run/secrets/kiln/verify"
GROUP_TOKEN_ENV, GROUP_TOKEN_KEY = "KILN_GROUP_TOKEN", "token"
# The label that admits a pod to an engine's rank channel (kiln.operator.network): its value is derived from the
# group token, so a pod that cannot read the token cannot compute it (label values of other pods aside).
LABEL_RANK_GROUP = f"{GROUP}/rank-group"
KEY_LABELS = {**COMMON_LABELS, "app.kubernetes.io/component": "signing"}


class KeyPairMissing(Exception):
    """The chart names a key pair Secret that does not exist or lacks a key; the message says which."""

    what = "signing key"


class GroupTokenMissing(KeyPairMissing):
    """An engine's group token Secret lacks its key; the message says which and how to recover."""

    what = "group token"


@dataclass(frozen=True)
class KeyPair:
    signing_pem: bytes
    verify_pem: bytes


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def secret(name: str, namespace: str, data: dict[str, bytes], labels: dict[str, str] | None = None,
           owner: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": object_meta(name, namespace, labels or KEY_LABELS, owner),
            "data": {key: _b64(value) for key, value in data.items()}}


def key_pair_secret(config: OperatorConfig, pair: KeyPair) -> dict[str, Any]:
    return secret(config.key_secret, config.operator_namespace,
                  {SIGNING_KEY_FILE: pair.signing_pem, VERIFY_KEY_FILE: pair.verify_pem})


def signing_key_copy(namespace: str, pair: KeyPair) -> dict[str, Any]:
    return secret(BUILD_KEY_SECRET, namespace, {SIGNING_KEY_FILE: pair.signing_pem})


def verify_key_copy(namespace: str, pair: KeyPair) -> dict[str, Any]:
    return secret(VERIFY_KEY_SECRET, namespace, {VERIFY_KEY_FILE: pair.verify_pem})


def credentials_copy_name(namespace: str, secret: str) -> str:
    """The jobs namespace's copy of Secret ``secret`` of ``namespace`` (a namespace has no '.': unique)."""
    return bounded_name("kiln-cred-", f"{namespace}.{secret}", 253)


def credentials_copy(live: dict[str, Any], name: str, namespace: str, job: dict[str, Any]) -> dict[str, Any]:
    """A copy of the user's Secret ``live`` named ``name`` in the jobs namespace, owned by the build Job."""
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": job["metadata"]["name"],
             "uid": job["metadata"]["uid"], "controller": False, "blockOwnerDeletion": False}
    labels = {**COMMON_LABELS, "app.kubernetes.io/component": "build"}
    return {"apiVersion": "v1", "kind": "Secret", "type": live.get("type") or "Opaque",
            "metadata": object_meta(name, namespace, labels, owner), "data": dict(live.get("data") or {})}


def group_token_secret(engine: str, namespace: str, owner: dict[str, Any] | None, token: str) -> dict[str, Any]:
    labels = {**COMMON_LABELS, "app.kubernetes.io/instance": engine, "app.kubernetes.io/component": "serving"}
    return secret(group_token_name(engine), namespace, {GROUP_TOKEN_KEY: token.encode()}, labels, owner)


def rank_group_label(token: str, engine: str) -> str:
    """The ``LABEL_RANK_GROUP`` value of ``engine``'s ranks: HMAC-SHA256 keyed by the group token over the engine's
    name, 32 hex digits (a valid label value). Not a constant: another token, or another engine, gives another."""
    mac = hmac.new(token.encode(), f"kiln-rank-group/{engine}".encode(), hashlib.sha256)
    return mac.hexdigest()[:32]


# -- what pods mount (pure; the renderers call these) ---------------------------------------------------------


def key_volume(volume: str, secret_name: str, key: str) -> dict[str, Any]:
    # 0440 with the pod's fsGroup: readable by the container's group, by no one else.
    return {"name": volume, "secret": {"secretName": secret_name, "defaultMode": 0o440,
                                        "items": [{"key": key, "path": key}]}}


def signing_key_volume() -> dict[str, Any]:
    return key_volume("signing-key", BUILD_KEY_SECRET, SIGNING_KEY_FILE)


def signing_key_mount() -> tuple[dict[str, Any], dict[str, Any]]:
    """(volumeMount, env) of the build Job's publishing container."""
    return ({"name": "signing-key", "mountPath": SIGNING_DIR, "readOnly": True},
            {"name": SIGNING_KEY_ENV, "value": f"{SIGNING_DIR}/{SIGNING_KEY_FILE}"})


def verify_key_volume() -> dict[str, Any]:
    return key_volume("verify-key", VERIFY_KEY_SECRET, VERIFY_KEY_FILE)


def verify_key_mount() -> tuple[dict[str, Any], dict[str, Any]]:
    """(volumeMount, env) of every serving container: leaders and workers."""
    return ({"name": "verify-key", "mountPath": VERIFY_DIR, "readOnly": True},
            {"name": VERIFY_KEY_ENV, "value": f"{VERIFY_DIR}/{VERIFY_KEY_FILE}"})


def group_token_env(engine: str) -> dict[str, Any]:
    return {"name": GROUP_TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": group_token_name(engine),
                                                                   "key": GROUP_TOKEN_KEY}}}


# -- the act step ---------------------------------------------------------------------------------------------


def _decoded(obj: dict[str, Any], key: str) -> bytes | None:
    value = (obj.get("data") or {}).get(key)
    return base64.b64decode(value) if value else None


async def load_key_pair(kube: KubeClient, config: OperatorConfig) -> KeyPair:
    """The operator's key pair: read its Secret, or create it with a new pair when the chart named none."""
    path = api_path("v1", "secrets", config.operator_namespace, config.key_secret)
    found = await kube.get(path)
    if found is None and config.signing_secret is None:
        private, public = new_key_pair_pem()
        try:
            found = await kube.create(api_path("v1", "secrets", config.operator_namespace),
                                      key_pair_secret(config, KeyPair(private, public)))
        except ApiError as exc:
            if exc.status != 409:
                raise
            found = await kube.get(path)  # another replica made it first: use theirs
    where = f"Secret {config.operator_namespace}/{config.key_secret}"
    if found is None:
        raise KeyPairMissing(f"{where} (chart value signing.secretName, KILN_SIGNING_SECRET) does not exist; "
                             f"create it with keys {SIGNING_KEY_FILE} and {VERIFY_KEY_FILE}, or unset the value "
                             "and the operator creates one")
    private, public = _decoded(found, SIGNING_KEY_FILE), _decoded(found, VERIFY_KEY_FILE)
    if not private or not public:
        raise KeyPairMissing(f"{where} needs both keys {SIGNING_KEY_FILE} and {VERIFY_KEY_FILE} (PEM)")
    return KeyPair(private, public)


async def ensure_copy(kube: KubeClient, desired: dict[str, Any]) -> None:
    """Create the copy, or patch it when its data differs (a rotated key pair)."""
    meta = desired["metadata"]
    collection = api_path("v1", "secrets", meta["namespace"])
    live = await kube.get(f"{collection}/{meta['name']}")
    if live is None:
        try:
            await kube.create(collection, desired)
        except ApiError as exc:
            if exc.status != 409:
                raise
        return
    if live.get("data") != desired["data"]:
        await kube.patch(f"{collection}/{meta['name']}", {"data": desired["data"]})


def job_secret_refs(job: dict[str, Any]) -> set[str]:
    """The Secrets a build Job's containers take their environment from."""
    pod = job["spec"]["template"]["spec"]
    return {ref["secretRef"]["name"] for c in [*pod.get("initContainers", []), *pod["containers"]]
            for ref in c.get("envFrom") or [] if "secretRef" in ref}


async def ensure_credentials(kube: KubeClient, namespace: str, secrets: list[str], job: dict[str, Any],
                             copy: bool = True) -> str | None:
    """Copy each of ``secrets`` (Secrets of the engine's ``namespace``) that ``job`` names into the Job's namespace.
    A Secret that does not exist yet is left: the Job's pod waits for it, as it would for the original, and the
    next reconcile copies it once it is there. Without ``copy`` (chart ``build.copyCredentials: false``) nothing of
    ``namespace`` is read: returns what to create when a copy the Job names is not in the jobs namespace."""
    refs, jobs = job_secret_refs(job), job["metadata"]["namespace"]
    for secret in secrets:
        name = credentials_copy_name(namespace, secret)
        if name not in refs:  # a Job another engine created, naming its own namespace's Secrets
            continue
        if not copy:
            if await kube.get(api_path("v1", "secrets", jobs, name)) is None:
                return (f"Secret {jobs}/{name} does not exist and the operator does not copy credentials "
                        f"(chart value build.copyCredentials is false): create it with the keys of {namespace}/"
                        f"{secret} (kubectl get secret {secret} -n {namespace} -o yaml, renamed), or set "
                        "build.copyCredentials: true")
            continue
        live = await kube.get(api_path("v1", "secrets", namespace, secret))
        if live is not None:
            await ensure_copy(kube, credentials_copy(live, name, jobs, job))
    return None


async def remove_signing_copy(kube: KubeClient, namespace: str) -> None:
    """Delete the private key an older operator copied into an engine namespace (absent: nothing to do)."""
    await kube.delete(api_path("v1", "secrets", namespace, BUILD_KEY_SECRET))


async def ensure_group_token(kube: KubeClient, engine: str, namespace: str, owner: dict[str, Any]) -> str:
    """The engine's group token: created once with a random value (it never changes), else read (AlreadyExists)."""
    desired = group_token_secret(engine, namespace, owner, secrets.token_urlsafe(32))
    try:
        await kube.create(api_path("v1", "secrets", namespace), desired)
        return base64.b64decode(desired["data"][GROUP_TOKEN_KEY]).decode()
    except ApiError as exc:
        if exc.status != 409:
            raise
    try:
        live = await kube.get(api_path("v1", "secrets", namespace, group_token_name(engine)))
    except ApiError as exc:
        if exc.status != 403:
            raise
        raise GroupTokenMissing(f"the operator may not read Secret {namespace}/{group_token_name(engine)}: a "
                                "cluster-wide install with build.copyCredentials false grants no get on Secrets; "
                                "set build.copyCredentials: true, or list the namespace in watchNamespaces") from None
    token = _decoded(live or {}, GROUP_TOKEN_KEY)
    if not token:
        where = f"Secret {namespace}/{group_token_name(engine)}"
        raise GroupTokenMissing(f"{where} has no key {GROUP_TOKEN_KEY!r}; delete it and the operator makes a new one "
                                "(the engine's ranks restart with it)")
    return token.decode()
