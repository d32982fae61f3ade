"""Kernels compiled at build time (kiln.engine.kernels.cache, kiln.builder.kernel_cache).

On CPU: a real ``triton.autotune`` Autotuner under Triton's interpreter records its choices and a
fresh one seeded from the record runs without benchmarking (the interpreter has no benchmarker,
so the tuners are given a ``do_bench``: the first one's decides which config wins, the second
one's fails the test if called); a Triton-shaped cache is packed into an artifact, published to a
``file://`` store, fetched (sha256-verified) and installed, and Triton's own cache manager finds
the kernel group under the new directory; a mismatching host warns and leaves ``TRITON_CACHE_DIR``
alone; a CPU build records why nothing is packed. With a GPU, cold start is measured both ways.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from kiln.builder.kernel_cache import build_kernel_cache, pack  # noqa: E402
from kiln.engine.kernels import cache  # noqa: E402
from kiln.engine.kernels.cache import m_buckets, prompt_lengths  # noqa: E402

pytestmark = pytest.mark.kernels

CONFIGS = [triton.Config({"BLOCK": 16}, num_warps=4), triton.Config({"BLOCK": 32}, num_warps=2, num_stages=2)]
HASH = "ab" * 32  # a kernel's cache key; Triton names its directory by the key in base32
KEY_DIR = base64.b32encode(bytes.fromhex(HASH)).decode().rstrip("=")
HERE = {"triton_version": triton.__version__, "torch_version": torch.__version__, "gpu_name": "NVIDIA H100 80GB HBM3",
        "compute_capability": "9.0"}


@triton.jit
def _double(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)


def _tuner(do_bench):
    return triton.autotune(configs=CONFIGS, key=["n"], do_bench=do_bench)(_double)


def _launch(tuner, n: int) -> torch.Tensor:
    x = torch.arange(n, dtype=torch.float32, device="cuda" if torch.cuda.is_available() else "cpu")
    y = torch.empty_like(x)
    tuner[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, n)
    assert torch.equal(y, 2 * x)
    return y


def test_autotuner_record_then_seed_skips_benchmarking():
    timed = []

    def bench(kernel_call, quantiles):  # BLOCK=32 is "faster"; the kernel really runs once per config
        kernel_call()
        timed.append(1)
        return [1.0 if len(timed) % 2 == 0 else 2.0] * 3

    tuned = _tuner(bench)
    _launch(tuned, 40)
    _launch(tuned, 100)
    assert len(timed) == 4  # two keys, two configs each
    record = cache.record_autotuned({"double": tuned})
    assert [e["key"][0] for e in record["double"]] == [40, 100]
    assert all(e["config"] == {"kwargs": {"BLOCK": 32}, "num_warps": 2, "num_stages": 2, "num_ctas": 1,
                               "maxnreg": None} for e in record["double"])
    record = json.loads(json.dumps(record))  # as it travels in engine.json

    def no_bench(kernel_call, quantiles):
        raise AssertionError("a seeded key was benchmarked")

    fresh = _tuner(no_bench)
    assert cache.seed_autotuned(record, {"double": fresh}) == 2
    _launch(fresh, 40)
    _launch(fresh, 100)
    assert fresh.best_config == CONFIGS[1]
    assert cache.seed_autotuned(record, {"double": fresh}) == 0  # keys already there are kept
    with pytest.raises(AssertionError, match="benchmarked"):
        _launch(fresh, 64)  # an unrecorded key still autotunes


def test_seed_from_environment_reaches_the_int8_gemm_tuner(tmp_path, monkeypatch):
    from kiln.engine.kernels.int8_gemm import _tuned_kernel

    key = [16, 4096, 4096, "torch.bfloat16", "torch.int8", "torch.float32", "torch.float32", "torch.bfloat16"]
    seed = tmp_path / "seed.json"
    seed.write_text(json.dumps({"int8_weight_only": [{"key": key, "config": cache.config_to_dict(CONFIGS[1])}],
                                "gone_kernel": []}))
    monkeypatch.setenv(cache.SEED_ENV, str(seed))
    try:
        assert cache.seed_from_environment() == 1
        assert _tuned_kernel.cache[tuple(key)] == CONFIGS[1]
    finally:
        _tuned_kernel.cache.pop(tuple(key), None)
    monkeypatch.delenv(cache.SEED_ENV)
    assert cache.seed_from_environment() == 0


def _fake_triton_cache(root: Path) -> Path:
    """What Triton 3.9 writes for one kernel: members and a group index naming them by absolute path."""
    key_dir = root / KEY_DIR
    key_dir.mkdir(parents=True)
    members = {"_double.cubin": b"\x7fELF...", "_double.json": b'{"name": "_double"}', "_double.ttir": b"module"}
    for name, data in members.items():
        (key_dir / name).write_bytes(data)
    (key_dir / "__grp___double.json").write_text(json.dumps(
        {"child_paths": {name: str(key_dir / name) for name in members}}))
    (key_dir / "lock").write_text("")
    (key_dir / "tmp.pid_1_x").mkdir()
    (key_dir / "tmp.pid_1_x" / "partial").write_text("half")
    return root


def _artifact_with_cache(tmp_path: Path) -> tuple[Path, dict]:
    art = tmp_path / "engine"
    art.mkdir()
    packed = pack(_fake_triton_cache(tmp_path / "build-cache"), art)
    assert packed == {"num_files": 4, "bytes": packed["bytes"], "num_kernels": 1}
    group = json.loads((art / cache.CACHE_DIR / KEY_DIR / "__grp___double.json").read_text())
    assert group["child_paths"]["_double.cubin"] == f"{KEY_DIR}/_double.cubin"  # no build path in the artifact
    doc = {"kernels": {"packed": True, "path": cache.CACHE_DIR, "target": HERE,
                       "autotuned": {"int8_weight_only": []}, **packed}}
    (art / "engine.json").write_text(json.dumps(doc))
    return art, doc


def test_packed_cache_travels_through_the_store_and_installs(tmp_path, monkeypatch):
    from triton.runtime.cache import get_cache_manager

    from kiln.artifacts import ArtifactStore

    art, doc = _artifact_with_cache(tmp_path)
    store = ArtifactStore.from_uri(f"file://{tmp_path / 'store'}")
    store.publish("v1", art, {"model": "toy"})
    fetched = store.fetch("v1", tmp_path / "fetched")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.delenv(cache.SEED_ENV, raising=False)
    dest = cache.install_shipped(fetched, json.loads((Path(fetched) / "engine.json").read_text()), here=HERE,
                                trusted=True)
    assert dest is not None and os.environ["TRITON_CACHE_DIR"] == str(dest)
    assert sorted(p.name for p in (dest / KEY_DIR).iterdir()) == [
        "__grp___double.json", "_double.cubin", "_double.json", "_double.ttir"]
    group = get_cache_manager(HASH).get_group("_double.json")  # Triton's own lookup, under the new dir
    assert group == {n: str(dest.resolve() / KEY_DIR / n) for n in ("_double.cubin", "_double.json", "_double.ttir")}
    assert json.loads(Path(os.environ[cache.SEED_ENV]).read_text()) == doc["kernels"]["autotuned"]


def test_unverified_artifacts_kernels_and_any_host_code_are_never_installed(tmp_path, monkeypatch, caplog):
    art, doc = _artifact_with_cache(tmp_path)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/users/own/cache")
    with caplog.at_level(logging.WARNING, logger="kiln.engine.kernels.cache"):
        assert cache.install_shipped(art, doc, here=HERE) is None  # not verified: compiled GPU kernels are code
    assert "signature was not verified" in caplog.text and os.environ["TRITON_CACHE_DIR"] == "/users/own/cache"
    planted = art / cache.CACHE_DIR / KEY_DIR / "__triton_launcher.so"
    planted.write_bytes(b"\x7fELF not a launcher")  # host code in a verified artifact is still not copied
    monkeypatch.delenv(cache.SEED_ENV, raising=False)
    dest = cache.install_shipped(art, doc, here=HERE, trusted=True)
    assert dest is not None and not (dest / KEY_DIR / planted.name).exists()
    assert not list(dest.rglob("*.so"))


def test_mismatched_host_warns_and_leaves_triton_alone(tmp_path, monkeypatch, caplog):
    art, doc = _artifact_with_cache(tmp_path)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/users/own/cache")
    other = {**HERE, "compute_capability": "8.9", "gpu_name": "NVIDIA L40S"}
    with caplog.at_level(logging.WARNING, logger="kiln.engine.kernels.cache"):
        assert cache.install_shipped(art, doc, here=other, trusted=True) is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert "compute_capability 9.0 at build, 8.9 here" in line and "triton_version" not in line
    assert os.environ["TRITON_CACHE_DIR"] == "/users/own/cache"
    assert cache.target_differences(HERE, {**HERE, "triton_version": "3.8.0"}) == [
        f"triton_version {triton.__version__} at build, 3.8.0 here"]


def test_a_cache_missing_a_group_member_warns_and_is_not_used(tmp_path, monkeypatch, caplog):
    art, doc = _artifact_with_cache(tmp_path)
    (art / cache.CACHE_DIR / KEY_DIR / "_double.cubin").unlink()
    monkeypatch.setenv("TRITON_CACHE_DIR", "/users/own/cache")
    with caplog.at_level(logging.WARNING, logger="kiln.engine.kernels.cache"):
        assert cache.install_shipped(art, doc, here=HERE, trusted=True) is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("shipped kernel cache not used") and "_double.cubin" in line
    assert os.environ["TRITON_CACHE_DIR"] == "/users/own/cache"


def test_cpu_build_ships_c_kernels_not_a_triton_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", "/users/own/cache")
    record = build_kernel_cache(tmp_path / "engine", "cpu", tmp_path, {})
    assert record["device"] == "cpu" and record["packed"]  # kernels/native.py's record (tests/engine/test_cpu_kernels.py)
    assert cache.install_shipped(tmp_path / "engine", {"kernels": record}) is None
    assert os.environ["TRITON_CACHE_DIR"] == "/users/own/cache"


def test_warm_up_prompts_meet_every_gemm_bucket():
    from kiln.engine.kernels.int8_gemm import m_bucket

    lengths = prompt_lengths(300)
    assert lengths[0] == 1 and lengths[-1] == 300 and max(lengths) <= 300
    assert {m_bucket(n) for n in lengths} == {b for b in m_buckets() if b <= m_bucket(300)}
    assert {n % 16 == 0 for n in lengths if n > 1} == {True, False}  # both integer specializations


def test_warm_up_runs_its_shapes_through_an_engine(toy_model, make_llm):
    from kiln.engine.kernels.cache import warm_up

    llm = make_llm(toy_model("llama-tiny"), max_num_tokens=40, max_input_len=40, max_seq_len=64, max_batch_size=4,
                   block_size=8, num_kv_blocks=64, enforce_eager=True)
    ran = warm_up(llm)
    assert ran == {"prompt_lengths": [1, 15, 16, 31, 32, 40], "eager_decode_batches": [1, 4]}
    assert llm.stats().prefix_cache_hits > 0  # each prompt's second run hit the cache


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cold_start_with_and_without_shipped_kernels(toy_model, tmp_path):
    """Artifact load to first token in a fresh process: JIT + autotune vs the build's cache installed."""
    from kiln.engine.artifact import current_arch, save_rank_weights, shard_checkpoint

    model = toy_model("llama-tiny")
    art = tmp_path / "engine"
    art.mkdir()
    for f in model.iterdir():
        if f.suffix != ".safetensors":
            (art / f.name).write_bytes(f.read_bytes())
    save_rank_weights(shard_checkpoint(model, 1, "bfloat16", "int8"), art / "weights")
    doc = {"format_version": 1, "gpu": {"sku": "gpu", "arch": current_arch()},
           "engine_config": {"dtype": "bfloat16", "quantization": "int8", "max_batch_size": 8,
                             "max_num_tokens": 256, "max_input_len": 256, "max_seq_len": 320, "block_size": 16,
                             "num_kv_blocks": 256, "cuda_graph_batch_sizes": [1, 2, 4, 8]}}
    (art / "engine.json").write_text(json.dumps(doc))
    work = tmp_path / "work"
    work.mkdir()
    record = build_kernel_cache(art, "cuda", work, {})
    assert record["packed"] and record["num_kernels"] > 0 and record["autotuned"]["int8_weight_only"]

    def cold_start(env_cache: Path) -> float:
        code = ("import sys,time;t=time.perf_counter();from kiln.engine import LLM,SamplingParams;"
                "llm=LLM.from_artifact(sys.argv[1]);llm.generate([[5,6,7]],SamplingParams(max_tokens=1,"
                "temperature=0));print(time.perf_counter()-t);llm.shutdown()")
        out = subprocess.run([sys.executable, "-P", "-c", code, str(art)], capture_output=True, text=True,
                             env={**os.environ, "TRITON_CACHE_DIR": str(env_cache)}, check=True)
        return float(out.stdout.strip().splitlines()[-1])

    t0 = time.perf_counter()
    without = cold_start(tmp_path / "empty-cache-1")  # engine.json has no kernels record yet
    (art / "engine.json").write_text(json.dumps({**doc, "kernels": record}))
    shipped = cold_start(tmp_path / "empty-cache-2")
    print(f"\ncold start (load -> first token): {without:.2f}s JIT+autotune, {shipped:.2f}s with the shipped "
          f"cache ({record['num_kernels']} kernels, {record['bytes'] / 2**20:.1f} MiB); "
          f"build warm-up {record['warm_up_seconds']:.1f}s; total {time.perf_counter() - t0:.0f}s")
    assert shipped < without
