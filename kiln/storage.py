"""The few primitives an artifact-store backend provides (file:// and s3:// implement them).

Keys are '/'-separated and relative to the store root. Policy (staging, claims,
manifests, verification against the manifest) lives in :mod:`kiln.artifacts`;
a backend only moves bytes and reports what it holds, translating its own
failures into one-line :class:`kiln.artifact_manifest.StoreError` messages.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import NamedTuple, Protocol

# Called with the number of bytes moved since the previous call.
ByteCallback = Callable[[int], None]
# The most ``read`` returns: the objects read whole (manifests, claims, engine.json) are a few KB, and a store
# writer must not make a reader hold more in memory before its signature is checked.
MAX_READ_BYTES = 16 * 1024 * 1024


class ObjectInfo(NamedTuple):
    key: str
    size: int
    modified: datetime  # timezone-aware UTC


class Backend(Protocol):
    uri: str  # canonical store URI without query, e.g. "s3://bucket/prefix" or "file:///abs/path"

    def upload(self, local: Path, key: str, progress: ByteCallback | None) -> None: ...

    def verify_upload(self, local: Path, key: str, sha256: str, size: int) -> None:
        """Raise ArtifactCorrupt unless the stored object has exactly this size and sha256."""

    def token(self, key: str) -> str | None:
        """What the object at ``key`` is now (an ETag, an inode and mtime), or None when there is none; changes
        whenever the object is replaced."""

    def promote(self, src_key: str, dst_key: str, expected: str | None) -> bool:
        """Move (or copy) a verified staging object to its published key only if what is there is still
        ``expected`` (a :meth:`token`; None: nothing); False, moving nothing, if it is not. A publisher that lost
        its claim while paused therefore cannot replace what the claim's new holder moved in."""

    def download(self, key: str, local: Path, progress: ByteCallback | None, size: int | None = None) -> None:
        """Copy the object to ``local``; with ``size`` (the manifest's), refuse (ArtifactCorrupt) an object of
        another size before writing, and never write more than ``size`` bytes. Never follows a symlink."""

    def read(self, key: str, limit: int = MAX_READ_BYTES) -> bytes | None:
        """The object's bytes, or None when it does not exist; ArtifactCorrupt when it holds more than ``limit``."""

    def create_exclusive(self, key: str, data: bytes) -> bool:
        """Create the object with ``data`` only if no object exists there; False if one does."""

    def write(self, key: str, data: bytes) -> None:
        """Create or replace the (small) object with ``data``, whole: readers see the old bytes or the new."""

    def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object under ``prefix`` (recursively)."""

    def list_dirs(self, prefix: str) -> list[str]:
        """Names of the immediate 'subdirectories' under ``prefix``."""

    def delete(self, keys: list[str]) -> None:
        """Delete these objects; missing ones are ignored."""

    def abort_uploads(self, prefix: str, older_than: datetime) -> list[str]:
        """Abort incomplete multipart uploads under ``prefix`` started before ``older_than``."""
