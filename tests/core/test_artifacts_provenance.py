"""Artifacts record who built them, and a reader with an expectation refuses any other manifest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.artifact_manifest import (
    MANIFEST_NAME,
    ArtifactExpectation,
    ArtifactUntrusted,
    BuiltBy,
    StoreError,
    built_by_from_env,
)
from kiln.artifacts import ArtifactStore

VERSION = "tiny-0123456789ab"
DIGEST = "sha256:" + "e" * 64
OURS = BuiltBy.of(f"ghcr.io/kiln-dev/kiln@{DIGEST}", "kiln-system/kiln")


def publish(tmp_path: Path, built_by: BuiltBy | None) -> ArtifactStore:
    src = tmp_path / "src"
    (src / "weights").mkdir(parents=True)
    (src / "engine.json").write_text("{}")
    (src / "weights" / "rank-0-of-1.safetensors").write_bytes(b"w" * 100)
    store = ArtifactStore.from_uri((tmp_path / "store").as_uri())
    store.publish(VERSION, src, {"k": 1}, built_by=built_by)
    return store


def test_publish_records_the_builder_and_its_digest(tmp_path: Path):
    store = publish(tmp_path, OURS)
    manifest = store.read_manifest(VERSION)
    assert manifest.built_by == OURS and manifest.built_by.builder_image_digest == DIGEST
    raw = json.loads((tmp_path / "store" / "engines" / VERSION / MANIFEST_NAME).read_text())
    assert raw["built_by"] == {"builder_image": OURS.builder_image, "builder_image_digest": DIGEST,
                               "operator": "kiln-system/kiln"}
    assert BuiltBy.of("kiln:1", "x").builder_image_digest is None


def test_a_manifest_from_before_provenance_still_reads_as_unattributed(tmp_path: Path):
    store = publish(tmp_path, OURS)
    path = tmp_path / "store" / "engines" / VERSION / MANIFEST_NAME
    raw = json.loads(path.read_text())
    del raw["built_by"]
    path.write_text(json.dumps(raw))
    assert store.read_manifest(VERSION).built_by is None
    dest = store.fetch(VERSION, tmp_path / "out")  # no expectation (kiln up): no check
    assert (dest / "engine.json").is_file()


def test_fetch_with_an_expectation_refuses_another_builder_before_using_any_file(tmp_path: Path):
    store = publish(tmp_path, BuiltBy.of("evil.example.com/kiln:1", "kiln-system/kiln"))
    manifest = store.read_manifest(VERSION)
    expect = ArtifactExpectation(built_by=OURS, content_digest=manifest.content_digest)
    with pytest.raises(ArtifactUntrusted) as err:
        store.fetch(VERSION, tmp_path / "out", expect=expect)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{store.artifact_uri(VERSION)}: refusing this artifact")
    assert f"built_by.builder_image is 'evil.example.com/kiln:1', the operator expected '{OURS.builder_image}'" in msg
    assert not (tmp_path / "out").exists()
    matching = ArtifactExpectation(built_by=manifest.built_by, content_digest=manifest.content_digest)
    assert (store.fetch(VERSION, tmp_path / "out", expect=matching) / "engine.json").is_file()


def test_the_builder_env_is_validated_with_the_variable_named():
    assert built_by_from_env({}) is None
    assert built_by_from_env({"KILN_BUILT_BY": OURS.model_dump_json()}) == OURS
    with pytest.raises(StoreError, match=r"\$KILN_BUILT_BY is not a valid BuiltBy"):
        built_by_from_env({"KILN_BUILT_BY": '{"operator": "x"}'})
    with pytest.raises(StoreError, match=r"\$KILN_EXPECT_ARTIFACT is not a valid ArtifactExpectation"):
        ArtifactExpectation.from_env({"KILN_EXPECT_ARTIFACT": "not json"})
