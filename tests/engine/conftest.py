"""Engine test fixtures: engines that must hand every KV block back, and a Hugging Face reference.

``make_llm(model_dir, **kwargs)`` builds an ``LLM``; when the test ends, every
engine it built must have no running or waiting request and every KV block
free (no leaks, aborts included). ``hf_greedy(model_dir, prompt, n)`` is
transformers' own ``generate(do_sample=False)`` output for one prompt, cached
across the session (one unpadded prompt at a time: the cleanest reference).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

# One intra-op thread: on a shared 2-core machine two OpenMP threads spin-wait on each other and
# every small op costs a scheduler quantum (measured 20-40x slower under load). HF and kiln share it.
torch.set_num_threads(1)


def assert_no_leaks(engine) -> None:
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0, stats
    assert stats.num_free_blocks == stats.num_total_blocks, f"KV blocks leaked: {stats}"
    assert all(b.ref_count == 0 for b in engine.engine.block_manager.blocks)


@pytest.fixture
def make_llm() -> Iterator[Callable[..., object]]:
    from kiln.engine import LLM

    built = []

    def make(model_dir: Path, **kwargs):
        llm = LLM(model_dir, **kwargs)
        built.append(llm)
        return llm

    yield make
    try:
        for llm in built:
            assert_no_leaks(llm)
    finally:
        for llm in built:
            llm.shutdown()


_HF_MODELS: dict[str, object] = {}
_HF_OUT: dict[tuple, list[int]] = {}


@pytest.fixture(scope="session")
def hf_greedy() -> Callable[[Path, list[int], int], list[int]]:
    from transformers import AutoModelForCausalLM

    def run(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (str(model_dir), tuple(prompt), max_new_tokens)
        if key not in _HF_OUT:
            if str(model_dir) not in _HF_MODELS:
                _HF_MODELS[str(model_dir)] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            model = _HF_MODELS[str(model_dir)]
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                                     pad_token_id=0)
            _HF_OUT[key] = out[0, len(prompt):].tolist()
        return _HF_OUT[key]

    return run


@pytest.fixture
def w8a8_fresh(monkeypatch, tmp_path):
    """No kiln CPU library loaded or shipped, no ISA cap and no excluded candidate: the host's own W8A8 tiles. The
    libraries come from the compile cache every engine uses (their names hold the sources' and flags' hash, so a
    cached one is this kiln's): a compile is 5-25 s a level on a busy host, once per cache, not once per module."""
    from kiln.engine.kernels import candidates, cpu_library, isa, native

    monkeypatch.delenv(isa.ISA_ENV, raising=False)
    monkeypatch.delenv(candidates.EXCLUDE_ENV, raising=False)
    monkeypatch.setattr(cpu_library, "_shipped", {})
    native.reset()
    yield tmp_path
    native.reset()
