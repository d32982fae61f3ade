"""Tuning decisions, with a stand-in runtime whose speed and device memory depend on the knobs (the GPU
branch's arithmetic on CPU), and the real measurement on a GPU (``gpu``)."""

from __future__ import annotations

import time

import pytest
import torch
from kiln.builder.stages.tune import tune

from kiln.api import LLMEngineSpec


class TimedLLM:
    """Answers ``generate`` after a delay per decode step that depends on how it was loaded; holds
    ``device_bytes`` of a simulated device (``in_use``) until shut down."""

    def __init__(self, step_s: float, device_bytes: int = 0, in_use: dict | None = None) -> None:
        self.step_s, self.is_shut_down = step_s, False
        self.device_bytes, self.in_use = device_bytes, in_use if in_use is not None else {"bytes": 0}
        self.in_use["bytes"] += device_bytes

    def generate(self, prompts, params):
        time.sleep(self.step_s * params.max_tokens * (1 + len(prompts) / 8))

    def shutdown(self) -> None:
        self.is_shut_down = True
        self.in_use["bytes"] -= self.device_bytes


def spec(gpu: str) -> LLMEngineSpec:
    return LLMEngineSpec.model_validate({"model": {"source": "hf://org/m"}, "gpu": gpu, "maxBatchSize": 16,
                                         "maxInputLen": 64, "maxSeqLen": 128, "maxNumTokens": 64})


@pytest.mark.parametrize("graphs_faster", [True, False])
def test_gpu_tuning_keeps_cuda_graphs_only_when_they_pay(monkeypatch, graphs_faster):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    loaded = []
    in_use = {"bytes": 7_000}  # the CUDA context and whatever else was there before the loads

    def load_llm(**overrides):
        uses_graphs = "cuda_graph_batch_sizes" in overrides
        # weights + pool 50_000 bytes either way; the graphs another 3_000
        llm = TimedLLM(0.001 if uses_graphs == graphs_faster else 0.004, 50_000 + 3_000 * uses_graphs, in_use)
        loaded.append((overrides, llm))
        return llm

    tuning, overrides = tune(load_llm, spec("H100-80GB"), vocab_size=1000, memory_in_use=lambda: in_use["bytes"])
    assert tuning["cuda_graph_memory_bytes"] == 3_000 and in_use["bytes"] == 7_000
    assert tuning["eager"]["load_device_bytes"] == 50_000 and tuning["cuda_graphs"]["load_device_bytes"] == 53_000
    assert tuning["use_cuda_graphs"] is graphs_faster and tuning["measured_on"] == "NVIDIA H100 80GB HBM3"
    assert tuning["cuda_graph_batch_sizes"] == [1, 2, 4, 8, 16]
    assert overrides == ({"cuda_graph_batch_sizes": [1, 2, 4, 8, 16]} if graphs_faster else {"enforce_eager": True})
    assert all(llm.is_shut_down for _, llm in loaded) and len(loaded) == 2


def test_cpu_tuning_measures_thread_counts_and_restores_the_setting():
    before = torch.get_num_threads()
    llm = TimedLLM(0.0005)
    tuning, overrides = tune(lambda **_: llm, spec("cpu"), vocab_size=1000)
    assert overrides == {} and torch.get_num_threads() == before and llm.is_shut_down
    assert tuning["cuda_graph_memory_bytes"] is None  # CPU engines capture no graphs
    assert tuning["torch_num_threads"] in {int(n) for n in tuning["threads"]}
    rows = tuning["measurement"]["decode"]
    assert [r["batch_size"] for r in rows] == [1, 4, 8] and all(r["decode_tokens_per_s"] > 0 for r in rows)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_memory_is_measured_and_left_out_of_the_pool(toy_model):
    from kiln.builder.kv_plan import CUDA_GRAPH_MEMORY_MARGIN, plan_kv, plan_with_cuda_graphs
    from kiln.builder.model_facts import model_facts
    from kiln.engine import LLM

    model = toy_model("llama-demo")
    s = spec("H100-80GB")

    def load_llm(**overrides):
        return LLM(str(model), device="cuda", dtype="bfloat16", max_batch_size=s.max_batch_size,
                   max_seq_len=s.max_seq_len, max_num_tokens=s.max_num_tokens, num_kv_blocks=64, **overrides)

    tuning, overrides = tune(load_llm, s, vocab_size=4096)
    graph_bytes = tuning["cuda_graph_memory_bytes"]
    print(f"\nCUDA graphs for {tuning['cuda_graph_batch_sizes']}: {graph_bytes / 2**20:.1f} MiB; eager load "
          f"{tuning['eager']['load_device_bytes'] / 2**20:.1f} MiB, with graphs "
          f"{tuning['cuda_graphs']['load_device_bytes'] / 2**20:.1f} MiB")
    assert graph_bytes > 0  # captured graphs hold a private memory pool
    tuning["use_cuda_graphs"] = True  # whichever was faster here, plan as if graphs were chosen
    facts = model_facts(model)
    plan, _ = plan_with_cuda_graphs(s, facts, 10 * 2**20, tuning, overrides)
    eager = plan_kv(s, facts, 10 * 2**20)
    assert plan["cuda_graph_reserve_bytes"] >= graph_bytes * (1 + CUDA_GRAPH_MEMORY_MARGIN)
    free = plan["budget_bytes"] - plan["weight_bytes_per_rank"] - plan["activation_reserve_bytes"]
    assert plan["num_kv_blocks"] == (free - plan["cuda_graph_reserve_bytes"]) // plan["block_bytes"]
    assert plan["num_kv_blocks"] < eager["num_kv_blocks"]
