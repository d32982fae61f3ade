"""The signing key pair and the per-group token: what the operator keeps, and the copies pods mount.

- The key pair lives in one Secret in the operator's namespace (``kiln-signing-key``, keys
  ``signing-key.pem`` and ``verify-key.pem``). The operator creates it on first need with a fresh
  Ed25519 pair (:func:`kiln.signing.new_key_pair_pem`), unless the chart names one (``signing.secretName``,
  bring your own): then it only reads it.
- A pod mounts Secrets of its own namespace only, so the operator writes two copies into each engine's
  namespace: ``kiln-build-signing-key`` (the private key alone; mounted only by the build Job's publishing
  container, ``$KILN_SIGNING_KEY``) and ``kiln-verify-key`` (the public key alone; mounted by serving pods,
  ``$KILN_VERIFY_KEY``). A key pair rotated in the operator's Secret reaches the copies when the operator
  restarts.
- A multi-node engine's ranks show each other a random token (``<engine>-group-token``, key ``token``,
  ``$KILN_GROUP_TOKEN``), created once, owned by the engine. Renderers only name these Secrets; their
  values are made here, in the act step.

Reads are by name only (the chart's RBAC grants ``get`` on these names, ``create`` on secrets); the token
Secret is created and never read (AlreadyExists means it is there).
"""

from __future__ import annotations

import base64
import secrets
from dataclasses import dataclass
from typing import Any

from kiln.operator.kube import ApiError, KubeClient, api_path
from kiln.operator.naming import (
    BUILD_KEY_SECRET,
    COMMON_LABELS,
    VERIFY_KEY_SECRET,
    group_token_name,
    object_meta,
)
from kiln.operator.settings import OperatorConfig

from kiln.signing import SIGNING_KEY_ENV, VERIFY_KEY_ENV, new_key_pair_pem

SIGNING_KEY_FILE, VERIFY_KEY_FILE = "signing-key.pem", "verify-key.pem"
SIGNING_DIR = "/var/run/secrets/kiln/signing"
VERIFY_DIR = "/var/run/secrets/kiln/verify"
GROUP_TOKEN_ENV, GROUP_TOKEN_KEY = "KILN_GROUP_TOKEN", "token"
KEY_LABELS = {**COMMON_LABELS, "app.kubernetes.io/component": "signing"}


class KeyPairMissing(Exception):
    """The chart names a key pair Secret that does not exist or lacks a key; the message says which."""


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


def group_token_secret(engine: str, namespace: str, owner: dict[str, Any] | None, token: str) -> dict[str, Any]:
    labels = {**COMMON_LABELS, "app.kubernetes.io/instance": engine, "app.kubernetes.io/component": "serving"}
    return secret(group_token_name(engine), namespace, {GROUP_TOKEN_KEY: token.encode()}, labels, owner)


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


async def ensure_group_token(kube: KubeClient, engine: str, namespace: str, owner: dict[str, Any]) -> None:
    """Create the engine's group token once: AlreadyExists means it is there (its value never changes)."""
    desired = group_token_secret(engine, namespace, owner, secrets.token_urlsafe(32))
    try:
        await kube.create(api_path("v1", "secrets", namespace), desired)
    except ApiError as exc:
        if exc.status != 409:
            raise
