"""The artifact manifest (``engines/<version>/manifest.json``) and the store's errors.

A manifest is what makes a version exist: it lists every file with its sha256
and size, and carries a digest over that list (``content_digest``) so two
uploads of one version can tell whether they hold the same bytes.

It also records who built the artifact (``built_by``: the builder image the
operator ran and the operator's identity), and an :class:`ArtifactExpectation`
is what a reader that knows what it wants (a serving pod the operator started)
checks a manifest against before using any of its files. See
docs/operator-trust.md.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
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

VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")  # an adapter's is up to 226 (kiln.envelope)
# The operator tells a build container who is building (JSON of BuiltBy) ...
BUILT_BY_ENV = "KILN_BUILT_BY"
# ... and a serving container which artifact it verified (JSON of ArtifactExpectation).
EXPECT_ENV = "KILN_EXPECT_ARTIFACT"


class StoreError(Exception):
    """A storage problem a user can act on; ``str(e)`` is one line naming the store and the fix."""


class ArtifactNotFound(StoreError):
    """The version has no valid manifest in the store."""


class ArtifactCorrupt(StoreError):
    """A stored file's size or sha256 differs from what the manifest (or the upload) says."""


class ArtifactConflict(StoreError):
    """The version was already published with different content."""


class ArtifactUntrusted(StoreError):
    """The manifest is not the one the reader was told to expect (other builder, other content)."""


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


class BuiltBy(BaseModel):
    """Who published an artifact: what the operator ran the build with, as the operator stated it."""

    model_config = ConfigDict(extra="ignore")
    builder_image: str = Field(min_length=1, description="image reference of the build container")
    builder_image_digest: str | None = Field(
        default=None, description="sha256:... when the reference is pinned by digest")
    operator: str = Field(min_length=1, description="identity of the operator that created the build Job")

    @classmethod
    def of(cls, builder_image: str, operator: str) -> BuiltBy:
        digest = builder_image.partition("@")[2] or None
        return cls(builder_image=builder_image, builder_image_digest=digest, operator=operator)

    def describe(self) -> str:
        return f"image {self.builder_image} via operator {self.operator}"


def _from_env_json(cls: type[BaseModel], env: Mapping[str, str], name: str) -> Any:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        return cls.model_validate_json(raw)
    except ValueError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise StoreError(f"${name} is not a valid {cls.__name__} JSON document ({first}); it is set by the "
                         "kiln operator: run matching operator and kiln images") from None


def built_by_from_env(env: Mapping[str, str]) -> BuiltBy | None:
    """What the operator says about this build (``$KILN_BUILT_BY``); None outside the operator."""
    return _from_env_json(BuiltBy, env, BUILT_BY_ENV)


class ArtifactExpectation(BaseModel):
    """What the operator verified about an artifact before pointing pods at it."""

    model_config = ConfigDict(extra="forbid")
    built_by: BuiltBy
    content_digest: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ArtifactExpectation | None:
        """``$KILN_EXPECT_ARTIFACT``; None when unset (``kiln up``, ``kiln serve`` by hand: no check)."""
        return _from_env_json(cls, env, EXPECT_ENV)

    def to_env(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def mismatch(self, manifest: Manifest) -> str | None:
        """One line saying what differs between ``manifest`` and this expectation; None when it matches."""
        got = manifest.built_by
        if got is None:
            return (f"its manifest records no builder, the operator expected one built by "
                    f"{self.built_by.describe()}")
        for key in ("operator", "builder_image", "builder_image_digest"):
            want, have = getattr(self.built_by, key), getattr(got, key)
            if want != have:
                return f"manifest built_by.{key} is {have!r}, the operator expected {want!r}"
        if self.content_digest is not None and manifest.content_digest != self.content_digest:
            return (f"manifest content_digest is {manifest.content_digest[:16]}..., the operator verified "
                    f"{self.content_digest[:16]}... (the artifact was replaced after the operator checked it)")
        return None


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
    built_by: BuiltBy | None = Field(default=None, description="who built it; None: published outside "
                                     "the operator (kiln up, kiln build by hand)")
    signature: dict[str, str] | None = Field(
        default=None, description="the publisher's signature over the rest of this document (kiln.signing); "
                                  "None: published without a signing key")

    def signed_by(self, signer: Any) -> Manifest:
        """This manifest with ``signer``'s (a :class:`kiln.signing.Signer`) signature over the rest of it."""
        return self.model_copy(update={"signature": signer.sign(self.model_dump(mode="json"))})

    @staticmethod
    def digest_of(files: list[ManifestFile]) -> str:
        lines = "".join(f"{f.sha256}  {f.size}  {f.path}\n" for f in sorted(files, key=lambda f: f.path))
        return hashlib.sha256(lines.encode()).hexdigest()

    def is_consistent(self) -> bool:
        return (self.schema_version == MANIFEST_SCHEMA_VERSION
                and self.total_size == sum(f.size for f in self.files)
                and self.content_digest == self.digest_of(self.files))


def bytes_sha256(data: bytes) -> str:
    """The digest :func:`file_sha256` gives a file holding ``data``."""
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def check_version(version: str) -> str:
    if not isinstance(version, str) or not VERSION_RE.match(version):
        raise ValueError(f"invalid engine version {version!r}: use letters, digits, '.', '_' or '-' "
                         f"(at most 255 characters, no '/')")
    return version


def rm_hint(store_uri: str, key_or_version: str) -> str:
    """``kiln cache rm VERSION --store URI``: every hint to remove a version names its store, so that following
    it removes that copy and never a healthy one from the store ``$KILN_STORE_URI`` names. ``key_or_version``:
    a version, or an object key under ``engines/VERSION/``."""
    parts = key_or_version.split("/")
    version = parts[1] if parts[0] == "engines" and len(parts) > 2 else "<version>" if "/" in key_or_version \
        else key_or_version
    return f"`kiln cache rm {version} --store {store_uri}`"


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
