"""Moving a verified upload in as ``engines/<version>/``: who may write a version's files, and who wins.

A version's manifest is created with an exclusive create (``O_EXCL``-style link on disk, a
conditional ``If-None-Match: *`` put on S3), so two publishers cannot clobber each other's
manifest. They could still overwrite each other's *files* while moving them in; the
short-lived claim object ``engines/<version>/.publish-claim.json`` prevents that: only the
claim holder, or a publisher with byte-identical content (same content digest), moves files
into ``engines/<version>/``; a publisher with different content waits for the holder's
manifest and then raises :class:`ArtifactConflict`.

The holder heartbeats while it holds the claim: a background thread rewrites
``staging/<version>/<upload-id>.heartbeat.json`` every quarter of the store's ``claim_ttl``
(the claim itself is never rewritten, so a heartbeat cannot clobber a claim someone else took).
A claim whose holder has not been heard from (claim created, or last heartbeat) for ``claim_ttl``
belongs to a dead publisher and is taken over. Before each file it moves in and before the
manifest, a publisher checks that the claim is still its own (or still its content's); if it
is not, it stops with :class:`ClaimLost` and creates no manifest, so nothing becomes visible.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, Protocol

from pydantic import BaseModel

from kiln.artifact_manifest import CLAIM_NAME, MANIFEST_NAME, ArtifactConflict, Manifest, StoreError, now_utc
from kiln.storage import Backend

HEARTBEAT_SUFFIX = ".heartbeat.json"
log = logging.getLogger("kiln.artifacts")


class ClaimLost(StoreError):
    """This publisher's claim on a version was taken over (or removed) while it moved files in."""


class VersionStore(Protocol):
    """What moving in needs of :class:`kiln.artifacts.ArtifactStore`."""

    backend: Backend
    claim_ttl: timedelta

    def read_manifest(self, version: str) -> Manifest | None: ...

    def artifact_uri(self, version: str) -> str: ...


def move_in(store: VersionStore, version: str, staging: str, manifest: Manifest) -> Manifest:
    """Promote the verified files under ``staging`` to ``engines/<version>/`` and create the manifest last.

    Returns the manifest that won: ``manifest``, or an earlier publisher's with the same content.
    Raises :class:`ArtifactConflict` when an earlier publisher won with different content, and
    :class:`ClaimLost` when this publisher lost its claim before the manifest (nothing published).
    """
    backend = store.backend
    base = f"engines/{version}"
    claim = Claim(store, version, manifest)
    said_waiting = False
    try:
        while True:
            if (winner := store.read_manifest(version)) is not None:
                return _settle(store, winner, manifest)
            if claim.take():
                break
            other = _read_json(backend.read(claim.key))
            if other is None:
                continue  # the holder just finished or gave up: look again
            if other.get("content_digest") == manifest.content_digest:
                break  # byte-identical content: moving it in alongside the holder is harmless
            age = _claim_age(backend, version, other)
            if age > store.claim_ttl:
                backend.delete([claim.key])  # its publisher died mid-move: take over
                continue
            if not said_waiting:  # otherwise a publish behind a dead publisher's claim waits up to claim_ttl in silence
                said_waiting = True
                log.warning("%s: upload %r holds the publish claim (last heard from %.0fs ago); waiting for its "
                            "manifest, or until it has been silent for claim_ttl %s and the claim is taken over. If "
                            "that publisher is dead (killed mid-publish), `kiln cache gc --staging-older-than 1m` "
                            "removes what it left",
                            store.artifact_uri(version), other.get("upload_id"), age.total_seconds(), store.claim_ttl)
            time.sleep(0.2)  # a different upload is moving in: wait for its manifest
        for f in manifest.files:
            claim.check()
            backend.promote(f"{staging}/{f.path}", f"{base}/{f.path}")
        claim.check()
        if backend.create_exclusive(f"{base}/{MANIFEST_NAME}", _json_bytes(manifest)):
            return manifest
        for _ in range(50):  # lost the race: the winner's manifest may still be landing (non-atomic fs)
            if (winner := store.read_manifest(version)) is not None:
                return _settle(store, winner, manifest)
            time.sleep(0.1)
        raise StoreError(f"{store.artifact_uri(version)}/{MANIFEST_NAME} exists but is not a valid "
                         f"manifest; remove it with `kiln cache rm {version}`")
    finally:
        claim.release()


class Claim:
    """One publisher's side of a version's claim: taking it (and heartbeating it while held), checking
    that it still holds it (or that the holder's content is its own), releasing it."""

    def __init__(self, store: VersionStore, version: str, manifest: Manifest) -> None:
        self.store, self.backend, self.version = store, store.backend, version
        self.key = f"engines/{version}/{CLAIM_NAME}"
        self.upload_id, self.digest = manifest.upload_id, manifest.content_digest
        self.heartbeat: Heartbeat | None = None  # set while this publisher holds the claim

    def take(self) -> bool:
        """Create the claim; True (and heartbeating) if this publisher now holds it."""
        record = {"upload_id": self.upload_id, "content_digest": self.digest, "created_at": now_utc().isoformat()}
        if not self.backend.create_exclusive(self.key, _json_bytes(record)):
            return False
        interval = max(self.store.claim_ttl.total_seconds() / 4, 0.05)
        self.heartbeat = Heartbeat(self.backend, _heartbeat_key(self.version, self.upload_id), self.upload_id,
                                   interval)
        return True

    def check(self) -> None:
        """Raise :class:`ClaimLost` unless the claim is still this publisher's (or, for a publisher moving in
        alongside a holder, still its content's; if the holder released it, this publisher takes it)."""
        other = _read_json(self.backend.read(self.key))
        if self.heartbeat is None and other is None:
            if self.take():
                return
            other = _read_json(self.backend.read(self.key))
        if self.heartbeat is not None:
            if other is not None and other.get("upload_id") == self.upload_id:
                return
        elif other is not None and other.get("content_digest") == self.digest:
            return
        holder = "removed" if other is None else f"now held by upload {other.get('upload_id')!r}"
        raise ClaimLost(
            f"{self.store.artifact_uri(self.version)}: lost the publish claim while moving files in (the claim "
            f"is {holder}: this publisher was not heard from for claim_ttl {self.store.claim_ttl}); no manifest "
            f"was created, so nothing was published: publish again (and check the store is reachable)")

    def release(self) -> None:
        """Stop heartbeating and remove the claim if it is still this publisher's."""
        if self.heartbeat is None:
            return
        self.heartbeat.stop()
        self.heartbeat = None
        other = best_effort(lambda: _read_json(self.backend.read(self.key)))
        if other is not None and other.get("upload_id") == self.upload_id:
            best_effort(lambda: self.backend.delete([self.key]))


class Heartbeat:
    """Rewrites the holder's heartbeat object every ``interval`` seconds from a daemon thread until stopped.
    A failed write is retried at the next beat; a claim lost meanwhile is caught by :meth:`Claim.check`."""

    def __init__(self, backend: Backend, key: str, upload_id: str, interval: float) -> None:
        self.backend, self.key, self.upload_id, self.interval = backend, key, upload_id, interval
        self.failures = 0
        self._stop = threading.Event()
        self.beat()
        self._thread = threading.Thread(target=self._run, name=f"kiln-claim-heartbeat-{upload_id}", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        record = {"upload_id": self.upload_id, "refreshed_at": now_utc().isoformat()}
        try:
            self.backend.write(self.key, _json_bytes(record))
        except StoreError:
            self.failures += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.beat()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        best_effort(lambda: self.backend.delete([self.key]))


def best_effort(cleanup: Callable[[], Any]) -> Any:
    """Clean up without masking the real outcome (None on a store error); whatever is left, ``gc`` removes
    later."""
    try:
        return cleanup()
    except StoreError:
        return None


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


def _heartbeat_key(version: str, upload_id: str) -> str:
    return f"staging/{version}/{upload_id}{HEARTBEAT_SUFFIX}"


def _claim_age(backend: Backend, version: str, claim: dict) -> timedelta:
    """How long since the claim's holder was last heard from: the claim's creation or its latest heartbeat."""
    stamps = [claim.get("created_at")]
    upload_id = claim.get("upload_id")
    if isinstance(upload_id, str) and upload_id and "/" not in upload_id:
        beat = _read_json(backend.read(_heartbeat_key(version, upload_id)))
        if beat is not None and beat.get("upload_id") == upload_id:
            stamps.append(beat.get("refreshed_at"))
    seen = []
    for stamp in stamps:
        try:
            when = datetime.fromisoformat(stamp)
        except (TypeError, ValueError):
            continue
        if when.tzinfo is not None:  # ours are UTC; a naive stamp says nothing reliable
            seen.append(when)
    return now_utc() - max(seen) if seen else timedelta.max
