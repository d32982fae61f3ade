"""A serving pod the operator started refuses an artifact whose manifest is not the build the operator verified."""

from __future__ import annotations

from pathlib import Path

import pytest
from kiln.serving.loader import fetch_artifact

from kiln.artifact_manifest import EXPECT_ENV, ArtifactExpectation, ArtifactUntrusted, BuiltBy
from kiln.artifacts import ArtifactStore

VERSION = "tiny-0123456789ab"


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    src = tmp_path / "src"
    src.mkdir()
    (src / "engine.json").write_text("{}")
    store = ArtifactStore.from_uri((tmp_path / "store").as_uri())
    store.publish(VERSION, src, {}, built_by=BuiltBy.of("ghcr.io/kiln-dev/kiln:0.1.0", "tenant-b/kiln"))
    return store


def test_fetch_artifact_checks_the_operators_expectation_only_when_given(store, tmp_path, monkeypatch):
    uri = store.artifact_uri(VERSION)
    expect = ArtifactExpectation(built_by=BuiltBy.of("ghcr.io/kiln-dev/kiln:0.1.0", "kiln-system/kiln"))
    monkeypatch.setenv(EXPECT_ENV, expect.to_env())
    with pytest.raises(ArtifactUntrusted, match="built_by.operator is 'tenant-b/kiln', the operator expected "
                                                "'kiln-system/kiln'"):
        fetch_artifact(uri, tmp_path / "cache")
    assert not (tmp_path / "cache" / VERSION).exists()
    monkeypatch.delenv(EXPECT_ENV)  # kiln up / kiln serve by hand: checksums only
    assert (fetch_artifact(uri, tmp_path / "cache") / "engine.json").is_file()


def test_kiln_serve_exits_with_one_line_naming_what_differs(store, start_server, tmp_path):
    expect = ArtifactExpectation(built_by=BuiltBy.of("ghcr.io/kiln-dev/kiln:0.1.0", "kiln-system/kiln"))
    srv = start_server("--cache-dir", str(tmp_path / "cache"), source=["--artifact", store.artifact_uri(VERSION)],
                       env={EXPECT_ENV: expect.to_env()})
    assert srv.proc.wait(timeout=120) == 1
    log = srv.log()
    assert "refusing this artifact: manifest built_by.operator is 'tenant-b/kiln'" in log
    assert "Traceback" not in log
