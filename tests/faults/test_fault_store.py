"""The artifact store unreachable in the middle of a transfer, through a proxy in front of moto that cuts it off.

1. During a build's publish (the proxy resets every connection and refuses new ones once the upload of the
   weights has begun): `kiln build` exits 3 (storage) with one `error:` line naming the store, no version is
   visible, and once the store is back a rerun publishes it; `kiln cache gc` then removes the dead upload.
2. During a serving pod's fetch (cut once part of the artifact came down): `kiln serve --artifact` exits 1
   with one ERROR line and no traceback, leaves no engine directory (not even a temp folder) in
   --cache-dir, and a restart with the store back serves.
"""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from conftest import REPO, child_env, fresh_version, kiln, make_artifact_dir, measured
from netutil import free_port

from kiln.cache_stamp import stamp_path

KiB = 1024



def serves_again(uri: str, cache, log) -> float:
    """Seconds from now until a restarted `kiln serve` answers a completion (the time to recover)."""
    started = time.monotonic()
    proc, port = start_serve(uri, cache, log)
    try:
        wait_ready(proc, port, log)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "The kiln", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        return time.monotonic() - started
    finally:
        proc.terminate()
        proc.wait(30)

def test_store_unreachable_mid_publish_exits_3_publishes_nothing_and_a_rerun_publishes(
        proxied_store, toy_manifest, tmp_path):
    manifest, version = toy_manifest
    proxy = proxied_store.proxy
    proxy.arm(up=200 * KiB)  # the build's only big upload is its publish (the rank file is ~850 KiB)
    build = ("build", "-f", str(manifest), "--store", proxied_store.uri, "--work-dir", str(tmp_path / "work"))
    failed = kiln(*build, log=tmp_path / "build-1.log")
    assert proxy.is_cut, failed.log
    assert "[publish] start" in failed.log and "[publish] done" not in failed.log, failed.log
    assert failed.code == 3, failed.log
    errors = [line for line in failed.log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "cannot reach the S3 endpoint" in errors[0], failed.log
    assert "Traceback" not in failed.log
    seen_after_cut = time.monotonic() - proxy.cut_at  # upper bound: the process already exited

    # Nothing visible; the dead upload sits in staging/ only.
    assert not proxied_store.direct.exists(version) and proxied_store.direct.list_versions() == []
    leftovers = proxied_store.keys()
    assert leftovers and all(k.startswith(f"kiln/staging/{version}/") for k in leftovers), leftovers

    proxy.restore()
    restored = time.monotonic()
    rerun = kiln(*build, log=tmp_path / "build-2.log")
    assert rerun.code == 0, rerun.log
    recovered = time.monotonic() - restored
    assert proxied_store.direct.exists(version)
    proxied_store.direct.fetch(version, tmp_path / "check")  # every file verifies
    removed = proxied_store.direct.gc(timedelta(0))
    assert removed and all(r.startswith(f"staging/{version}/") for r in removed), removed
    assert all(k.startswith(f"kiln/engines/{version}/") for k in proxied_store.keys())
    measured("store unreachable mid-publish", saw=f"exit {failed.code}: {errors[0]}",
             failure_reported_within_s=round(seen_after_cut, 1), recover_s=round(recovered, 1),
             lost="nothing: no version; the partial upload stayed in staging/ until gc", leftovers=len(leftovers))


def start_serve(uri: str, cache: Path, log: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    out = open(log, "wb")  # noqa: SIM115 - the process owns it
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "kiln", "serve", "--artifact", uri, "--cache-dir", str(cache), "--port", str(port),
         "--served-model-name", "tiny"], stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
        env=child_env(KILN_CACHE_DIR=None, KILN_VERIFY_KEY=None, KILN_EXPECT_ARTIFACT=None))
    return proc, port


def wait_ready(proc: subprocess.Popen, port: int, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(log.read_text())


def test_store_unreachable_mid_fetch_exits_1_in_one_line_leaves_no_engine_dir_and_a_restart_serves(
        proxied_store, toy_model, tmp_path):
    version = fresh_version()
    src = make_artifact_dir(toy_model("llama-tiny"), tmp_path / "src", version, padding_bytes=3 * 1024 * KiB)
    proxied_store.direct.publish(version, src, {"test": True})
    uri = f"s3://{proxied_store.bucket}/kiln/engines/{version}?endpoint_url={proxied_store.proxy.url}"
    cache = tmp_path / "cache"
    proxy = proxied_store.proxy
    proxy.arm(down=1024 * KiB)  # a third of the way through the download

    failed = kiln("serve", "--artifact", uri, "--cache-dir", str(cache), "--port", "0", "--served-model-name", "tiny",
                  log=tmp_path / "serve-1.log", env={"KILN_CACHE_DIR": None, "KILN_EXPECT_ARTIFACT": None},
                  timeout=120)
    assert proxy.is_cut, failed.log
    assert failed.code == 1, failed.log
    assert "Traceback" not in failed.log, failed.log
    errors = [line for line in failed.log.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "could not load the model" in errors[0] and proxied_store.bucket in errors[0], \
        failed.log
    seen_after_cut = time.monotonic() - proxy.cut_at
    left = sorted(p.name for p in cache.iterdir()) if cache.exists() else []
    assert version not in left, left  # never a half-written engine directory under its own name
    assert left == [], left  # and the fetch's temp folder is gone too

    proxy.restore()
    recovered = serves_again(uri, cache, tmp_path / "serve-2.log")
    # the copy, and its verification stamp beside it (kiln.cache_stamp): no temp folder left
    assert sorted(p.name for p in cache.iterdir()) == sorted([version, stamp_path(cache / version).name])
    measured("store unreachable mid-fetch", saw=f"exit {failed.code}: {errors[0].split(' ERROR ', 1)[1]}",
             failure_reported_within_s=round(seen_after_cut, 1), recover_s=round(recovered, 1),
             lost="nothing: no engine dir, no temp folder left in --cache-dir")


@pytest.mark.slow
def test_pod_killed_mid_fetch_leaves_no_engine_dir_and_a_restart_serves(proxied_store, toy_model, tmp_path):
    """The serving container SIGKILLed (OOM, node drain) while its fetch hangs on a slow store: the engine
    directory never appears half-written under its version's name, and a restart fetches and serves. The dead
    fetch's temp folder (``.<version>.fetch-*``, its lock free once its process died) is removed by the next."""
    version = fresh_version()
    src = make_artifact_dir(toy_model("llama-tiny"), tmp_path / "src", version, padding_bytes=3 * 1024 * KiB)
    proxied_store.direct.publish(version, src, {"test": True})
    uri = f"s3://{proxied_store.bucket}/kiln/engines/{version}?endpoint_url={proxied_store.proxy.url}"
    cache = tmp_path / "cache"
    proxied_store.proxy.arm(down=1024 * KiB, stall=True)
    proc, _ = start_serve(uri, cache, tmp_path / "serve-1.log")
    try:
        assert proxied_store.proxy.stalled.wait(120), (tmp_path / "serve-1.log").read_text()
        time.sleep(0.5)
    finally:
        proc.kill()
        assert proc.wait(30) == -9
    left = sorted(p.name for p in cache.iterdir())
    assert version not in left and all(name.startswith(f".{version}.fetch-") for name in left), left

    proxied_store.proxy.cut()
    proxied_store.proxy.restore()
    recovered = serves_again(uri, cache, tmp_path / "serve-2.log")
    after = sorted(p.name for p in cache.iterdir())
    stale = [name for name in after if name not in (version, stamp_path(cache / version).name)]
    measured("serving pod SIGKILL mid-fetch", saw="exit -9; restart fetched and served", recover_s=round(recovered, 1),
             lost="nothing", stale_temp_folders=stale)
    assert version in after
    assert stale == []  # the dead fetch's folder: its lock was free, so the next fetch removed it
