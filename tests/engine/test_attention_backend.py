"""``attention_backend``: how "auto" resolves, the errors a user can cause, and a CPU engine without triton."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest
from kiln.engine import ConfigError
from kiln.engine.config import EngineConfig, resolve_attention_backend
from kiln.engine.kernels import native


@pytest.fixture
def triton_installed(monkeypatch):
    """Call with False to make ``find_spec("triton")`` say triton is not installed."""
    real = importlib.util.find_spec

    def set_installed(installed: bool) -> None:
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: None if name == "triton" and not installed else real(name, *a))

    return set_installed


@pytest.mark.parametrize("installed,interpret,backend,device,expected", [
    (True, "0", "auto", "cuda", "triton"),
    (False, "0", "auto", "cuda", "torch"),
    (True, "1", "auto", "cpu", "torch"),   # auto never picks the interpreter (nor native: no dtype given)
    (True, "0", "torch", "cuda", "torch"),
    (True, "0", "triton", "cuda", "triton"),
    (False, "0", "triton", "cuda", None),  # not installed
    (True, "0", "triton", "cpu", None),    # CPU without the interpreter
    (True, "1", "triton", "cpu", "triton"),
])
def test_resolution(triton_installed, monkeypatch, installed, interpret, backend, device, expected):
    triton_installed(installed)
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    assert resolve_attention_backend(backend, device) == expected


def test_config_errors_name_the_field(toy_model, monkeypatch):
    model_dir = str(toy_model("llama-tiny"))
    with pytest.raises(ConfigError, match=r"^attention_backend must be one of auto, torch, triton, native, got 'flash'$"):
        EngineConfig(model=model_dir, attention_backend="flash", device="cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match=r"^attention_backend 'triton' needs .*use 'auto' or 'torch'$"):
        EngineConfig(model=model_dir, attention_backend="triton", device="cpu")
    # CPU "auto" is kiln's C kernels where they load (tests/engine/test_cpu_kernels.py), else torch
    assert EngineConfig(model=model_dir, device="cpu").attention_backend == ("native" if native.kernels() else "torch")
    with pytest.raises(ConfigError, match=r"^attention_backend 'native' .* use 'auto' or 'torch'$"):
        EngineConfig(model=model_dir, attention_backend="native", device="cpu", dtype="float16", kv_cache_dtype="auto")


def test_cpu_engine_runs_without_triton(toy_model):
    """With triton unimportable the engine imports, resolves "auto" to a CPU backend and generates."""
    model_dir = toy_model("llama-tiny")
    script = textwrap.dedent(f"""
        import sys
        sys.modules["triton"] = None  # import triton fails; find_spec says not installed
        from kiln.engine import LLM, SamplingParams
        llm = LLM({str(model_dir)!r}, num_kv_blocks=16, device="cpu")
        assert llm.engine.runner.attention_backend in ("native", "torch")
        out = llm.generate([[1, 5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        assert len(out[0].token_ids) == 3
        assert not any(m.startswith("kiln.engine.kernels.paged_attention") for m in sys.modules)
        llm.shutdown()
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
