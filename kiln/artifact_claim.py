"""Moving a verified upload in as ``engines/<version>/``: who may write a version's files, and who wins.

A version's manifest is created with an exclusive create (``O_EXCL``-style link on disk, a
conditional ``If-None-Match: *`` put on S3), so two publishers cannot clobber each other's
manifest. They could still overwrite each other's *files* while moving them in; the
short-lived claim object ``engines/<version>/.publish-claim.json`` prevents that: only the
claim holder, or a publisher with byte-identical content (same content digest), moves files
into ``engines/<version>/``; a publisher with different content waits for the holder's
manifest and then raises :class:`ArtifactConflict`. A claim older than the store's
``claim_ttl`` belongs to a dead publisher and is taken over.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, Protocol

from pydantic import BaseModel

from kiln.artifact_manifest import CLAIM_NAME, MANIFEST_NAME, ArtifactConflict, Manifest, StoreError, now_utc
from kiln.storage import Backend


class VersionStore(Protocol):
    """What moving in needs of :class:`kiln.artifacts.ArtifactStore`."""

    backend: Backend
    claim_ttl: timedelta

    def read_manifest(self, version: str) -> Manifest | None: ...

    def artifact_uri(self, version: str) -> str: ...


def move_in(store: VersionStore, version: str, staging: str, manifest: Manifest) -> Manifest:
    """Promote the verified files under ``staging`` to ``engines/<version>/`` and create the manifest last.

    Returns the manifest that won: ``manifest``, or an earlier publisher's with the same content.
    Raises :class:`ArtifactConflict` when an earlier publisher won with different content.
    """
    backend = store.backend
    base = f"engines/{version}"
    claim_key = f"{base}/{CLAIM_NAME}"
    claim = {"upload_id": manifest.upload_id, "content_digest": manifest.content_digest,
             "created_at": now_utc().isoformat()}
    owns_claim = False
    while True:
        if (winner := store.read_manifest(version)) is not None:
            return _settle(store, winner, manifest)
        if backend.create_exclusive(claim_key, _json_bytes(claim)):
            owns_claim = True
            break
        other = _read_json(backend.read(claim_key))
        if other is None:
            continue  # the holder just finished or gave up: look again
        if other.get("content_digest") == manifest.content_digest:
            break  # byte-identical content: moving it in alongside the holder is harmless
        if _claim_age(other) > store.claim_ttl:
            backend.delete([claim_key])  # its publisher died mid-move: take over
            continue
        time.sleep(0.2)  # a different upload is moving in: wait for its manifest
    try:
        for f in manifest.files:
            backend.promote(f"{staging}/{f.path}", f"{base}/{f.path}")
        if owns_claim:
            other = _read_json(backend.read(claim_key))
            if other is not None and other.get("upload_id") != manifest.upload_id:
                raise StoreError(f"{store.artifact_uri(version)}: another publisher took over this "
                                 f"version while it was being moved in (claim older than "
                                 f"{store.claim_ttl}); publish again")
        if backend.create_exclusive(f"{base}/{MANIFEST_NAME}", _json_bytes(manifest)):
            return manifest
        for _ in range(50):  # lost the race: the winner's manifest may still be landing (non-atomic fs)
            if (winner := store.read_manifest(version)) is not None:
                return _settle(store, winner, manifest)
            time.sleep(0.1)
        raise StoreError(f"{store.artifact_uri(version)}/{MANIFEST_NAME} exists but is not a valid "
                         f"manifest; remove it with `kiln cache rm {version}`")
    finally:
        if owns_claim:
            best_effort(lambda: backend.delete([claim_key]))


def best_effort(cleanup: Callable[[], None]) -> None:
    """Clean up without masking the real outcome; whatever is left, ``gc`` removes later."""
    try:
        cleanup()
    except StoreError:
        pass


def _settle(store: VersionStore, winner: Manifest, mine: Manifest) -> Manifest:
    if winner.content_digest == mine.content_digest:
        return winner
    raise ArtifactConflict(
        f"{store.artifact_uri(winner.engine_version)}: already published with different content "
        f"(content digest {winner.content_digest[:12]}, this upload {mine.content_digest[:12]}); "
        f"remove it with `kiln cache rm {winner.engine_version}` to publish again")


def _json_bytes(obj: Any) -> bytes:
    if isinstance(obj, BaseModel):
        return obj.model_dump_json(indent=2).encode()
    return json.dumps(obj, indent=2).encode()


def _read_json(data: bytes | None) -> dict | None:
    if data is None:
        return None
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _claim_age(claim: dict) -> timedelta:
    try:
        return now_utc() - datetime.fromisoformat(claim["created_at"])
    except (KeyError, TypeError, ValueError):
        return timedelta.max
