"""ArtifactStore.read_file: one small file of a version, returned only when its sha256 is the manifest's (what the
operator reads an engine's measured memory from, for an engine pool)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kiln.artifact_manifest import ArtifactCorrupt
from kiln.artifacts import ArtifactStore

VERSION = "llama-tiny-0123456789ab"
ENVELOPE = {"format_version": 1, "model": "file:///models/llama", "dtype": "float32"}


@pytest.fixture
def published(tmp_path: Path) -> ArtifactStore:
    src = tmp_path / "engine"
    (src / "weights").mkdir(parents=True)
    (src / "engine.json").write_text(json.dumps({"format_version": 1, "kv_plan": {"weight_bytes_per_rank": 7}}))
    (src / "weights" / "rank-0-of-1.safetensors").write_bytes(b"w" * 4096)
    store = ArtifactStore.from_uri((tmp_path / "store").as_uri())
    store.publish(VERSION, src, ENVELOPE)
    return store


def test_read_file_returns_a_listed_file_whose_sha256_matches(published: ArtifactStore):
    manifest = published.read_manifest(VERSION)
    assert manifest is not None
    assert json.loads(published.read_file(manifest, "engine.json"))["kv_plan"] == {"weight_bytes_per_rank": 7}


def test_read_file_refuses_a_changed_missing_or_unlisted_file_naming_the_object(published: ArtifactStore):
    manifest = published.read_manifest(VERSION)
    assert manifest is not None
    key = f"engines/{VERSION}/engine.json"
    published.backend.write(key, json.dumps({"format_version": 1, "kv_plan": {"weight_bytes_per_rank": 1}}).encode())
    # The hint names the store: following it removes this copy, never a healthy one from $KILN_STORE_URI's store.
    hint = re.escape(f"`kiln cache rm {VERSION} --store {published.uri}`")
    with pytest.raises(ArtifactCorrupt, match=rf"{key}: corrupt: sha256 .*the manifest says .*{hint}"):
        published.read_file(manifest, "engine.json")
    published.backend.delete([key])
    with pytest.raises(ArtifactCorrupt, match=rf"{key}: missing"):
        published.read_file(manifest, "engine.json")
    with pytest.raises(ArtifactCorrupt, match="not listed in its manifest"):
        published.read_file(manifest, "build_report.json")
