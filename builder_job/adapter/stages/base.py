"""The adapter build's ``base`` stage: the base artifact's ``config.json`` from the store, after its manifest's
signature (the build's own key) and the file's digest; what ``check`` holds the adapter against. Torch-free."""

from __future__ import annotations

import json
from typing import Any

from kiln.builder.adapter.context import AdapterContext
from kiln.builder.errors import InvalidSpec, StorageFailure

from kiln.artifact_manifest import StoreError, bytes_sha256
from kiln.artifacts import ArtifactStore


def base_config(store: ArtifactStore, base: str, signer) -> dict[str, Any]:
    """The base artifact's config.json, after its manifest's signature (the signer's own key) and digest."""
    manifest, document = store.read_signed_manifest(base)
    if manifest is None:
        raise InvalidSpec(f"spec: the base engine {base} is not in {store.uri}; build it first (`kiln build`), then "
                          "its adapters")
    if signer is not None:
        from kiln.signing import Verifier

        verifier = Verifier(signer.key.public_key(), signer.key_id, signer.algorithm)  # the signer's own key
        if (problem := verifier.problem(document)) is not None:
            raise StorageFailure(f"{store.artifact_uri(base)}: the base's manifest is not signed by this "
                                 f"build's key: {problem}")
    entry = next((f for f in manifest.files if f.path == "config.json"), None)
    data = store.backend.read(f"engines/{base}/config.json") if entry else None
    if data is None or entry is None:
        raise StorageFailure(f"{store.artifact_uri(base)}: no config.json in the base artifact")
    if bytes_sha256(data) != entry.sha256:
        raise StorageFailure(f"{store.artifact_uri(base)}/config.json: digest differs from its manifest")
    return json.loads(data)


def run(ctx: AdapterContext) -> None:
    try:
        ctx.base_config = base_config(ctx.store, ctx.base, ctx.signer)
    except StoreError as exc:
        raise StorageFailure(str(exc)) from None
    ctx.report.record("base_engine_version", ctx.base)
