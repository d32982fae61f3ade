"""The artifact manifest (``engines/<version>/manifest.json``) and the store's errors.

A manifest is what makes a version exist: it lists every file with its sha256
and size, and carries a digest over that list (``content_digest``) so two
uploads of one version can tell whether they hold the same bytes.
"""

from __future__ import annotations

import hashlib
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kiln import __version__

MANIFEST_SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
CLAIM_NAME = ".publish-claim.json"
RESERVED_NAMES = frozenset({MANIFEST_NAME, CLAIM_NAME})
HASH_CHUNK = 8 * 1024 * 1024

VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class StoreError(Exception):
    """A storage problem a user can act on; ``str(e)`` is one line naming the store and the fix."""


class ArtifactNotFound(StoreError):
    """The version has no valid manifest in the store."""


class ArtifactCorrupt(StoreError):
    """A stored file's size or sha256 differs from what the manifest (or the upload) says."""


class ArtifactConflict(StoreError):
    """The version was already published with different content."""


class ManifestFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(description="path relative to the engine directory, '/'-separated")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)

    @field_validator("path")
    @classmethod
    def _relative(cls, v: str) -> str:
        parts = v.split("/")
        if not v or v.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in v:
            raise ValueError(f"unsafe file path {v!r} in manifest")
        return v


class Manifest(BaseModel):
    """``engines/<version>/manifest.json``: what a published engine version consists of."""

    # Fields a newer kiln adds are ignored; a breaking change bumps schema_version instead.
    model_config = ConfigDict(extra="ignore")
    schema_version: int = MANIFEST_SCHEMA_VERSION
    engine_version: str
    kiln_version: str = __version__
    created_at: datetime = Field(description="UTC time the publish was verified")
    upload_id: str
    envelope: dict[str, Any]
    files: list[ManifestFile] = Field(min_length=1)
    total_size: int = Field(ge=0)
    content_digest: str = Field(description="sha256 over the sorted (path, sha256, size) lines")

    @staticmethod
    def digest_of(files: list[ManifestFile]) -> str:
        lines = "".join(f"{f.sha256}  {f.size}  {f.path}\n" for f in sorted(files, key=lambda f: f.path))
        return hashlib.sha256(lines.encode()).hexdigest()

    def is_consistent(self) -> bool:
        return (self.schema_version == MANIFEST_SCHEMA_VERSION
                and self.total_size == sum(f.size for f in self.files)
                and self.content_digest == self.digest_of(self.files))


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def check_version(version: str) -> str:
    if not isinstance(version, str) or not VERSION_RE.match(version):
        raise ValueError(f"invalid engine version {version!r}: use letters, digits, '.', '_' or '-' "
                         f"(at most 128 characters, no '/')")
    return version


def now_utc() -> datetime:
    return datetime.now(UTC)


def scan_dir(src: Path) -> tuple[list[ManifestFile], dict[str, Path]]:
    """ManifestFile entries (sha256, size) for every file under ``src``, and their paths."""
    if not src.is_dir():
        raise StoreError(f"{src}: engine directory to publish does not exist or is not a directory")
    files, paths = [], {}
    for p in sorted(src.rglob("*")):
        if p.is_dir():
            continue
        rel = p.relative_to(src).as_posix()
        if rel in RESERVED_NAMES:
            raise StoreError(f"{p}: {rel!r} is reserved for the store's own use; rename it")
        files.append(ManifestFile(path=rel, sha256=file_sha256(p), size=p.stat().st_size))
        paths[rel] = p
    if not files:
        raise StoreError(f"{src}: engine directory to publish is empty")
    return files, paths


def dir_matches(dest: Path, manifest: Manifest) -> bool:
    """True when ``dest`` holds this manifest's content, every file re-hashed."""
    try:
        local = Manifest.model_validate_json((dest / MANIFEST_NAME).read_bytes())
    except (OSError, ValueError):
        return False
    if local.content_digest != manifest.content_digest:
        return False
    for f in manifest.files:
        p = dest / f.path
        if not p.is_file() or p.stat().st_size != f.size or file_sha256(p) != f.sha256:
            return False
    return True
