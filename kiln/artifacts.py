"""The artifact store: built engines under content-addressed versions, file:// or s3://.

Layout under the store root::

    engines/<version>/manifest.json        # written last; its presence *is* the version
    engines/<version>/<files...>           # the engine directory, relative paths kept
    engines/<version>/.publish-claim.json  # only while a publisher moves files in
    staging/<version>/<upload-id>/<files>  # uploads in flight (or abandoned: `gc`)
    staging/<version>/<upload-id>.heartbeat.json  # the claim holder's heartbeat, while it moves files in

A version is visible only through a manifest that parses and lists files, so a
publish killed at any point leaves nothing a reader can see. Files land in a
private staging prefix and are verified there (sha256 and size of what the
store holds), moved under ``engines/<version>/`` and then the manifest is
created last, exclusively; :mod:`kiln.artifact_claim` says how concurrent
publishers of one version are kept apart. The manifest format, the errors and
the provenance checks are in :mod:`kiln.artifact_manifest`.

Errors a user can cause (missing bucket, credentials, unreachable endpoint,
corrupt object) are :class:`StoreError` subclasses whose ``str`` is one line
naming the store and the fix; CLIs print it and exit 3.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import threading
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kiln.artifact_claim import best_effort, move_in
from kiln.artifact_manifest import (
    MANIFEST_NAME,
    VERSION_RE,
    ArtifactCorrupt,
    ArtifactExpectation,
    ArtifactNotFound,
    ArtifactUntrusted,
    BuiltBy,
    Manifest,
    StoreError,
    bytes_sha256,
    check_version,
    file_sha256,
    now_utc,
    rm_hint,
    scan_dir,
)
from kiln.cache_stamp import drop_stamp, file_state, verified_copy, write_stamp
from kiln.storage import Backend, ObjectInfo

# progress(relative_path, bytes_done, bytes_total), called repeatedly per file.
Progress = Callable[[str, int, int], None]


class ArtifactStore:
    """One interface over a :class:`kiln.storage.Backend` (file:// or s3://)."""

    def __init__(self, backend: Backend, claim_ttl: timedelta = timedelta(minutes=15)):
        self.backend = backend
        self.claim_ttl = claim_ttl

    @classmethod
    def from_uri(cls, uri: str, **backend_options: Any) -> ArtifactStore:
        """``file:///abs/path`` (or a plain path) or ``s3://bucket/prefix[?endpoint_url=..&profile=..]``.

        ``backend_options`` go to the backend (S3: ``multipart_threshold``, ``multipart_chunksize``).
        """
        if uri.startswith("s3://"):
            from kiln.storage_s3 import S3Backend

            return cls(S3Backend.from_uri(uri, **backend_options))
        if "://" in uri and not uri.startswith("file://"):
            scheme = uri.split("://", 1)[0]
            raise StoreError(f"{uri}: unsupported store scheme {scheme!r} (use file:///path or s3://bucket/prefix)")
        from kiln.storage_file import FileBackend

        return cls(FileBackend.from_uri(uri))

    @property
    def uri(self) -> str:
        return self.backend.uri

    def artifact_uri(self, version: str) -> str:
        return f"{self.uri}/engines/{check_version(version)}"

    def __repr__(self) -> str:
        return f"ArtifactStore({self.uri!r})"

    # ---- reading -------------------------------------------------------------------------
    def read_manifest(self, version: str) -> Manifest | None:
        """The version's manifest, or None when it is missing or not a valid, consistent manifest."""
        return self.read_signed_manifest(version)[0]

    def read_signed_manifest(self, version: str) -> tuple[Manifest | None, dict[str, Any] | None]:
        """The version's manifest and the document it was parsed from (what its signature covers, unknown
        fields included), read once: (None, None) when it is missing or not a valid, consistent manifest."""
        data = self.backend.read(f"engines/{check_version(version)}/{MANIFEST_NAME}")
        if data is None:
            return None, None
        try:
            document = json.loads(data)
            manifest = Manifest.model_validate(document)
        except (ValueError, ValidationError):
            return None, None
        if manifest.engine_version != version or not manifest.is_consistent():
            return None, None
        return manifest, document

    def exists(self, version: str) -> bool:
        return self.read_manifest(version) is not None

    def read_file(self, manifest: Manifest, path: str) -> bytes:
        """One small file (``engine.json``) of ``manifest``'s version as the store holds it, returned only when its
        sha256 is the one ``manifest`` lists (check the manifest first: signature, pin); ArtifactCorrupt naming the
        object and the fix when it is not listed, missing or different."""
        version = check_version(manifest.engine_version)
        entry = next((f for f in manifest.files if f.path == path), None)
        key = f"engines/{version}/{path}"
        data = self.backend.read(key) if entry is not None else None
        if entry is not None and data is not None and bytes_sha256(data) == entry.sha256:
            return data
        found = ("not listed in its manifest" if entry is None else "missing" if data is None
                 else f"corrupt: sha256 {bytes_sha256(data)}, the manifest says {entry.sha256}")
        raise ArtifactCorrupt(f"{self.uri}/{key}: {found}; re-publish with {rm_hint(self.uri, version)} and a rebuild")

    def list_versions(self) -> list[Manifest]:
        """Every published (valid) version, oldest first."""
        found = []
        for name in self.backend.list_dirs("engines/"):
            if VERSION_RE.match(name) and (m := self.read_manifest(name)) is not None:
                found.append(m)
        return sorted(found, key=lambda m: (m.created_at, m.engine_version))

    def not_found(self, version: str) -> ArtifactNotFound:
        return ArtifactNotFound(f"{self.uri}: engine version {version!r} is not in the store "
                                f"(see `kiln cache ls --store {self.uri}`)")

    def fetch(self, version: str, dest_dir: str | Path, progress: Progress | None = None,
              expect: ArtifactExpectation | None = None, verifier: Any = None) -> Path:
        """Download and verify every file, then move the directory into place as ``dest_dir``.

        ``dest_dir`` also receives ``manifest.json``. If it already holds this version
        (same content digest) and its files verify, nothing is downloaded. With ``verifier``
        (a :class:`kiln.signing.Verifier`), a manifest not signed by its key raises
        :class:`ArtifactUntrusted` before any file is downloaded or opened; with ``expect``, so does
        a manifest that does not match it. The files are then checked against that same manifest.
        """
        manifest, document = self.read_signed_manifest(version)
        if manifest is None:
            raise self.not_found(version)
        if verifier is not None and (problem := verifier.problem(document)) is not None:
            raise ArtifactUntrusted(
                f"{self.artifact_uri(version)}: refusing this artifact: {problem}. Only engines signed by the "
                "verify key are served; rebuild it with the matching signing key (docs/operator-trust.md)")
        if expect is not None and (problem := expect.mismatch(manifest)) is not None:
            raise ArtifactUntrusted(
                f"{self.artifact_uri(version)}: refusing this artifact: {problem}; it was published by someone "
                "other than the build the operator checked. Ask the cluster admin; the LLMEngine's status "
                "says what the operator found")
        dest = Path(dest_dir).absolute()
        if verified_copy(dest, manifest):  # by its stamp (stat only) when no file changed since, else re-hashed
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        _remove_dead_fetches(dest)
        tmp = dest.parent / f".{dest.name}.fetch-{uuid.uuid4().hex[:8]}"
        lock = _hold_lock(tmp.with_name(tmp.name + ".lock"))
        verified: dict[str, Any] = {}  # each file's state before it was hashed: the stamp vouches for that state
        try:
            for f in manifest.files:
                local = tmp / f.path
                local.parent.mkdir(parents=True, exist_ok=True)
                key = f"engines/{version}/{f.path}"
                self.backend.download(key, local, _file_progress(progress, f.path, f.size), size=f.size)
                verified[f.path] = file_state(local)
                size = local.stat().st_size
                digest = file_sha256(local)
                if size != f.size or digest != f.sha256:
                    raise ArtifactCorrupt(
                        f"{self.uri}/{key}: corrupt: manifest says sha256 {f.sha256} ({f.size} bytes), "
                        f"downloaded sha256 {digest} ({size} bytes); re-publish with "
                        f"{rm_hint(self.uri, version)} and a rebuild")
            (tmp / MANIFEST_NAME).write_text(manifest.model_dump_json(indent=2))
            drop_stamp(dest)
            _replace_dir(tmp, dest)
            write_stamp(dest, manifest, verified)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            Path(lock.name).unlink(missing_ok=True)
            lock.close()
        return dest

    # ---- writing -------------------------------------------------------------------------
    def publish(self, version: str, src_dir: str | Path, envelope: dict,
                progress: Progress | None = None, built_by: BuiltBy | None = None,
                signer: Any = None) -> Manifest:
        """Upload ``src_dir`` as ``version``: staging -> verify -> sign -> move in -> manifest last.

        ``built_by`` is recorded in the manifest (who built it; see :class:`BuiltBy`); ``signer`` (a
        :class:`kiln.signing.Signer`) signs it, file digests, envelope and ``built_by`` included.
        A no-op returning the existing manifest when the version is already published.
        Raises :class:`ArtifactConflict` when another publisher won with different content.
        """
        check_version(version)
        existing = self.read_manifest(version)
        if existing is not None:
            return existing
        files, paths = scan_dir(Path(src_dir))
        upload_id = f"{now_utc():%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:8]}"
        staging = f"staging/{version}/{upload_id}"
        try:
            for f in files:
                self.backend.upload(paths[f.path], f"{staging}/{f.path}", _file_progress(progress, f.path, f.size))
            for f in files:
                self.backend.verify_upload(paths[f.path], f"{staging}/{f.path}", f.sha256, f.size)
            manifest = Manifest(engine_version=version, created_at=now_utc(), upload_id=upload_id,
                                envelope=dict(envelope), files=files, total_size=sum(f.size for f in files),
                                content_digest=Manifest.digest_of(files), built_by=built_by)
            if signer is not None:
                manifest = manifest.signed_by(signer)
            return move_in(self, version, staging, manifest)
        finally:
            best_effort(lambda: self.backend.delete([o.key for o in self.backend.list(staging + "/")]))

    def delete(self, version: str) -> list[str]:
        """Remove a version: manifest first (it vanishes atomically for readers), then its files."""
        base = f"engines/{check_version(version)}"
        objects = self.backend.list(base + "/")
        if not objects:
            raise self.not_found(version)
        manifest_key = f"{base}/{MANIFEST_NAME}"
        self.backend.delete([manifest_key])
        rest = [o.key for o in objects if o.key != manifest_key]
        self.backend.delete(rest)
        return [manifest_key] + rest

    def gc(self, staging_older_than: timedelta) -> list[str]:
        """Remove staging uploads and manifest-less ``engines/<v>/`` files untouched for that long.

        Returns the removed prefixes (``staging/<v>/<upload-id>/``, ``engines/<v>/``) and
        any aborted S3 multipart uploads. The threshold must exceed the longest single upload.
        """
        cutoff = now_utc() - staging_older_than
        removed: list[str] = []
        groups: dict[str, list[ObjectInfo]] = {}
        for o in self.backend.list("staging/"):
            parts = o.key.split("/")
            prefix = "/".join(parts[:3]) + "/" if len(parts) > 3 else o.key
            groups.setdefault(prefix, []).append(o)
        for name in self.backend.list_dirs("engines/"):
            if not (VERSION_RE.match(name) and self.exists(name)):
                groups[f"engines/{name}/"] = self.backend.list(f"engines/{name}/")
        for prefix, objects in sorted(groups.items()):
            if objects and max(o.modified for o in objects) < cutoff:
                self.backend.delete([o.key for o in objects])
                removed.append(prefix)
        removed += self.backend.abort_uploads("staging/", cutoff)
        return removed


STORE_ENV = "KILN_STORE_URI"  # the artifact store's one name: the operator's, its build Jobs', every kiln command's
STORE_ENV_ALIAS = "KILN_STORE"  # the name kiln up and kiln cache read first; still read, where it agrees


def store_from_env() -> str | None:
    """``$KILN_STORE_URI``, else ``$KILN_STORE``; None where neither is set. Both set to different stores is a
    ValueError naming both: which one a command would use (and a ``kiln cache rm`` remove from) is no guess."""
    uri, alias = (os.environ.get(name, "").strip() for name in (STORE_ENV, STORE_ENV_ALIAS))
    if uri and alias and uri != alias:
        raise ValueError(f"${STORE_ENV}={uri} and ${STORE_ENV_ALIAS}={alias} name different artifact stores; "
                         f"unset ${STORE_ENV_ALIAS} (kiln reads either name) or pass --store")
    return uri or alias or None


def default_store_uri() -> str:
    """The store the environment names (:func:`store_from_env`), else a file:// store under the user's cache dir
    (what ``kiln up`` and ``kiln cache`` use)."""
    if uri := store_from_env():
        return uri
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return f"file://{(base / 'kiln' / 'store').absolute().as_posix()}"


def parse_artifact_uri(uri: str, **backend_options: Any) -> tuple[ArtifactStore, str]:
    """Inverse of :meth:`ArtifactStore.artifact_uri`: ``<store>/engines/<version>[?query]``."""
    base, sep, query = uri.partition("?")
    store_uri, marker, version = base.rstrip("/").rpartition("/engines/")
    if not marker or not VERSION_RE.match(version):
        raise StoreError(f"{uri}: not an artifact URI (expected <store>/engines/<version>, "
                         f"e.g. s3://bucket/prefix/engines/llama-0123456789ab)")
    return ArtifactStore.from_uri(store_uri + sep + query, **backend_options), version


def _file_progress(progress: Progress | None, path: str, total: int) -> Callable[[int], None] | None:
    """Adapt per-chunk byte counts from a backend to cumulative ``progress(path, done, total)``."""
    if progress is None:
        return None
    done = 0
    lock = threading.Lock()  # S3 multipart transfers report from several threads

    def step(n: int) -> None:
        nonlocal done
        with lock:
            done += n
            progress(path, done, total)

    return step


def _hold_lock(path: Path):
    """An open file holding an exclusive lock on ``path`` while its fetch runs: the kernel drops the lock when
    the process dies, however it dies, which is how a later fetch tells a dead fetch's folder from a live one."""
    f = open(path, "w")  # noqa: SIM115 - held for the fetch, closed by it
    fcntl.flock(f, fcntl.LOCK_EX)
    return f


def _remove_dead_fetches(dest: Path) -> None:
    """Remove the temporary folders of fetches of ``dest`` whose process died (a pod killed mid-download):
    their lock is free. A live fetch's lock is held, so its folder stays."""
    for lock_path in dest.parent.glob(f".{dest.name}.fetch-*.lock"):
        with open(lock_path, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live fetch
            shutil.rmtree(lock_path.with_suffix(""), ignore_errors=True)
            lock_path.unlink(missing_ok=True)
    for folder in dest.parent.glob(f".{dest.name}.fetch-*"):  # from before fetches held a lock
        if folder.is_dir() and not folder.with_name(folder.name + ".lock").exists():
            shutil.rmtree(folder, ignore_errors=True)


def _replace_dir(tmp: Path, dest: Path) -> None:
    """Move ``tmp`` to ``dest``; an existing ``dest`` is swapped out first, then removed."""
    old = None
    if dest.exists():
        old = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:8]}"
        dest.rename(old)
    tmp.rename(dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
