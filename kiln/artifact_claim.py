"""Moving a verified upload in as ``engines/<version>/``: who may write a version's files, and who wins.

A version's manifest is created with an exclusive create (``O_EXCL``-style link on disk, a
conditional ``If-None-Match: *`` put on S3), so two publishers cannot clobber each other's
manifest. They could still overwrite each other's *files* while moving them in; the
short-lived claim object ``engines/<version>/.publish-claim.json`` prevents that: only the
claim holder, or a publisher with byte-identical content (same content digest), moves files
into ``engines/<version>/``; a publisher with different content waits for the holder's
manifest and then raises :class:`ArtifactConflict`.

The holder heartbeats while it holds the claim: a background thread rewrites
``staging/<version>/<upload-id>.heartbeat.json`` every quarter of the store's ``claim_ttl`` with a
count of its renewals (the claim itself is never rewritten, so a heartbeat cannot clobber a claim
someone else took). A waiting publisher times the holder's silence by its *own* monotonic clock:
from when it first saw the claim and the heartbeat as they are now (:class:`Silence`); a claim
unchanged for ``claim_ttl`` belongs to a dead (or paused) publisher and is taken over. No two
hosts' clocks are compared; the stamps in the records are for people.

Before each file it moves in and before the manifest, a publisher checks that the claim is
still its own (or still its content's); if it is not, it stops with :class:`ClaimLost` and
creates no manifest, so nothing becomes visible. A publisher paused *between* that check and
its move (past ``claim_ttl``, so its claim was taken over) must not then replace the new
holder's file: each move is conditional on the destination being what the publisher read back
*before* its check (:meth:`kiln.storage.Backend.promote`: nothing there, or the same token), so
whatever the new holder moved in meanwhile makes the stale move fail, and its next check stops it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

from pydantic import BaseModel

from kiln.artifact_manifest import CLAIM_NAME, MANIFEST_NAME, ArtifactConflict, Manifest, StoreError, now_utc, rm_hint
from kiln.storage import Backend

HEARTBEAT_SUFFIX = ".heartbeat.json"
MOVE_TRIES = 5  # a move whose destination changed is retried, the claim checked again each time
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
    try:
        if (winner := _wait_for_claim(store, claim, manifest)) is not None:
            return winner
        for f in manifest.files:
            _move_file(claim, f"{staging}/{f.path}", f"{base}/{f.path}")
        claim.check()
        if backend.create_exclusive(f"{base}/{MANIFEST_NAME}", _json_bytes(manifest)):
            return manifest
        for _ in range(50):  # lost the race: the winner's manifest may still be landing (non-atomic fs)
            if (winner := store.read_manifest(version)) is not None:
                return _settle(store, winner, manifest)
            time.sleep(0.1)
        raise StoreError(f"{store.artifact_uri(version)}/{MANIFEST_NAME} exists but is not a valid "
                         f"manifest; remove it with {rm_hint(store.uri, version)}")
    finally:
        claim.release()


def _wait_for_claim(store: VersionStore, claim: Claim, manifest: Manifest) -> Manifest | None:
    """Hold the claim (or join a holder of the same content); the manifest that won instead, if one did."""
    backend, version, silence, said_waiting = store.backend, claim.version, Silence(), False
    while True:
        if (winner := store.read_manifest(version)) is not None:
            return _settle(store, winner, manifest)
        if claim.take():
            # A holder may have created its manifest and let go between the first look and the take: moving in
            # now would replace the files that manifest vouches for (a fetch then finds them corrupt).
            if (winner := store.read_manifest(version)) is not None:
                claim.release()
                return _settle(store, winner, manifest)
            return None
        raw = backend.read(claim.key)
        if (other := _read_json(raw)) is None:
            continue  # the holder just finished or gave up: look again
        if other.get("content_digest") == manifest.content_digest:
            return None  # byte-identical content: moving it in alongside the holder is harmless
        quiet = silence.seconds((raw, _heartbeat_of(backend, version, other)))
        if quiet > store.claim_ttl.total_seconds():
            backend.delete([claim.key])  # its publisher died (or is paused) mid-move: take over
            continue
        if not said_waiting:  # otherwise a publish behind a dead publisher's claim waits up to claim_ttl in silence
            said_waiting = True
            log.warning("%s: upload %r holds the publish claim; waiting for its manifest, or until it has been "
                        "silent for claim_ttl %s (by this host's clock) and the claim is taken over. If that "
                        "publisher is dead (killed mid-publish), `kiln cache gc --staging-older-than 1m` removes "
                        "what it left", store.artifact_uri(version), other.get("upload_id"), store.claim_ttl)
        time.sleep(0.2)  # a different upload is moving in: wait for its manifest


def _move_file(claim: Claim, src: str, dst: str) -> None:
    """Move one file in while the claim is this publisher's. The destination's token is read *before* the check,
    so a publisher paused after its check moves nothing over what the claim's new holder wrote meanwhile."""
    for _ in range(MOVE_TRIES):
        expected = claim.backend.token(dst)
        claim.check()
        if claim.backend.promote(src, dst, expected):
            return
    raise ClaimLost(f"{claim.store.artifact_uri(claim.version)}: {dst} kept changing while this publisher held "
                    "the claim (another publisher still writing there); no manifest was created: publish again")


class Silence:
    """How long a claim's holder has been silent by this publisher's own monotonic clock: since it first saw the
    claim and the holder's heartbeat as they are now. Skewed or frozen clocks elsewhere do not matter."""

    def __init__(self) -> None:
        self.state: Any = object()
        self.since = time.monotonic()

    def seconds(self, state: Any) -> float:
        now = time.monotonic()
        if state != self.state:
            self.state, self.since = state, now
        return now - self.since


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
        self.failures = self.beats = 0
        self._stop = threading.Event()
        self.beat()
        self._thread = threading.Thread(target=self._run, name=f"kiln-claim-heartbeat-{upload_id}", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        self.beats += 1  # what a waiting publisher sees change; refreshed_at is for people
        record = {"upload_id": self.upload_id, "beats": self.beats, "refreshed_at": now_utc().isoformat()}
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
        f"remove it with {rm_hint(store.uri, winner.engine_version)} to publish again")


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


def _heartbeat_of(backend: Backend, version: str, claim: dict) -> bytes | None:
    """The claim's holder's heartbeat object as it is now (None without one)."""
    upload_id = claim.get("upload_id")
    if isinstance(upload_id, str) and upload_id and "/" not in upload_id:
        return backend.read(_heartbeat_key(version, upload_id))
    return None
