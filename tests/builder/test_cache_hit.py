"""The cache-hit path: a version already in the store answers in about a second, without torch."""

from __future__ import annotations

import time

from builder_helpers import run_cli, version_of

from kiln.artifacts import ArtifactStore


def test_cache_hit_imports_neither_torch_nor_transformers(write_manifest, tmp_path):
    manifest = write_manifest("file:///models/not-needed-for-a-hit")
    version = version_of(manifest)
    store_uri = f"file://{tmp_path / 'store'}"
    src = tmp_path / "engine"
    src.mkdir()
    (src / "engine.json").write_text("{}")
    ArtifactStore.from_uri(store_uri).publish(version, src, {"test": True})

    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
            "from kiln.cli import main; main()\n")
    t0 = time.monotonic()
    proc = run_cli("-f", str(manifest), "--store", store_uri, prefix=["-c", code, "build"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == f"cache hit: {version}"
    assert f"artifact: {store_uri}/engines/{version}" in proc.stdout
    assert time.monotonic() - t0 < 15  # generous for a loaded 2-core box; typically ~1 s
