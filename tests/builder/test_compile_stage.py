"""The build's compile decision, with a stand-in runtime whose speed depends on ``compile`` and which
writes into Inductor's cache dir as a real compile would (the real compile: tests/engine/test_compile.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from kiln.builder.errors import InvalidSpec
from kiln.builder.stages.compile import COMPILE_ENV, compile_for_target
from kiln.engine import compile as kcompile
from kiln.engine.compile import CACHE_DIR, CACHE_ENV

from kiln.api import LLMEngineSpec


class TimedLLM:
    def __init__(self, step_s: float) -> None:
        self.step_s, self.is_shut_down = step_s, False

    def generate(self, prompts, params):
        time.sleep(self.step_s * params.max_tokens)

    def shutdown(self) -> None:
        self.is_shut_down = True


def spec(gpu: str) -> LLMEngineSpec:
    return LLMEngineSpec.model_validate({"model": {"source": "hf://org/m"}, "gpu": gpu, "maxBatchSize": 8,
                                         "maxInputLen": 64, "maxSeqLen": 128, "maxNumTokens": 64})


def loader(compiled_step_s: float, loaded: list):
    def load_llm(**overrides):
        if overrides["compile"] == "inductor":  # a real compile writes kernels and lock files there
            cache = Path(os.environ[CACHE_ENV])
            (cache / "ab").mkdir(parents=True)
            (cache / "ab" / "kernel.so").write_bytes(b"\x7fELF")
            (cache / "locks").mkdir()
        llm = TimedLLM(compiled_step_s if overrides["compile"] == "inductor" else 0.002)
        loaded.append((overrides, llm))
        return llm
    return load_llm


@pytest.mark.parametrize("compiled_step_s, ships", [(0.0005, True), (0.004, False)])
def test_compile_ships_only_when_it_measures_faster(tmp_path, monkeypatch, compiled_step_s, ships):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "process-cache"))
    monkeypatch.setenv(COMPILE_ENV, "inductor")
    monkeypatch.setattr(kcompile, "vec_isa", lambda: "avx2")  # the real probe runs a C++ compiler (seconds)
    threads, loaded, tuning = torch.get_num_threads(), [], {"torch_num_threads": 1}
    overrides = compile_for_target(loader(compiled_step_s, loaded), spec("cpu"), 1000, tmp_path, tuning,
                                   {"tensor_parallel_size": 1})
    assert [o for o, _ in loaded] == [{"compile": "off"}, {"compile": "inductor"}]
    assert all(llm.is_shut_down for _, llm in loaded)
    assert os.environ[CACHE_ENV] == str(tmp_path / "process-cache") and torch.get_num_threads() == threads
    record = tuning["compile"]
    assert record["used"] is ships and (record["gain"] >= 1.05) is ships and record["threads"] == 1
    assert record["cache"] == CACHE_DIR and record["torch"] == torch.__version__
    assert record["vec_isa"] == "avx2" and record["cpu_flags"] == ["avx2", "fma"]
    assert record["eager"]["decode"] and record["compiled"]["decode"]
    if ships:
        assert overrides == {"compile": "inductor"}
        assert (tmp_path / CACHE_DIR / "ab" / "kernel.so").is_file() and not (tmp_path / CACHE_DIR / "locks").exists()
    else:
        assert overrides == {} and not (tmp_path / CACHE_DIR).parent.exists()


@pytest.mark.parametrize("gpu, config, env", [("H100-80GB", {}, "inductor"),
                                              ("cpu", {"tensor_parallel_size": 2}, "inductor"),
                                              ("cpu", {"tensor_parallel_size": 1}, "off"),
                                              ("cpu", {"tensor_parallel_size": 1}, None)])
def test_gpu_multi_rank_and_default_builds_are_not_compiled(tmp_path, monkeypatch, gpu, config, env):
    if env is None:
        monkeypatch.delenv(COMPILE_ENV, raising=False)
    else:
        monkeypatch.setenv(COMPILE_ENV, env)
    loaded: list = []
    tuning: dict = {}
    assert compile_for_target(loader(0.0005, loaded), spec(gpu), 1000, tmp_path, tuning, config) == {}
    assert loaded == [] and tuning == {}


def test_compile_env_is_checked(tmp_path, monkeypatch):
    monkeypatch.setenv(COMPILE_ENV, "tvm")
    with pytest.raises(InvalidSpec, match=r"\$KILN_BUILD_COMPILE must be 'inductor' or 'off', got 'tvm'"):
        compile_for_target(loader(0.0005, []), spec("cpu"), 1000, tmp_path, {}, {})
