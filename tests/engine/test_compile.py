"""compile="inductor": option checks, the shipped compile's host check (eager fallback with a warning),
and compiled greedy tokens equal to eager ones (slow: Inductor's first compile takes ~20-60 s)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from engine_testlib import random_prompts
from kiln.engine import LLM, ConfigError, SamplingParams, cpu_target
from kiln.engine import compile as kcompile
from kiln.engine.artifact import FORMAT_VERSION, artifact_engine_config, save_rank_weights, shard_checkpoint

ENGINE = {"dtype": "float32", "max_batch_size": 4, "max_num_tokens": 64, "block_size": 8, "num_kv_blocks": 40}


def make_artifact(model_dir: Path, out: Path, record: dict | None) -> Path:
    out.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    save_rank_weights(shard_checkpoint(model_dir, 1, "float32"), out / "weights")
    doc = {"format_version": FORMAT_VERSION, "gpu": {"sku": "cpu", "arch": "cpu"},
           "engine_config": {**ENGINE, "compile": "inductor"}}
    if record is not None:
        doc["tuning"] = {"compile": record}
        (out / record["cache"]).mkdir(parents=True)
    (out / "engine.json").write_text(json.dumps(doc))
    return out


def greedy(llm, prompts, n=6):
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))]


def host_record(**changes) -> dict:
    """A compile record this host satisfies (the flags of the ISA it has, this torch)."""
    flags = sorted(cpu_target.cpu_flags() & set(kcompile.ISA_FLAGS["avx2"]))
    return {"backend": "inductor", "cache": kcompile.CACHE_DIR, "vec_isa": "avx2", "cpu_flags": flags,
            "torch": torch.__version__, **changes}


def test_compile_option_is_checked(toy_model):
    model_dir = toy_model()
    with pytest.raises(ConfigError, match="^compile must be one of off, inductor, got 'tvm'"):
        LLM(model_dir, compile="tvm", num_kv_blocks=8)
    with pytest.raises(ConfigError, match="tensor_parallel_size x pipeline_parallel_size must be 1"):
        LLM(model_dir, compile="inductor", pipeline_parallel_size=2, num_kv_blocks=8)
    assert kcompile.check_compile("inductor", "cuda", 1).startswith("compile 'inductor' is for the CPU target")
    assert kcompile.check_compile("inductor", "cpu", 1) is None and kcompile.check_compile("off", "cuda", 4) is None


def test_shipped_compile_used_when_host_matches(toy_model, tmp_path):
    art = make_artifact(toy_model(), tmp_path / "art", host_record())
    config = artifact_engine_config(art, trust_shipped_code=True)
    assert config.compile == "inductor" and config.compile_cache == str(art / kcompile.CACHE_DIR)


@pytest.mark.parametrize("change, lacks", [
    ({"cpu_flags": ["avx2", "kiln_test_flag"]}, "CPU flag kiln_test_flag"),
    ({"torch": "1.0.0"}, "torch 1.0.0"),
    ({"threads": 999}, "999 torch threads"),
])
def test_host_without_the_compile_runs_eager_with_a_warning(toy_model, tmp_path, caplog, change, lacks):
    model_dir = toy_model()
    art = make_artifact(model_dir, tmp_path / "art", host_record(**change))
    with caplog.at_level(logging.WARNING, logger="kiln.engine.compile"):
        config = artifact_engine_config(art, trust_shipped_code=True)
    assert config.compile == "off" and config.compile_cache is None
    [warning] = [r.getMessage() for r in caplog.records if r.name == "kiln.engine.compile"]
    assert lacks in warning and "running eager" in warning
    llm = LLM(engine_config=config)
    try:
        assert llm.engine.runner.compiled is None
        prompts = random_prompts([5, 11], seed=3)
        eager = LLM(model_dir, **ENGINE)
        try:
            assert greedy(llm, prompts) == greedy(eager, prompts)
        finally:
            eager.shutdown()
    finally:
        llm.shutdown()


def test_host_lacking_the_isa_flags_falls_back(toy_model, tmp_path, monkeypatch, caplog):
    """The real host check: an artifact compiled on this host, served where /proc/cpuinfo lacks its flags."""
    art = make_artifact(toy_model(), tmp_path / "art", host_record(cpu_flags=["avx2", "fma"]))
    monkeypatch.setattr(cpu_target, "cpu_flags", lambda: frozenset({"sse4_2"}))
    with caplog.at_level(logging.WARNING, logger="kiln.engine.compile"):
        assert artifact_engine_config(art, trust_shipped_code=True).compile == "off"
    assert "lacks CPU flag avx2, CPU flag fma" in caplog.text


def test_compile_record_names_the_isa_flags():
    record = kcompile.compile_record()
    assert record["torch"] == torch.__version__ and record["cache"] == kcompile.CACHE_DIR
    assert record["cpu_flags"] == sorted(kcompile.ISA_FLAGS.get(record["vec_isa"], ()))


@pytest.mark.slow
def test_compiled_greedy_equals_eager_and_shipped_cache_serves(toy_model, tmp_path, monkeypatch):
    model_dir = toy_model()
    prompts = random_prompts([3, 9, 20, 2], seed=5)  # decodes, prefills, a 1-token decode batch at the end
    eager = LLM(model_dir, **ENGINE)
    try:
        want = greedy(eager, prompts), greedy(eager, prompts[:1])
    finally:
        eager.shutdown()
    monkeypatch.setenv(kcompile.CACHE_ENV, str(tmp_path / "build-cache"))
    kcompile.compile_into(tmp_path / "build-cache")
    llm = LLM(model_dir, compile="inductor", **ENGINE)
    try:
        assert llm.engine.runner.compiled is not None
        assert (greedy(llm, prompts), greedy(llm, prompts[:1])) == want
    finally:
        llm.shutdown()
    assert list((tmp_path / "build-cache").glob("*/*.so")), "the compiled C++ kernels are in the cache dir"
    art = make_artifact(model_dir, tmp_path / "art", host_record())
    shutil.rmtree(art / kcompile.CACHE_DIR)
    shutil.copytree(tmp_path / "build-cache", art / kcompile.CACHE_DIR)
    shipped = LLM.from_artifact(art, trust_shipped_code=True)
    try:
        assert shipped.engine_config.compile_cache == str(art / kcompile.CACHE_DIR)
        assert os.environ[kcompile.CACHE_ENV] != str(tmp_path / "build-cache")  # a private copy
        assert greedy(shipped, prompts) == want[0]
    finally:
        shipped.shutdown()
