"""`kiln serve --artifact`: fetch from a store, verify, load per-rank weights, serve the same tokens."""

from __future__ import annotations

import json
import shutil

import httpx
from kiln.engine import SamplingParams
from kiln.engine.artifact import FORMAT_VERSION, save_rank_weights, shard_checkpoint
from kiln.engine.cpu_target import available_cpus, cgroup_cpu_quota, describe_host

from kiln.artifacts import ArtifactStore

VERSION = "tiny-0123456789ab"


def test_serves_an_artifact_from_a_store(start_server, model_dir, offline, tmp_path):
    src = tmp_path / "artifact"
    src.mkdir()
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, src / f.name)
    save_rank_weights(shard_checkpoint(model_dir, 1, "float32", None), src / "weights")
    (src / "engine.json").write_text(json.dumps({
        "format_version": FORMAT_VERSION, "engine_version": VERSION, "kiln_version": "0.1.0",
        "gpu": {"sku": "cpu", "arch": "cpu"},
        "engine_config": {"dtype": "float32", "quantization": "none", "tensor_parallel_size": 1,
                          "max_batch_size": 4, "max_num_tokens": 64, "max_seq_len": 256, "max_input_len": 128,
                          "block_size": 16, "num_kv_blocks": 64},
        "tuning": {"torch_num_threads": 1, "cpu": describe_host()},  # built on this very CPU type
    }))
    store = ArtifactStore.from_uri(f"file://{tmp_path / 'store'}")
    store.publish(VERSION, src, {"test": True})

    # Without OMP_NUM_THREADS (or a cgroup quota) the server uses the thread count the builder measured best
    # on this CPU type (kiln.engine.cpu_target.choose_threads).
    srv = start_server(
        "--cache-dir",
        str(tmp_path / "cache"),
        source=["--artifact", store.artifact_uri(VERSION)],
        env={"OMP_NUM_THREADS": None},
    )
    srv.wait_ready()
    version = httpx.get(f"{srv.url}/version", timeout=10).json()
    assert version["engine_version"] == VERSION
    assert version["engine_config"]["max_batch_size"] == 4
    if cgroup_cpu_quota() is None:  # a container's quota outranks the build's measurement
        assert version["torch_num_threads"] == 1
    assert version["cpu_target"]["threads"] == version["torch_num_threads"]
    governor = version["cpu_target"].get("governor")  # the count re-chosen from the serving steps
    if available_cpus() > version["torch_num_threads"] and cgroup_cpu_quota() is None:
        assert governor["threads"] == version["torch_num_threads"] and governor["choices"] == sorted(
            {version["torch_num_threads"], available_cpus()}) and governor["trials"] == 0
    else:
        assert governor is None
    assert (tmp_path / "cache" / VERSION / "engine.json").is_file()

    want = offline.generate(["From the store"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[
        0
    ]
    got = httpx.post(
        f"{srv.url}/v1/completions",
        timeout=60,
        json={
            "model": "tiny",
            "prompt": "From the store",
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        },
    ).json()
    assert got["choices"][0]["text"] == want.text
