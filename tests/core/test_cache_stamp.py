"""The local cache's verification stamp (kiln.cache_stamp): a copy verified once is trusted by ``stat`` alone while
no file changed; any change re-hashes it; the signature and pinned-digest checks still run on every fetch."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

import kiln.artifact_manifest as artifact_manifest
from kiln.artifact_manifest import ArtifactExpectation, ArtifactUntrusted, BuiltBy
from kiln.artifacts import ArtifactStore
from kiln.cache_stamp import stamp_matches, stamp_path, verified_copy
from kiln.signing import Signer, Verifier, generate_key_pair

VERSION = "llama-tiny-0123456789ab"
ENVELOPE = {"format_version": 1, "model": "file:///models/llama", "dtype": "float32"}


def make_engine_dir(root: Path) -> Path:
    (root / "weights").mkdir(parents=True)
    (root / "engine.json").write_text(json.dumps({"format_version": 1}))
    (root / "weights" / "rank-0-of-1.safetensors").write_bytes(os.urandom(256 * 1024))
    return root


@pytest.fixture
def published(tmp_path: Path) -> tuple[ArtifactStore, Path]:
    """A file:// store holding VERSION, signed, and its copy fetched into a local cache."""
    private, _ = generate_key_pair(tmp_path / "keys")
    store = ArtifactStore.from_uri((tmp_path / "store").as_uri())
    store.publish(VERSION, make_engine_dir(tmp_path / "src"), ENVELOPE, signer=Signer.from_pem(private),
                  built_by=BuiltBy(builder_image="kiln-builder:test", operator="kiln-operator"))
    dest = store.fetch(VERSION, tmp_path / "cache" / VERSION)
    time.sleep(0.05)  # past the clock tick of the fetch's writes: a later write gets a later ctime on any kernel
    return store, dest


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The files re-hashed by a fetch's check of a copy already in place (``dir_matches``)."""
    seen: list[str] = []
    real = artifact_manifest.file_sha256
    monkeypatch.setattr(artifact_manifest, "file_sha256", lambda p: (seen.append(Path(p).name), real(p))[1])
    return seen


def downloads(store: ArtifactStore) -> list[str]:
    calls: list[str] = []
    real = store.backend.download
    store.backend.download = lambda *a, **k: (calls.append(a[0]), real(*a, **k))[1]
    return calls


def test_a_fetched_copy_is_trusted_by_its_stamp_without_re_hashing(published, hashes):
    store, dest = published
    fetched = downloads(store)
    assert stamp_path(dest).is_file() and not (dest / stamp_path(dest).name).exists()  # beside the copy
    for _ in range(2):
        assert store.fetch(VERSION, dest) == dest
    assert hashes == [] and fetched == []


@pytest.mark.parametrize("change", ["same-size write, mtime put back", "replaced by a copy", "truncated"])
def test_a_file_changed_after_the_stamp_is_re_hashed_and_repaired(published, hashes, change):
    store, dest = published
    weights = dest / "weights" / "rank-0-of-1.safetensors"
    good, st = weights.read_bytes(), weights.stat()
    if change == "same-size write, mtime put back":  # what a forger keeps: size and mtime; ctime moves anyway
        with open(weights, "r+b") as f:
            f.write(bytes([good[0] ^ 0xFF]))
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif change == "replaced by a copy":  # a new inode with the same bytes, size and mtime
        tmp = weights.with_name("copy")
        tmp.write_bytes(good)
        os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(tmp, weights)
    else:
        os.truncate(weights, 100)
    fetched = downloads(store)
    assert store.fetch(VERSION, dest) == dest
    assert weights.read_bytes() == good
    assert hashes, "the changed copy was trusted without re-hashing"
    if change == "replaced by a copy":  # same bytes: re-hashed, kept, stamped anew
        assert fetched == [] and stamp_matches(dest, store.read_manifest(VERSION))
    else:
        assert fetched  # the bad copy was fetched again
    hashes.clear()
    store.fetch(VERSION, dest)
    assert hashes == []  # stamped again after the repair


@pytest.mark.parametrize("stamp", ["missing", "torn", "another version's digest"])
def test_a_copy_without_a_valid_stamp_is_re_hashed_then_stamped(published, hashes, stamp):
    store, dest = published
    path = stamp_path(dest)
    if stamp == "missing":  # a copy fetched before stamps existed
        path.unlink()
    elif stamp == "torn":
        path.write_bytes(path.read_bytes()[:40])
    else:
        doc = json.loads(path.read_text())
        path.write_text(json.dumps({**doc, "content_digest": "0" * 64}))
    store.fetch(VERSION, dest)
    assert sorted(hashes) == ["engine.json", "rank-0-of-1.safetensors"]
    hashes.clear()
    store.fetch(VERSION, dest)
    assert hashes == []


def test_a_file_that_changes_while_it_is_hashed_leaves_no_stamp(published, monkeypatch):
    store, dest = published
    stamp_path(dest).unlink()
    weights = dest / "weights" / "rank-0-of-1.safetensors"
    real = artifact_manifest.dir_matches

    def hash_while_written(where, manifest):  # another process touches the file during the check
        ok = real(where, manifest)
        os.utime(weights, ns=(0, 0))
        return ok

    monkeypatch.setattr("kiln.cache_stamp.dir_matches", hash_while_written)
    assert verified_copy(dest, store.read_manifest(VERSION))
    assert not stamp_path(dest).exists()


def test_the_signature_and_the_pin_are_checked_on_every_fetch_of_a_stamped_copy(published, tmp_path, hashes):
    store, dest = published
    _, foreign = generate_key_pair(tmp_path / "other-keys")
    with pytest.raises(ArtifactUntrusted, match="refusing this artifact"):
        store.fetch(VERSION, dest, verifier=Verifier.from_pem(foreign))
    manifest = store.read_manifest(VERSION)
    expect = ArtifactExpectation(content_digest="f" * 64, built_by=manifest.built_by)
    with pytest.raises(ArtifactUntrusted, match="refusing this artifact"):
        store.fetch(VERSION, dest, expect=expect)
    _, own = generate_key_pair(tmp_path / "keys")
    assert store.fetch(VERSION, dest, verifier=Verifier.from_pem(own)) == dest and hashes == []
