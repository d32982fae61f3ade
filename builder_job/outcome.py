"""What a build command answers and who publishes, shared by ``kiln build`` (:mod:`kiln.builder.cli`) and
``kiln build-adapter`` (:mod:`kiln.builder.adapter.command`): the :class:`BuildOutcome`, the publisher (who
built it, the signer) and the cache-hit check. Imports no torch: the cache-hit path answers in seconds."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.builder.errors import EXIT_OK, ArtifactMismatch, InvalidSpec, StorageFailure

from kiln.artifact_manifest import BuiltBy, StoreError, built_by_from_env, rm_hint
from kiln.artifacts import ArtifactStore
from kiln.envelope import envelope_mismatch
from kiln.signing import Signer, SigningError, signer_from


@dataclass
class BuildOutcome:
    exit_code: int
    version: str | None = None
    artifact_uri: str | None = None
    cache_hit: bool = False
    message: str = ""
    build_report: dict = field(default_factory=dict)


def publisher(signing_key: str | Path | None) -> tuple[BuiltBy | None, Signer | None]:
    """Who publishes: ``built_by`` (``$KILN_BUILT_BY``) and the signer (``--signing-key``, ``$KILN_SIGNING_KEY``)."""
    try:
        return built_by_from_env(os.environ), signer_from(signing_key)
    except (StoreError, SigningError) as exc:
        raise InvalidSpec(str(exc)) from None


def check_hit(store: Any, version: str, stored: dict[str, Any], expected: dict[str, Any]) -> None:
    """A cache hit is one only when the whole envelope matches, not the version alone."""
    if (problem := envelope_mismatch(stored, expected)) is not None:
        raise ArtifactMismatch(f"{store.artifact_uri(version)} holds another engine under this version: {problem}; "
                               f"it is not reused. Remove it ({rm_hint(store.uri, version)}) and "
                               "build again")


def cached(store_uri: str, version: str, expected: dict[str, Any]) -> tuple[ArtifactStore, BuildOutcome | None]:
    """The store, and the cache hit's outcome when ``version`` is already there with the ``expected`` envelope
    (another envelope under it is refused, :func:`check_hit`); None: build it."""
    try:
        store = ArtifactStore.from_uri(store_uri)
        hit = store.read_manifest(version)
    except StoreError as exc:
        raise StorageFailure(str(exc)) from None
    if hit is None:
        return store, None
    check_hit(store, version, hit.envelope, expected)
    return store, BuildOutcome(EXIT_OK, version, store.artifact_uri(version), cache_hit=True,
                               message=f"cache hit: {version}")
