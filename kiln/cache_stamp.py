"""A local copy's verification stamp: what lets a later load of the local artifact cache skip re-hashing it.

:meth:`kiln.artifacts.ArtifactStore.fetch` checks every file of a copy against the store's manifest (sha256 and
size) when it downloads it, and re-hashes a copy it finds already in place. Once a copy's files are verified, a
stamp beside it (``<cache>/.<version>.verified.json``, written atomically) records the manifest's content digest
and, per file, the sha256 it was checked against and what ``stat`` says of it then: size, ``mtime_ns``,
``ctime_ns`` and inode. A later fetch of the same version whose files all still match their stamp (``stat``
only) trusts the copy; any difference (another content digest, a file written, truncated, replaced or touched,
a stamp missing or torn) re-hashes every file, as before. The store manifest's signature, the operator's
expectation and the pinned content digest are checked on every fetch, stamp or not.

What it protects, and what not (docs/performance.md, "Loading from the local cache"): a file changed through the
filesystem after it was verified (a partial copy, an editor, a replaced file, a restored backup) changes its
``ctime`` (the kernel sets it on every write, truncate, rename onto it, chmod or utime, and no system call sets it
back) or its inode, so it is re-hashed. It does not protect against someone with write access to the cache:
they can rewrite the stamp as well as the files. Nor against corruption below the filesystem (a failing disk),
which changes no metadata. This is the trust the Hugging Face hub and vLLM give their caches, which re-hash
nothing at load; who may write the cache is a deployment's choice (a pod's own volume).
"""

from __future__ import annotations

import json
import os
import stat
import uuid
from pathlib import Path
from typing import Any

from kiln.artifact_manifest import MANIFEST_NAME, Manifest, dir_matches

STAMP_FORMAT = 1
MAX_STAMP_BYTES = 16 * 1024 * 1024  # a stamp is a few hundred bytes per file


def stamp_path(dest: Path) -> Path:
    """Beside the copy (never inside it: the copy holds the manifest's files and its manifest, nothing else)."""
    return dest.parent / f".{dest.name}.verified.json"


def file_state(path: Path) -> dict[str, int] | None:
    """What a stamp records of a file: None when it is not a regular file (or is gone)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino}


def stamp_matches(dest: Path, manifest: Manifest) -> bool:
    """True when ``dest``'s stamp is this manifest's and every file still matches it (``stat`` only)."""
    try:
        raw = stamp_path(dest).read_bytes()
        stamp = json.loads(raw) if len(raw) <= MAX_STAMP_BYTES else None
        local = Manifest.model_validate_json((dest / MANIFEST_NAME).read_bytes())
    except (OSError, ValueError):
        return False
    if (not isinstance(stamp, dict) or stamp.get("format") != STAMP_FORMAT
            or stamp.get("content_digest") != manifest.content_digest
            or local.content_digest != manifest.content_digest or not isinstance(stamp.get("files"), dict)):
        return False
    for f in manifest.files:
        entry = stamp["files"].get(f.path)
        if not isinstance(entry, dict) or entry.get("sha256") != f.sha256 or entry.get("size") != f.size:
            return False
        state = file_state(dest / f.path)
        if state is None or state != entry.get("state") or state["size"] != f.size:
            return False
    return True


def states(dest: Path, manifest: Manifest) -> dict[str, dict[str, int] | None]:
    return {f.path: file_state(dest / f.path) for f in manifest.files}


def write_stamp(dest: Path, manifest: Manifest, verified: dict[str, dict[str, int] | None]) -> bool:
    """Stamp ``dest`` with ``verified``: each file's state taken before its sha256 was checked against
    ``manifest``. Written only when every file is still in that state (one written since is re-hashed next
    time), atomically (a stamp half-written by a killed process is never read as whole). False: not written."""
    recorded = {f.path: verified.get(f.path) for f in manifest.files}
    if any(recorded[f.path] is None or recorded[f.path]["size"] != f.size for f in manifest.files):
        return False
    if states(dest, manifest) != recorded:
        return False
    doc: dict[str, Any] = {"format": STAMP_FORMAT, "content_digest": manifest.content_digest,
                           "files": {f.path: {"sha256": f.sha256, "size": f.size, "state": verified[f.path]}
                                     for f in manifest.files}}
    path = stamp_path(dest)
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)
    except OSError:  # a read-only cache: every load re-hashes, as before
        tmp.unlink(missing_ok=True)
        return False
    return True


def drop_stamp(dest: Path) -> None:
    """Before a copy is replaced or repaired: its old stamp must never vouch for what comes next."""
    stamp_path(dest).unlink(missing_ok=True)


def verified_copy(dest: Path, manifest: Manifest) -> bool:
    """Whether ``dest`` holds this manifest's content: by its stamp when every file matches it, else by re-hashing
    every file (``dir_matches``), stamping the copy when that passes and no file changed while it was hashed."""
    if stamp_matches(dest, manifest):
        return True
    before = states(dest, manifest)
    if not dir_matches(dest, manifest):
        return False
    write_stamp(dest, manifest, before)
    return True
