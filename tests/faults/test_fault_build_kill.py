"""`kiln build` killed with SIGKILL at each stage: no version becomes visible, `kiln cache gc` removes what
the dead build left in the store, and a rerun in the same work dir completes and publishes.

The build runs through faulty_kiln.py, which stops it right after a stage's work (its outputs on disk, the
next stage not started) or inside the publish (``publish:staged``: every file uploaded and verified in
``staging/``; ``publish:moved``: every file moved under ``engines/<version>/`` and the publish claim held,
no manifest yet); the test SIGKILLs it there. The quick tier kills at the two instants nearest to
visibility; every stage is under ``-m slow``, on a ``file://`` store, and both publish points on S3 too.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from conftest import Paused, kiln, measured

STAGES = ["fetch", "check", "quality_reference", "shard", "plan", "quality_runtime", "tune", "tactics", "compile",
          "kernels", "package"]
PUBLISH = ["publish:staged", "publish:moved"]
QUICK = {("file", "publish:moved")}
CASES = [("file", point) for point in STAGES + PUBLISH] + [("s3", point) for point in PUBLISH]


def store_listing(kind: str, tmp_path: Path, proxied_store) -> list[str]:
    if kind == "s3":
        return [k.removeprefix("kiln/") for k in proxied_store.keys()]
    root = tmp_path / "store"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


@pytest.mark.parametrize(("kind", "point"), [
    pytest.param(kind, point, id=f"{kind}-{point}",
                 marks=() if (kind, point) in QUICK else pytest.mark.slow) for kind, point in CASES])
def test_build_killed_at_a_stage_publishes_nothing_gc_cleans_and_a_rerun_completes(
        kind, point, toy_manifest, tmp_path, request):
    manifest, version = toy_manifest
    proxied_store = request.getfixturevalue("proxied_store") if kind == "s3" else None
    store = proxied_store.uri if proxied_store else f"file://{tmp_path / 'store'}"
    build = ("build", "-f", str(manifest), "--store", store, "--work-dir", str(tmp_path / "work"))

    killed = Paused(point, *build, folder=tmp_path / "fault")
    killed.wait_paused()
    assert killed.kill9() == -signal.SIGKILL

    from kiln.artifacts import ArtifactStore

    reader = ArtifactStore.from_uri(store)
    assert not reader.exists(version) and reader.list_versions() == []
    left = store_listing(kind, tmp_path, proxied_store)
    if point.startswith("publish:"):
        assert left, "a kill inside the publish leaves its upload behind"
    else:
        assert left == [], left  # nothing reaches the store before the publish stage
    listed = kiln("cache", "ls", "--store", store, log=tmp_path / "ls.log")
    assert version not in listed.log

    gc = kiln("cache", "gc", "--staging-older-than", "0", "--store", store, log=tmp_path / "gc.log")
    assert gc.code == 0, gc.log
    assert store_listing(kind, tmp_path, proxied_store) == [], gc.log

    started = time.monotonic()
    rerun = kiln(*build, log=tmp_path / "rerun.log")
    recovered = time.monotonic() - started
    assert rerun.code == 0, rerun.log
    assert f"built: {version}" in rerun.log
    assert reader.exists(version)
    reader.fetch(version, tmp_path / "check")  # every file verifies
    measured(f"build SIGKILL at {point} ({kind})", saw="exit -9 (killed); no version listed",
             recover_s=round(recovered, 1), lost="nothing", left_in_store=len(left),
             gc=[line for line in gc.log.splitlines() if line.startswith("removed")])


@pytest.mark.slow
def test_a_rerun_without_gc_after_a_kill_in_the_publish_says_it_waits_for_the_dead_claim(toy_manifest, tmp_path):
    """Killed holding the publish claim (``publish:moved``), a rerun without ``kiln cache gc`` waits up to the
    claim's TTL (15 minutes) for the dead publisher to go silent: it says so at once, naming the way out."""
    manifest, version = toy_manifest
    store = f"file://{tmp_path / 'store'}"
    build = ("build", "-f", str(manifest), "--store", store, "--work-dir", str(tmp_path / "work"))
    killed = Paused("publish:moved", *build, folder=tmp_path / "fault")
    killed.wait_paused()
    killed.kill9()
    rerun = Paused("never", *build, folder=tmp_path / "rerun")  # "never" is no stage: runs unpaused
    try:
        deadline = time.monotonic() + 180
        while "holds the publish claim" not in rerun.log():
            assert rerun.proc.poll() is None, rerun.log()
            assert time.monotonic() < deadline, rerun.log()
            time.sleep(0.2)
    finally:
        rerun.kill9()
    line = next(line for line in rerun.log().splitlines() if "holds the publish claim" in line)
    assert "claim_ttl 0:15:00" in line and "kiln cache gc" in line, line
    measured("rerun after a kill holding the publish claim, without gc", saw=line.split(" WARNING ", 1)[-1],
             recover_s="claim_ttl (900 s) without gc; one build with gc", lost="nothing")
