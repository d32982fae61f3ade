"""A store writer cannot exhaust a reader's memory or disk before the signature check (issue 38, Med 10): objects
read whole are bounded, downloads take their size from the manifest and the listing and never write more, and
the file:// store follows no symlink."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kiln.artifact_manifest import ArtifactCorrupt
from kiln.artifacts import ArtifactStore
from kiln.storage import MAX_READ_BYTES

VERSION = "llama-tiny-0123456789ab"


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ArtifactStore:
    if request.param == "file":
        return ArtifactStore.from_uri(f"file://{tmp_path / 'store'}")
    return ArtifactStore.from_uri(f"s3://{request.getfixturevalue('s3_bucket')}/kiln")


def _put(store: ArtifactStore, key: str, data: bytes) -> None:
    store.backend.write(key, data)


def _published(store: ArtifactStore, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "weights").mkdir(parents=True)
    (src / "engine.json").write_text(json.dumps({"format_version": 1}))
    (src / "weights" / "rank-0-of-1.safetensors").write_bytes(os.urandom(4096))
    store.publish(VERSION, src, {"model": "x"})


def test_an_oversized_manifest_is_refused_not_read(store):
    _put(store, f"engines/{VERSION}/manifest.json", b" " * (MAX_READ_BYTES + 1))
    with pytest.raises(ArtifactCorrupt, match=f"more than the {MAX_READ_BYTES} a store object read whole may hold"):
        store.read_manifest(VERSION)
    assert store.backend.read(f"engines/{VERSION}/manifest.json", limit=MAX_READ_BYTES + 1) is not None


def test_an_object_larger_than_its_manifest_entry_is_refused_before_it_is_written(store, tmp_path):
    _published(store, tmp_path)
    key = f"engines/{VERSION}/weights/rank-0-of-1.safetensors"
    _put(store, key, os.urandom(64 * 1024))  # the writer grew it: the manifest still says 4096
    local = tmp_path / "local.bin"
    with pytest.raises(ArtifactCorrupt, match="65536 bytes in the store, the manifest says 4096: not downloaded"):
        store.backend.download(key, local, None, size=4096)
    assert not local.exists() or local.stat().st_size == 0
    with pytest.raises(ArtifactCorrupt, match="the manifest says 4096"):
        store.fetch(VERSION, tmp_path / "dest")


def test_the_file_store_follows_no_symlink(tmp_path):
    store = ArtifactStore.from_uri(f"file://{tmp_path / 'store'}")
    _published(store, tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("not the store's")
    weights = tmp_path / "store" / "engines" / VERSION / "weights" / "rank-0-of-1.safetensors"
    weights.unlink()
    weights.symlink_to(secret)
    with pytest.raises(ArtifactCorrupt, match="reached through a symlink"):
        store.backend.download(f"engines/{VERSION}/weights/rank-0-of-1.safetensors", tmp_path / "x", None)
    weights.unlink()
    weights.symlink_to("/dev/zero")  # once read forever
    with pytest.raises(ArtifactCorrupt, match="symlink"):
        store.fetch(VERSION, tmp_path / "dest")
    manifest = tmp_path / "store" / "engines" / VERSION / "manifest.json"
    manifest.rename(tmp_path / "manifest.json")
    manifest.symlink_to(tmp_path / "manifest.json")
    with pytest.raises(ArtifactCorrupt, match="symlink"):
        store.read_manifest(VERSION)


def test_the_file_store_reads_only_regular_files(tmp_path):
    store = ArtifactStore.from_uri(f"file://{tmp_path / 'store'}")
    key = f"engines/{VERSION}/manifest.json"
    path = tmp_path / "store" / key
    path.parent.mkdir(parents=True)
    os.mkfifo(path)  # a read would block forever
    with pytest.raises(ArtifactCorrupt, match="not a regular file"):
        store.backend.read(key)


def test_an_s3_download_stops_once_more_than_the_manifests_size_arrives():
    """The object replaced between the HEAD and the transfer: the progress callback ends the transfer."""
    from kiln.storage_s3 import _bounded

    seen: list[int] = []
    step = _bounded(seen.append, 10, "s3://b/k")
    step(6)
    step(4)
    with pytest.raises(ArtifactCorrupt, match="more than the manifest's 10 bytes arrived"):
        step(1)
    assert seen == [6, 4]
