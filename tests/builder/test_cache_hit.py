"""The cache-hit path: a version already in the store answers in about a second, without torch."""

from __future__ import annotations

import time

from builder_helpers import run_cli, version_of

from kiln.artifacts import ArtifactStore


def envelope_of(manifest) -> dict:
    from kiln.envelope import build_envelope
    from kiln.manifest import load_manifest

    return build_envelope(load_manifest(manifest))


def test_cache_hit_imports_neither_torch_nor_transformers(write_manifest, tmp_path):
    manifest = write_manifest("file:///models/not-needed-for-a-hit")
    version = version_of(manifest)
    store_uri = f"file://{tmp_path / 'store'}"
    src = tmp_path / "engine"
    src.mkdir()
    (src / "engine.json").write_text("{}")
    ArtifactStore.from_uri(store_uri).publish(version, src, envelope_of(manifest))

    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
            "from kiln.cli import main; main()\n")
    t0 = time.monotonic()
    proc = run_cli("-f", str(manifest), "--store", store_uri, prefix=["-c", code, "build"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == f"cache hit: {version}"
    assert f"artifact: {store_uri}/engines/{version}" in proc.stdout
    assert time.monotonic() - t0 < 15  # generous for a loaded 2-core box; typically ~1 s
    # The store by either name of the environment (kiln up's and kiln cache's $KILN_STORE too), as --store.
    for name, other in (("KILN_STORE_URI", "KILN_STORE"), ("KILN_STORE", "KILN_STORE_URI")):
        proc = run_cli("-f", str(manifest), prefix=["-c", code, "build"], env={name: store_uri, other: ""})
        assert proc.returncode == 0 and proc.stdout.splitlines()[0] == f"cache hit: {version}", proc.stderr


def test_a_hit_is_one_only_when_the_whole_envelope_matches(write_manifest, tmp_path):
    """A version names the envelope's whole SHA-256, but a store writer can publish anything under a version: their
    engine must not be served as another (issue 38, Med 5)."""
    manifest = write_manifest("file:///models/not-needed-for-a-hit")
    version = version_of(manifest)
    store_uri = f"file://{tmp_path / 'store'}"
    src = tmp_path / "engine"
    src.mkdir()
    (src / "engine.json").write_text("{}")
    colliding = {**envelope_of(manifest), "model": {"source": "hf://attacker/weights"}}
    ArtifactStore.from_uri(store_uri).publish(version, src, colliding)
    proc = run_cli("build", "-f", str(manifest), "--store", store_uri)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert "holds another engine under this version: its envelope's model is" in out and "hf://attacker" in out
    assert f"`kiln cache rm {version} --store {store_uri}`" in out and "Traceback" not in out
