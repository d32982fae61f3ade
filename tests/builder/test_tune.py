"""Tuning decisions, with a stand-in runtime whose speed depends on the knobs (the GPU branch can't run here)."""

from __future__ import annotations

import time

import pytest
import torch
from kiln.builder.tune import tune

from kiln.api import LLMEngineSpec


class TimedLLM:
    """Answers ``generate`` after a delay per decode step that depends on how it was loaded."""

    def __init__(self, step_s: float) -> None:
        self.step_s, self.is_shut_down = step_s, False

    def generate(self, prompts, params):
        time.sleep(self.step_s * params.max_tokens * (1 + len(prompts) / 8))

    def shutdown(self) -> None:
        self.is_shut_down = True


def spec(gpu: str) -> LLMEngineSpec:
    return LLMEngineSpec.model_validate({"model": {"source": "hf://org/m"}, "gpu": gpu, "maxBatchSize": 16,
                                         "maxInputLen": 64, "maxSeqLen": 128, "maxNumTokens": 64})


@pytest.mark.parametrize("graphs_faster", [True, False])
def test_gpu_tuning_keeps_cuda_graphs_only_when_they_pay(monkeypatch, graphs_faster):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    loaded = []

    def load_llm(**overrides):
        uses_graphs = "cuda_graph_batch_sizes" in overrides
        llm = TimedLLM(0.001 if uses_graphs == graphs_faster else 0.004)
        loaded.append((overrides, llm))
        return llm

    tuning, overrides = tune(load_llm, spec("H100-80GB"), vocab_size=1000)
    assert tuning["use_cuda_graphs"] is graphs_faster and tuning["measured_on"] == "NVIDIA H100 80GB HBM3"
    assert tuning["cuda_graph_batch_sizes"] == [1, 2, 4, 8, 16]
    assert overrides == ({"cuda_graph_batch_sizes": [1, 2, 4, 8, 16]} if graphs_faster else {"enforce_eager": True})
    assert all(llm.is_shut_down for _, llm in loaded) and len(loaded) == 2


def test_cpu_tuning_measures_thread_counts_and_restores_the_setting():
    before = torch.get_num_threads()
    llm = TimedLLM(0.0005)
    tuning, overrides = tune(lambda **_: llm, spec("cpu"), vocab_size=1000)
    assert overrides == {} and torch.get_num_threads() == before and llm.is_shut_down
    assert tuning["torch_num_threads"] in {int(n) for n in tuning["threads"]}
    rows = tuning["measurement"]["decode"]
    assert [r["batch_size"] for r in rows] == [1, 4, 8] and all(r["decode_tokens_per_s"] > 0 for r in rows)
