"""Signed engines end to end: what a store writer can and cannot get a `kiln serve --verify-key` pod to run.

A writer with kiln's own code fetches a genuine signed engine, swaps its CPU kernel library for one whose
constructor leaves a file behind, and republishes it with a consistent manifest (unsigned, or signed with
a key of its own). A pod with the operator's verify key refuses both before downloading a file; a pod
without one serves the weights but never loads the shipped library. In no case does the library run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import httpx
import pytest
from kiln.engine.artifact import FORMAT_VERSION, save_rank_weights, shard_checkpoint
from kiln.engine.cpu_target import describe_host
from kiln.engine.kernels import cpu_library

from kiln.artifacts import ArtifactStore
from kiln.signing import Signer, generate_key_pair

VERSION = "tiny-signed-0123456789ab"


def _engine_dir(model_dir, dest):
    dest.mkdir()
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dest / f.name)
    save_rank_weights(shard_checkpoint(model_dir, 1, "float32", None), dest / "weights")
    record = cpu_library.build_for_artifact(dest)
    if not record.get("packed"):
        pytest.skip(f"no CPU kernel library to ship here: {record.get('reason')}")
    (dest / "engine.json").write_text(json.dumps({
        "format_version": FORMAT_VERSION, "engine_version": VERSION, "kiln_version": "0.1.0",
        "gpu": {"sku": "cpu", "arch": "cpu"}, "kernels": record,
        "engine_config": {"dtype": "float32", "quantization": "none", "tensor_parallel_size": 1, "max_batch_size": 4,
                          "max_num_tokens": 64, "max_seq_len": 256, "max_input_len": 128, "block_size": 16,
                          "num_kv_blocks": 64},
        "tuning": {"torch_num_threads": 1, "cpu": describe_host()},
    }))
    return record


def _plant(engine_dir, record, marker):
    """Swap every shipped library level for one whose constructor creates ``marker``."""
    source = engine_dir.parent / "planted.c"
    source.write_text(f'#include <stdio.h>\n__attribute__((constructor)) static void run(void) '
                      f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    for info in record["libraries"].values():
        subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-o",
                        str(engine_dir / cpu_library.CPU_DIR / info["file"]), str(source)], check=True)


def _serve_refused(uri, verify_key, cache):
    proc = subprocess.run([sys.executable, "-m", "kiln", "serve", "--artifact", uri, "--port", "0",
                           "--verify-key", str(verify_key), "--cache-dir", str(cache)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stderr


def test_a_store_writer_cannot_get_its_library_run(start_server, model_dir, tmp_path):
    private, public = generate_key_pair(tmp_path / "operator-keys")
    own_private, _ = generate_key_pair(tmp_path / "attacker-keys")
    store = ArtifactStore.from_uri(f"file://{tmp_path / 'store'}")
    record = _engine_dir(model_dir, tmp_path / "built")
    manifest = store.publish(VERSION, tmp_path / "built", {"test": True}, signer=Signer.from_pem(private))
    assert manifest.signature["key_id"] == Signer.from_pem(private).key_id

    genuine = start_server("--cache-dir", str(tmp_path / "cache-genuine"), "--verify-key", str(public),
                           source=["--artifact", store.artifact_uri(VERSION)])
    genuine.wait_ready()
    assert "is signed by the verify key" in genuine.log()
    assert "not loaded: its signature was not verified" not in genuine.log()
    genuine.stop()

    # The writer fetches the engine, swaps the library and republishes a consistent manifest.
    marker = tmp_path / "library-code-ran"
    tampered = store.fetch(VERSION, tmp_path / "tampered")
    (tampered / "manifest.json").unlink()
    _plant(tampered, record, marker)
    store.delete(VERSION)
    store.publish(VERSION, tampered, {"test": True})
    err = _serve_refused(store.artifact_uri(VERSION), public, tmp_path / "cache-1")
    assert VERSION in err and "it is not signed" in err
    assert not (tmp_path / "cache-1" / VERSION).exists()  # refused before any file was downloaded

    store.delete(VERSION)
    store.publish(VERSION, tampered, {"test": True}, signer=Signer.from_pem(own_private))
    err = _serve_refused(store.artifact_uri(VERSION), public, tmp_path / "cache-2")
    assert "it is signed by key" in err and "not by the verify key" in err
    assert not marker.exists()

    # Without a verify key the weights are served, but the shipped library is never loaded.
    unverified = start_server("--cache-dir", str(tmp_path / "cache-3"), source=["--artifact",
                                                                                 store.artifact_uri(VERSION)])
    unverified.wait_ready()
    assert "not loaded: its signature was not verified" in unverified.log()
    reply = httpx.post(f"{unverified.url}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert reply.status_code == 200
    unverified.stop()
    assert not marker.exists()


def test_verify_key_errors_are_one_line(model_dir, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kiln", "serve", "--model", str(model_dir), "--verify-key",
                           str(tmp_path / "k.pem")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--verify-key checks a signed engine artifact" in proc.stderr
    store = ArtifactStore.from_uri(f"file://{tmp_path / 'store'}")
    err = _serve_refused(store.artifact_uri(VERSION), tmp_path / "missing.pem", tmp_path / "cache")
    assert "--verify-key" in err and "missing.pem" in err
