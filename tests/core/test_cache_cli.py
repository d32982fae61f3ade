"""``kiln cache ls|show|rm|gc``: output, exit codes, and one-line storage errors (also as a real process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner
from netutil import free_port

from kiln.artifacts import ArtifactStore
from kiln.cache_cli import cache, human_size, parse_duration

VERSION = "llama-tiny-0123456789ab"


def make_engine_dir(root: Path, seed: int = 0) -> Path:
    (root / "weights").mkdir(parents=True, exist_ok=True)
    (root / "engine.json").write_text(json.dumps({"format_version": 1, "seed": seed}))
    (root / "weights" / "rank-0-of-1.safetensors").write_bytes(bytes(range(256)) * (40 + seed))
    return root


@pytest.fixture
def published(tmp_path: Path) -> ArtifactStore:
    store = ArtifactStore.from_uri((tmp_path / "store").as_uri())
    store.publish(VERSION, make_engine_dir(tmp_path / "src"), {"dtype": "float32", "model": "file:///m"})
    return store


def invoke(*args: str, env: dict | None = None):
    return CliRunner().invoke(cache, list(args), env=env, catch_exceptions=False)


def test_ls_lists_versions_as_a_table_and_json(published: ArtifactStore):
    r = invoke("ls", "--store", published.uri)
    assert r.exit_code == 0, r.output
    header, row = r.stdout.splitlines()
    assert header.split() == ["VERSION", "SIZE", "FILES", "CREATED", "KILN"]
    total = published.read_manifest(VERSION).total_size
    assert 10 * 1024 < total < 11 * 1024
    assert row.split()[:4] == [VERSION, *human_size(total).split(), "2"]
    r = invoke("ls", "--json", "--store", published.uri)
    assert [m["engine_version"] for m in json.loads(r.stdout)] == [VERSION]


def test_store_comes_from_either_name_and_ls_says_which(published: ArtifactStore, tmp_path: Path):
    for name, other in (("KILN_STORE_URI", "KILN_STORE"), ("KILN_STORE", "KILN_STORE_URI")):
        r = invoke("ls", env={name: published.uri, other: None})
        assert r.exit_code == 0 and VERSION in r.stdout and f"store: {published.uri}" in r.stderr
    r = invoke("ls", env={"KILN_STORE_URI": published.uri, "KILN_STORE": published.uri})  # one store, two names
    assert r.exit_code == 0 and VERSION in r.stdout
    # Two different stores: which one `rm` would remove from is no guess; a usage error names both, removes nothing.
    other = (tmp_path / "other").as_uri()
    r = invoke("rm", VERSION, env={"KILN_STORE_URI": published.uri, "KILN_STORE": other})
    assert r.exit_code == 2 and f"$KILN_STORE_URI={published.uri}" in r.stderr and f"$KILN_STORE={other}" in r.stderr
    assert "--store" in r.stderr and published.read_manifest(VERSION) is not None
    r = invoke("show", VERSION, "--store", published.uri, env={"KILN_STORE_URI": other, "KILN_STORE": "x"})
    assert r.exit_code == 0 and VERSION in r.stdout  # --store decides; the environment is not read


def test_ls_on_an_empty_store_says_so(tmp_path: Path):
    r = invoke("ls", "--store", (tmp_path / "empty").as_uri())
    assert r.exit_code == 0 and r.stdout == "" and "no engines in file://" in r.stderr


def test_show_prints_the_manifest(published: ArtifactStore):
    r = invoke("show", VERSION, "--store", published.uri)
    assert r.exit_code == 0
    m = published.read_manifest(VERSION)
    assert f"uri:            {published.uri}/engines/{VERSION}" in r.stdout
    assert m.content_digest in r.stdout and '"dtype": "float32"' in r.stdout
    assert "weights/rank-0-of-1.safetensors" in r.stdout
    r = invoke("show", VERSION, "--json", "--store", published.uri)
    assert json.loads(r.stdout)["content_digest"] == m.content_digest


def test_show_and_rm_of_a_missing_version_exit_1_with_a_hint(published: ArtifactStore):
    for cmd in ("show", "rm"):
        r = invoke(cmd, "nope-1", "--store", published.uri)
        assert r.exit_code == 1
        assert r.stderr == f"error: {published.uri}: engine version 'nope-1' is not in the store " \
                           f"(see `kiln cache ls --store {published.uri}`)\n"


def test_rm_removes_the_version(published: ArtifactStore):
    r = invoke("rm", VERSION, "--store", published.uri)
    assert r.exit_code == 0 and r.stdout == f"removed {published.uri}/engines/{VERSION} (3 objects)\n"
    assert not published.exists(VERSION) and published.backend.list("") == []


def test_gc_removes_stale_staging_only(published: ArtifactStore, tmp_path: Path):
    published.backend.upload(tmp_path / "src" / "engine.json", "staging/x-1/20200101T000000Z-ab12/engine.json", None)
    old = published.backend.root / "staging/x-1/20200101T000000Z-ab12/engine.json"
    os.utime(old, (old.stat().st_atime, old.stat().st_mtime - 7200))  # last touched two hours ago
    r = invoke("gc", "--staging-older-than", "3h", "--store", published.uri)
    assert r.exit_code == 0 and r.stdout == "" and "nothing to collect" in r.stderr
    r = invoke("gc", "--store", published.uri)  # default: 1h
    assert r.exit_code == 0 and r.stdout == "removed staging/x-1/20200101T000000Z-ab12/\n"
    assert published.exists(VERSION)


def test_usage_errors_exit_2(published: ArtifactStore):
    r = invoke("gc", "--staging-older-than", "soon", "--store", published.uri)
    assert r.exit_code == 2 and "'soon' is not a duration" in r.stderr
    r = invoke("show", "../etc", "--store", published.uri)
    assert r.exit_code == 2 and "invalid engine version '../etc'" in r.stderr
    r = invoke("ls", "--store", "gs://bucket/x")
    assert r.exit_code == 3 and "unsupported store scheme 'gs'" in r.stderr


def test_missing_bucket_exits_3_with_one_line(s3_endpoint):
    r = invoke("ls", "--store", "s3://no-such-bucket-kiln/x")
    assert r.exit_code == 3
    assert r.stderr == ("error: s3://no-such-bucket-kiln/x: bucket 'no-such-bucket-kiln' does not exist "
                        "(create it or fix --store)\n")



@pytest.mark.parametrize("case", ["missing-bucket", "unreachable"])
def test_storage_errors_from_the_real_cli_process(case: str, s3_endpoint: str):
    env = {**os.environ, "KILN_STORE": "s3://no-such-bucket-kiln/x"}
    expected = "bucket 'no-such-bucket-kiln' does not exist"
    if case == "unreachable":
        env["KILN_STORE"] = f"s3://b-1/x?endpoint_url=http://127.0.0.1:{free_port()}"
        expected = "cannot reach the S3 endpoint"
    proc = subprocess.run([sys.executable, "-m", "kiln", "cache", "ls"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: s3://") and expected in lines[0]


def test_missing_credentials_exit_3_with_one_line(s3_endpoint: str, tmp_path: Path, monkeypatch):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    r = invoke("gc", "--store", "s3://b-1/x")
    assert r.exit_code == 3
    assert r.stderr.startswith("error: s3://b-1/x: no AWS credentials found") and r.stderr.count("\n") == 1


def test_helpers():
    assert parse_duration("90s") == timedelta(seconds=90)
    assert parse_duration("1.5h") == timedelta(minutes=90)
    assert parse_duration("0") == timedelta(0)
    assert parse_duration("2d") == timedelta(days=2)
    assert [human_size(n) for n in (5, 2048, 3 * 1024**3)] == ["5 B", "2.0 KiB", "3.0 GiB"]
