"""S3-only behaviour of the artifact store: multipart, checksums, URI options, one-line errors."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import boto3
import pytest
from botocore.exceptions import ClientError
from netutil import free_port, wait_for_port

from kiln.artifact_manifest import ArtifactCorrupt, StoreError
from kiln.artifacts import ArtifactStore, parse_artifact_uri
from kiln.storage_s3 import _local_checksums

MiB = 1024 * 1024




def write_random(path: Path, size: int, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(__import__("random").Random(seed).randbytes(size))
    return path


@pytest.fixture
def small_parts_store(s3_bucket: str) -> ArtifactStore:
    """Multipart above 1 MiB (S3 parts are at least 5 MiB, so a 6 MiB file has two)."""
    return ArtifactStore.from_uri(f"s3://{s3_bucket}/kiln", multipart_threshold=MiB, multipart_chunksize=MiB)


def test_multipart_upload_is_verified_against_the_servers_composite_checksum(small_parts_store, tmp_path):
    backend = small_parts_store.backend
    local = write_random(tmp_path / "big.bin", 6 * MiB + 123)
    steps: list[int] = []
    backend.upload(local, "staging/x/u/big.bin", steps.append)
    head = backend.client.head_object(Bucket=backend.bucket, Key="kiln/staging/x/u/big.bin", ChecksumMode="ENABLED")
    assert head["ETag"].strip('"').endswith("-2"), "the transfer went multipart"
    assert len(steps) > 1 and sum(steps) == local.stat().st_size
    sha = hashlib.sha256(local.read_bytes()).hexdigest()
    full, composite = _local_checksums(local, 5 * MiB)
    assert full == sha and head["ChecksumSHA256"].split("-")[0] == composite != _b64(sha)
    backend.verify_upload(local, "staging/x/u/big.bin", sha, local.stat().st_size)

    write_random(local, 6 * MiB + 123, seed=1)  # the local file changed under the upload
    with pytest.raises(ArtifactCorrupt, match="did not land intact"):
        backend.verify_upload(local, "staging/x/u/big.bin", sha, 6 * MiB + 123)


def _b64(hex_digest: str) -> str:
    return base64.b64encode(bytes.fromhex(hex_digest)).decode()


def test_publish_and_fetch_through_multipart_with_progress(small_parts_store, tmp_path):
    src = tmp_path / "src"
    write_random(src / "weights" / "rank-0-of-1.safetensors", 11 * MiB)
    (src / "engine.json").write_text("{}")
    progress: list[tuple[str, int, int]] = []
    m = small_parts_store.publish("v-1", src, {"x": 1}, progress=lambda *a: progress.append(a))
    weights = [(d, t) for p, d, t in progress if p == "weights/rank-0-of-1.safetensors"]
    assert len(weights) > 2 and weights[-1] == (11 * MiB, 11 * MiB)
    assert [d for d, _ in weights] == sorted(d for d, _ in weights)
    got: list[tuple[str, int, int]] = []
    out = small_parts_store.fetch("v-1", tmp_path / "out", progress=lambda *a: got.append(a))
    assert (out / "weights" / "rank-0-of-1.safetensors").read_bytes() == \
        (src / "weights" / "rank-0-of-1.safetensors").read_bytes()
    assert got[-1][1:] in {(f.size, f.size) for f in m.files}


def test_servers_without_checksums_are_verified_by_reading_back(s3_bucket, tmp_path):
    backend = ArtifactStore.from_uri(f"s3://{s3_bucket}").backend
    local = write_random(tmp_path / "f.bin", 1000)
    backend.client.put_object(Bucket=s3_bucket, Key="staging/v/u/f.bin", Body=local.read_bytes())
    head = backend.client.head_object(Bucket=s3_bucket, Key="staging/v/u/f.bin", ChecksumMode="ENABLED")
    assert "ChecksumSHA256" not in head
    sha = hashlib.sha256(local.read_bytes()).hexdigest()
    backend.verify_upload(local, "staging/v/u/f.bin", sha, 1000)
    with pytest.raises(ArtifactCorrupt):
        backend.verify_upload(local, "staging/v/u/f.bin", "0" * 64, 1000)


def test_conditional_create_never_overwrites(s3_bucket):
    backend = ArtifactStore.from_uri(f"s3://{s3_bucket}/p").backend
    assert backend.create_exclusive("engines/v/manifest.json", b"first")
    assert not backend.create_exclusive("engines/v/manifest.json", b"second")
    assert backend.read("engines/v/manifest.json") == b"first"


def test_endpoint_url_from_the_uri_query(s3_endpoint, s3_bucket, tmp_path, monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("hello")
    store = ArtifactStore.from_uri(f"s3://{s3_bucket}/pre/fix?endpoint_url={s3_endpoint}")
    assert store.uri == f"s3://{s3_bucket}/pre/fix"
    store.publish("v-1", tmp_path / "src", {})
    again, version = parse_artifact_uri(f"{store.artifact_uri('v-1')}?endpoint_url={s3_endpoint}")
    assert version == "v-1" and again.exists("v-1")
    keys = [o["Key"] for o in again.backend.client.list_objects_v2(Bucket=s3_bucket)["Contents"]]
    assert "pre/fix/engines/v-1/manifest.json" in keys


def test_missing_bucket_is_one_clear_line(s3_endpoint, tmp_path):
    store = ArtifactStore.from_uri("s3://no-such-bucket-kiln/x")
    expected = "s3://no-such-bucket-kiln/x: bucket 'no-such-bucket-kiln' does not exist (create it or fix --store)"
    for action in (store.list_versions, lambda: store.exists("v"), lambda: store.fetch("v", tmp_path / "o"),
                   lambda: store.gc(timedelta(0))):
        with pytest.raises(StoreError) as exc:
            action()
        assert str(exc.value) == expected
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a").write_text("x")
    with pytest.raises(StoreError) as exc:
        store.publish("v", tmp_path / "src", {})  # boto3 wraps this one in S3UploadFailedError
    assert str(exc.value) == expected


def test_missing_credentials_are_one_clear_line(s3_endpoint, tmp_path, monkeypatch):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StoreError, match=r"^s3://b-1/x: no AWS credentials found .*AWS_PROFILE") as exc:
        ArtifactStore.from_uri("s3://b-1/x").list_versions()
    assert "\n" not in str(exc.value)


def test_unknown_profile_and_uri_options(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(StoreError, match="AWS profile 'nope' not found"):
        ArtifactStore.from_uri("s3://b-1/x?profile=nope")
    with pytest.raises(StoreError, match=r"unknown store URI option\(s\) \['colour'\]"):
        ArtifactStore.from_uri("s3://b-1/x?colour=red")
    with pytest.raises(StoreError, match="needs a bucket"):
        ArtifactStore.from_uri("s3:///x")


def test_unreachable_endpoint_fails_fast_with_one_line(tmp_path):
    port = free_port()  # nothing listens here
    store = ArtifactStore.from_uri(f"s3://b-1/x?endpoint_url=http://127.0.0.1:{port}")
    started = time.monotonic()
    with pytest.raises(StoreError) as exc:
        store.list_versions()
    assert time.monotonic() - started < 15
    assert str(exc.value).startswith(f"s3://b-1/x: cannot reach the S3 endpoint http://127.0.0.1:{port}")
    assert "\n" not in str(exc.value)


def test_access_denied_from_a_server_that_enforces_auth(tmp_path):
    """moto with IAM auth on: the test's keys belong to no user, so S3 refuses them."""
    port = free_port()
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, proc=proc)
        store = ArtifactStore.from_uri(f"s3://locked-1/x?endpoint_url=http://127.0.0.1:{port}")
        with pytest.raises(StoreError, match=r"^s3://locked-1/x: access denied while trying to list engines/ "
                                             r"\(InvalidAccessKeyId\); check the credentials"):
            store.list_versions()
    finally:
        proc.terminate()
        proc.wait(10)


def test_access_denied_code_maps_to_one_line(s3_bucket):
    backend = ArtifactStore.from_uri(f"s3://{s3_bucket}/x").backend
    exc = ClientError({"Error": {"Code": "AccessDenied", "Message": "Access Denied"}}, "GetObject")
    assert str(backend._error(exc, "read engines/v/manifest.json")) == (
        f"s3://{s3_bucket}/x: access denied while trying to read engines/v/manifest.json (AccessDenied); "
        f"check the credentials and the bucket policy")


def test_gc_aborts_abandoned_multipart_uploads_only(s3_bucket):
    store = ArtifactStore.from_uri(f"s3://{s3_bucket}/kiln")
    client = boto3.client("s3")
    fresh_id = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    old = client.create_multipart_upload(Bucket=s3_bucket, Key="kiln/staging/v/20200101T000000Z-aaaa/w.bin")
    client.create_multipart_upload(Bucket=s3_bucket, Key=f"kiln/staging/v/{fresh_id}-bbbb/w.bin")
    assert store.gc(timedelta(hours=1)) == ["staging/v/20200101T000000Z-aaaa/w.bin (incomplete multipart upload)"]
    left = client.list_multipart_uploads(Bucket=s3_bucket)["Uploads"]
    assert [u["Key"] for u in left] == [f"kiln/staging/v/{fresh_id}-bbbb/w.bin"]
    assert old["UploadId"] not in {u["UploadId"] for u in left}
