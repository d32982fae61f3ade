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

MAX_NAME = 63
LABEL_VERSION = f"{GROUP}/engine-version"
LABEL_ENGINE = f"{GROUP}/engine"
ANNOTATION_VERSION = f"{GROUP}/engine-version"
ANNOTATION_ARTIFACT = f"{GROUP}/artifact-uri"
MANAGED_BY = "kiln-operator"
COMMON_LABELS = {"app.kubernetes.io/name": "kiln", "app.kubernetes.io/part-of": "kiln",
                 "app.kubernetes.io/managed-by": MANAGED_BY}


def bounded_name(prefix: str, key: str, limit: int = MAX_NAME) -> str:
    """``prefix + key`` if it fits in ``limit``, else a truncation plus a hash of ``key`` (still unique)."""
    name = prefix + key
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(key.encode()).hexdigest()[:8]
    head = (prefix + key)[: limit - len(digest) - 1].rstrip("-")
    return f"{head}-{digest}"


def job_name(version: str) -> str:
    return bounded_name("kiln-build-", version)


def service_name(engine: str) -> str:
    """Service names are DNS-1035 labels (start with a letter); LLMEngine names may start with a digit."""
    return engine if re.match(r"^[a-z]", engine) else bounded_name("llme-", engine)


def build_labels(version: str) -> dict[str, str]:
    return {**COMMON_LABELS, "app.kubernetes.io/component": "build", LABEL_VERSION: version}


def selector_labels(engine: str) -> dict[str, str]:
    """Immutable Deployment selector: never includes the version (that would orphan old pods)."""
    return {LABEL_ENGINE: engine, "app.kubernetes.io/component": "serving"}


def serving_labels(engine: str) -> dict[str, str]:
    return {**COMMON_LABELS, "app.kubernetes.io/instance": engine, **selector_labels(engine)}


def owner_reference(body: dict[str, Any], controller: bool = True) -> dict[str, Any]:
    """An ownerReference to an LLMEngine; ``controller=False`` for shared objects (build Jobs)."""
    meta = body["metadata"]
    return {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": controller, "blockOwnerDeletion": controller}
