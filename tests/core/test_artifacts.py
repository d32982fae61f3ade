"""The artifact store against both backends: file:// (tmp_path) and s3:// (moto's server over HTTP)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from kiln.artifact_manifest import ArtifactConflict, ArtifactCorrupt, ArtifactNotFound, Manifest, StoreError
from kiln.artifacts import ArtifactStore, parse_artifact_uri

MiB = 1024 * 1024
VERSION = "llama-tiny-0123456789ab"
ENVELOPE = {"format_version": 1, "model": "file:///models/llama", "dtype": "float32"}


def make_engine_dir(root: Path, seed: int = 0, weights_size: int = 64 * 1024) -> Path:
    """A small engine directory: nested paths, a text file, random 'weights'."""
    rng = __import__("random").Random(seed)
    (root / "weights").mkdir(parents=True, exist_ok=True)
    (root / "engine.json").write_text(json.dumps({"format_version": 1, "seed": seed}))
    (root / "config.json").write_text("{}")
    (root / "weights" / "rank-0-of-1.safetensors").write_bytes(rng.randbytes(weights_size))
    return root


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def flip_byte(store: ArtifactStore, key: str, offset: int = 10) -> None:
    """Corrupt one stored object in place, behind the store's back."""
    data = bytearray(store.backend.read(key))
    data[offset] ^= 0xFF
    if store.uri.startswith("s3://"):
        store.backend.client.put_object(Bucket=store.backend.bucket, Key=store.backend._key(key), Body=bytes(data))
    else:
        (store.backend.root / key).write_bytes(bytes(data))


def store_uri_for(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if kind == "file":
        return (tmp_path / "store").as_uri()
    return f"s3://{request.getfixturevalue('s3_bucket')}/kiln"


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ArtifactStore:
    return ArtifactStore.from_uri(store_uri_for(request.param, request, tmp_path))


def test_publish_then_fetch_round_trips_and_verifies(store: ArtifactStore, tmp_path: Path):
    src = make_engine_dir(tmp_path / "src")
    seen: dict[str, list[tuple[int, int]]] = {}
    manifest = store.publish(VERSION, src, ENVELOPE, progress=lambda p, d, t: seen.setdefault(p, []).append((d, t)))

    files = {f.path: f for f in manifest.files}
    assert set(files) == set(tree(src))
    for path, data in tree(src).items():
        assert files[path].sha256 == hashlib.sha256(data).hexdigest()
        assert files[path].size == len(data)
        assert seen[path][-1] == (len(data), len(data))  # progress ends at the file's size
    assert manifest.total_size == sum(len(d) for d in tree(src).values())
    assert manifest.envelope == ENVELOPE and manifest.engine_version == VERSION
    assert manifest.created_at.tzinfo is not None and manifest.created_at.utcoffset() == timedelta(0)
    assert store.exists(VERSION) and store.read_manifest(VERSION) == manifest
    assert [m.engine_version for m in store.list_versions()] == [VERSION]
    assert store.backend.list("staging/") == []  # staging is cleaned after a publish

    dest = store.fetch(VERSION, tmp_path / "out" / "engine")
    assert dest == tmp_path / "out" / "engine"
    fetched = tree(dest)
    assert Manifest.model_validate_json(fetched.pop("manifest.json")) == manifest
    assert fetched == tree(src)
    # no temp dirs left next to dest; its verification stamp beside it (kiln.cache_stamp)
    assert sorted(p.name for p in dest.parent.iterdir()) == [".engine.verified.json", "engine"]


def test_manifest_on_store_is_json_with_the_documented_fields(store: ArtifactStore, tmp_path: Path):
    store.publish(VERSION, make_engine_dir(tmp_path / "src"), ENVELOPE)
    raw = json.loads(store.backend.read(f"engines/{VERSION}/manifest.json"))
    assert raw["schema_version"] == 1 and raw["kiln_version"]
    assert datetime.fromisoformat(raw["created_at"]).tzinfo is not None
    assert {"path", "sha256", "size"} == set(raw["files"][0])
    assert raw["total_size"] == sum(f["size"] for f in raw["files"])


def test_artifact_uri_round_trips(store: ArtifactStore):
    uri = store.artifact_uri(VERSION)
    assert uri == f"{store.uri}/engines/{VERSION}"
    parsed, version = parse_artifact_uri(uri)
    assert (parsed.uri, version) == (store.uri, VERSION)
    with pytest.raises(StoreError, match="not an artifact URI"):
        parse_artifact_uri(store.uri)


def test_exists_only_for_a_valid_manifest(store: ArtifactStore, tmp_path: Path):
    base = f"engines/{VERSION}"
    assert not store.exists(VERSION)
    store.backend.upload(make_engine_dir(tmp_path / "src") / "engine.json", f"{base}/engine.json", None)
    assert not store.exists(VERSION), "files without a manifest must be invisible"
    assert store.list_versions() == []
    store.backend.create_exclusive(f"{base}/manifest.json", b'{"truncated": ')
    assert not store.exists(VERSION)
    store.backend.delete([f"{base}/manifest.json"])
    empty = {"schema_version": 1, "engine_version": VERSION, "kiln_version": "0.1.0", "upload_id": "x",
             "created_at": datetime.now(UTC).isoformat(), "envelope": {}, "files": [], "total_size": 0,
             "content_digest": Manifest.digest_of([])}
    store.backend.create_exclusive(f"{base}/manifest.json", json.dumps(empty).encode())
    assert not store.exists(VERSION), "a manifest that lists no files is not a version"
    with pytest.raises(ArtifactNotFound, match=r"kiln cache ls") as exc:
        store.fetch(VERSION, tmp_path / "out")
    assert store.uri in str(exc.value)
    assert not (tmp_path / "out").exists()


def test_publish_is_a_no_op_when_the_version_exists(store: ArtifactStore, tmp_path: Path):
    first = store.publish(VERSION, make_engine_dir(tmp_path / "a", seed=1), ENVELOPE)
    again = store.publish(VERSION, make_engine_dir(tmp_path / "b", seed=2), ENVELOPE)
    assert again == first
    assert store.backend.list("staging/") == []


def test_bad_source_directories_are_rejected(store: ArtifactStore, tmp_path: Path):
    with pytest.raises(StoreError, match="does not exist"):
        store.publish(VERSION, tmp_path / "missing", ENVELOPE)
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreError, match="is empty"):
        store.publish(VERSION, tmp_path / "empty", ENVELOPE)
    src = make_engine_dir(tmp_path / "src")
    (src / "manifest.json").write_text("{}")
    with pytest.raises(StoreError, match="reserved"):
        store.publish(VERSION, src, ENVELOPE)
    with pytest.raises(ValueError, match="invalid engine version"):
        store.publish("../escape", make_engine_dir(tmp_path / "ok"), ENVELOPE)
    assert not store.exists(VERSION)


def test_corrupted_object_is_caught_at_fetch(store: ArtifactStore, tmp_path: Path):
    store.publish(VERSION, make_engine_dir(tmp_path / "src"), ENVELOPE)
    key = f"engines/{VERSION}/weights/rank-0-of-1.safetensors"
    flip_byte(store, key)
    m = store.read_manifest(VERSION)
    want = next(f.sha256 for f in m.files if f.path == "weights/rank-0-of-1.safetensors")
    got = hashlib.sha256(store.backend.read(key)).hexdigest()
    with pytest.raises(ArtifactCorrupt) as exc:
        store.fetch(VERSION, tmp_path / "out")
    msg = str(exc.value)
    assert "weights/rank-0-of-1.safetensors" in msg and want in msg and got in msg and "\n" not in msg
    assert not (tmp_path / "out").exists() and list(tmp_path.glob(".out*")) == []


def test_a_missing_object_is_caught_at_fetch(store: ArtifactStore, tmp_path: Path):
    store.publish(VERSION, make_engine_dir(tmp_path / "src"), ENVELOPE)
    store.backend.delete([f"engines/{VERSION}/config.json"])
    with pytest.raises(ArtifactCorrupt, match="config.json.*missing"):
        store.fetch(VERSION, tmp_path / "out")


def test_an_upload_that_lands_corrupted_is_never_published(store: ArtifactStore, tmp_path: Path):
    real_upload = store.backend.upload

    def bad_upload(local, key, progress):
        real_upload(local, key, progress)
        if key.endswith(".safetensors"):
            flip_byte(store, key)

    store.backend.upload = bad_upload
    with pytest.raises(ArtifactCorrupt, match="did not land intact"):
        store.publish(VERSION, make_engine_dir(tmp_path / "src"), ENVELOPE)
    assert not store.exists(VERSION)
    assert store.backend.list("") == []  # staging removed, nothing moved in


def test_fetch_reuses_a_verified_local_copy_and_repairs_a_bad_one(store: ArtifactStore, tmp_path: Path):
    src = make_engine_dir(tmp_path / "src")
    store.publish(VERSION, src, ENVELOPE)
    dest = store.fetch(VERSION, tmp_path / "out")
    calls = []
    real_download = store.backend.download
    store.backend.download = lambda *a, **k: (calls.append(a[0]), real_download(*a, **k))
    store.fetch(VERSION, dest)
    assert calls == []
    (dest / "config.json").write_text('{"tampered": true}')
    store.fetch(VERSION, dest)
    assert len(calls) == 3 and (dest / "config.json").read_text() == "{}"


def _publish_in_threads(store: ArtifactStore, srcs: list[Path]) -> list[Manifest | Exception]:
    results: list[Manifest | Exception] = [None] * len(srcs)  # type: ignore[list-item]
    barrier = threading.Barrier(len(srcs))

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = store.publish(VERSION, srcs[i], ENVELOPE)
        except Exception as exc:  # noqa: BLE001 - collected for the assertions
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(srcs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_concurrent_publishers_of_identical_content_both_succeed(store: ArtifactStore, tmp_path: Path):
    srcs = [make_engine_dir(tmp_path / f"src{i}", seed=7, weights_size=512 * 1024) for i in range(3)]
    results = _publish_in_threads(store, srcs)
    assert all(isinstance(r, Manifest) for r in results), results
    assert len({r.content_digest for r in results}) == 1
    assert len({r.upload_id for r in results}) == 1, "every publisher returns the one winning manifest"
    out = tree(store.fetch(VERSION, tmp_path / "out"))
    out.pop("manifest.json")
    assert out == tree(srcs[0])
    assert store.backend.list("staging/") == []


def test_concurrent_publishers_of_different_content_one_wins_cleanly(store: ArtifactStore, tmp_path: Path):
    srcs = [make_engine_dir(tmp_path / f"src{i}", seed=i, weights_size=512 * 1024) for i in range(2)]
    results = _publish_in_threads(store, srcs)
    winners = [r for r in results if isinstance(r, Manifest)]
    losers = [r for r in results if not isinstance(r, Manifest)]
    assert len(winners) == 1 and len(losers) == 1, results
    assert isinstance(losers[0], ArtifactConflict) and "different content" in str(losers[0])
    out = tree(store.fetch(VERSION, tmp_path / "out"))  # verifies every checksum
    out.pop("manifest.json")
    assert out == tree(srcs[results.index(winners[0])])


def test_a_claim_taken_just_after_the_winner_published_and_let_go_moves_nothing_in(store: ArtifactStore,
                                                                                  tmp_path: Path, monkeypatch):
    """The loser looked for a manifest just before the winner created it, and took the claim just after the winner
    released it (a clean run hit this: the loser's engine.json replaced the winner's, and a fetch found it corrupt).
    Having taken the claim, it looks for a manifest again before it moves anything in."""
    srcs = [make_engine_dir(tmp_path / f"src{i}", seed=i, weights_size=64 * 1024) for i in range(2)]
    winner = store.publish(VERSION, srcs[0], ENVELOPE)
    real, looks = store.read_manifest, []

    def late(version):  # the loser's first two looks (publish's, then the claim wait's) come before the manifest
        looks.append(version)
        return None if len(looks) <= 2 else real(version)

    monkeypatch.setattr(store, "read_manifest", late)
    with pytest.raises(ArtifactConflict, match="different content"):
        store.publish(VERSION, srcs[1], ENVELOPE)
    monkeypatch.undo()
    out = tree(store.fetch(VERSION, tmp_path / "out"))  # verifies every checksum against the winner's manifest
    out.pop("manifest.json")
    assert out == tree(srcs[0]) and store.read_manifest(VERSION) == winner
    assert store.backend.read(f"engines/{VERSION}/.publish-claim.json") is None


CHILD = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from kiln.artifacts import ArtifactStore
    uri, src, version, mode = sys.argv[1:5]
    store = ArtifactStore.from_uri(uri, **({"multipart_threshold": 1 << 20} if uri.startswith("s3") else {}))
    total = sum(p.stat().st_size for p in Path(src).rglob("*") if p.is_file())
    done = {}
    def progress(path, n, t):
        done[path] = n
        if mode == "die" and sum(done.values()) >= total // 2:
            os._exit(17)  # killed mid-publish: no cleanup, no finally blocks
    m = store.publish(version, src, {"k": 1}, progress=progress)
    print(m.upload_id, m.content_digest)
""")


def test_concurrent_publishers_in_separate_processes(store: ArtifactStore, tmp_path: Path):
    src = make_engine_dir(tmp_path / "src", weights_size=2 * MiB)
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, store.uri, str(src), VERSION, "ok"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert len({o[0] for o in outs}) == 1  # both report the same winning upload
    assert store.exists(VERSION)
    store.fetch(VERSION, tmp_path / "out")


def test_interrupted_publish_leaves_nothing_visible_and_gc_cleans_it(store: ArtifactStore, tmp_path: Path):
    src = make_engine_dir(tmp_path / "src", weights_size=6 * MiB)
    proc = subprocess.run([sys.executable, "-c", CHILD, store.uri, str(src), VERSION, "die"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 17, proc.stderr
    assert not store.exists(VERSION) and store.list_versions() == []
    with pytest.raises(ArtifactNotFound):
        store.fetch(VERSION, tmp_path / "out")

    def leftovers() -> list:
        s3 = store.uri.startswith("s3://")
        uploads = store.backend.client.list_multipart_uploads(
            Bucket=store.backend.bucket).get("Uploads", []) if s3 else []
        return store.backend.list("staging/") + uploads

    assert leftovers(), "the killed publisher left its staging upload behind"
    assert store.gc(timedelta(hours=1)) == []  # too fresh to be abandoned
    removed = store.gc(timedelta(0))
    assert removed and all(r.startswith(f"staging/{VERSION}/") for r in removed)
    assert leftovers() == []
    assert store.publish(VERSION, src, ENVELOPE).total_size > 6 * MiB  # and publishing again works


def test_crash_before_the_manifest_leaves_invisible_files_that_gc_removes(store: ArtifactStore, tmp_path: Path):
    real_create = store.backend.create_exclusive

    def crash_on_manifest(key, data):
        if key.endswith("/manifest.json"):
            raise KeyboardInterrupt  # the process dies between moving files in and the manifest
        return real_create(key, data)

    store.backend.create_exclusive = crash_on_manifest
    with pytest.raises(KeyboardInterrupt):
        store.publish(VERSION, make_engine_dir(tmp_path / "a", seed=1), ENVELOPE)
    store.backend.create_exclusive = real_create
    assert store.backend.list(f"engines/{VERSION}/") and not store.exists(VERSION)
    assert store.gc(timedelta(hours=1)) == []
    assert store.gc(timedelta(0)) == [f"engines/{VERSION}/"]
    assert store.backend.list("") == []
    # A retry with different bytes (non-deterministic rebuild) is not blocked by the leftovers.
    m = store.publish(VERSION, make_engine_dir(tmp_path / "b", seed=2), ENVELOPE)
    assert store.read_manifest(VERSION) == m


def test_a_fresh_claim_with_other_content_is_waited_for_then_taken_over(store: ArtifactStore, tmp_path: Path):
    claim = {"upload_id": "dead", "content_digest": "0" * 64, "created_at": datetime.now(UTC).isoformat()}
    store.backend.create_exclusive(f"engines/{VERSION}/.publish-claim.json", json.dumps(claim).encode())
    store.claim_ttl = timedelta(seconds=1)
    started = time.monotonic()
    m = store.publish(VERSION, make_engine_dir(tmp_path / "src"), ENVELOPE)
    assert time.monotonic() - started >= 0.9  # it waited for the holder before taking over
    assert store.read_manifest(VERSION) == m
    assert store.backend.read(f"engines/{VERSION}/.publish-claim.json") is None


def test_list_and_delete(store: ArtifactStore, tmp_path: Path):
    for i, v in enumerate(["a-000000000001", "b-000000000002"]):
        store.publish(v, make_engine_dir(tmp_path / f"s{i}", seed=i), {"i": i})
    assert [m.engine_version for m in store.list_versions()] == ["a-000000000001", "b-000000000002"]
    removed = store.delete("a-000000000001")
    assert removed[0] == "engines/a-000000000001/manifest.json" and len(removed) == 4
    assert [m.engine_version for m in store.list_versions()] == ["b-000000000002"]
    assert store.backend.list("engines/a-000000000001/") == []
    with pytest.raises(ArtifactNotFound, match="not in the store"):
        store.delete("a-000000000001")


def test_gc_keeps_published_versions_and_fresh_uploads(store: ArtifactStore, tmp_path: Path):
    store.publish(VERSION, make_engine_dir(tmp_path / "src"), ENVELOPE)
    src = make_engine_dir(tmp_path / "other")
    store.backend.upload(src / "config.json", "staging/other-1/20260101T000000Z-abcd/config.json", None)
    assert store.gc(timedelta(hours=1)) == []
    assert store.gc(timedelta(0)) == ["staging/other-1/20260101T000000Z-abcd/"]
    assert store.exists(VERSION) and store.backend.list("staging/") == []
    store.fetch(VERSION, tmp_path / "out")


def test_file_store_uri_forms(tmp_path: Path):
    assert ArtifactStore.from_uri(str(tmp_path)).uri == f"file://{tmp_path}"
    assert ArtifactStore.from_uri(f"file://{tmp_path}").uri == f"file://{tmp_path}"
    with pytest.raises(StoreError, match="absolute path"):
        ArtifactStore.from_uri("file://host/path")
    with pytest.raises(StoreError, match="unsupported store scheme 'gs'"):
        ArtifactStore.from_uri("gs://bucket/x")
    store = ArtifactStore.from_uri(str(tmp_path / "never-created"))
    assert store.list_versions() == [] and not store.exists(VERSION)


def test_artifacts_import_without_torch():
    code = "import sys, kiln.artifacts, kiln.cache_cli, kiln.storage_s3; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ})
