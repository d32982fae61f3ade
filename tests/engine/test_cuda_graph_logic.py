"""The CUDA-graph runner's buckets, padding rows and scratch block, checked on CPU.

A stand-in for ``torch.cuda.CUDAGraph`` "replays" by running the captured
forward again on the static buffers, which is what a real replay computes; the
real capture is covered by test_gpu.py where a GPU exists.
"""

from __future__ import annotations

import pytest
import torch
from engine_testlib import random_prompts
from kiln.engine import SamplingParams
from kiln.engine import cuda_graphs as cg


class FakeGraph:
    def __init__(self, fn) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


@pytest.fixture
def fake_cuda_graphs(monkeypatch):
    captured: list[tuple[int, int]] = []
    original = cg.CUDAGraphRunner._capture

    @torch.inference_mode()
    def capture(self):
        # Record which (batch, context) buckets exist; replays re-run the forward into the static output.
        for nblocks in self.context_buckets:
            for bs in self.batch_sizes:
                self.outputs[bs, nblocks] = self._forward(bs, nblocks)
                self.graphs[bs, nblocks] = FakeGraph(
                    lambda bs=bs, nblocks=nblocks: self.outputs[bs, nblocks].copy_(self._forward(bs, nblocks)))
                captured.append((bs, nblocks))

    monkeypatch.setattr(cg.CUDAGraphRunner, "_capture", capture)
    yield captured
    monkeypatch.setattr(cg.CUDAGraphRunner, "_capture", original)


def test_graph_runner_matches_eager(toy_model, make_llm, fake_cuda_graphs):
    model_dir = toy_model("llama-tiny")
    prompts = random_prompts([5, 9, 30, 12, 7], seed=2)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 3, 9, 16, 5)]
    kwargs = dict(num_kv_blocks=64, block_size=4, max_batch_size=8, max_seq_len=128)
    eager = make_llm(model_dir, **kwargs).generate(prompts, params)
    llm = make_llm(model_dir, **kwargs)
    runner = llm.engine.runner
    runner.graphs = cg.CUDAGraphRunner(runner.model, 4, 32, runner.num_blocks, [1, 2, 4, 8], torch.device("cpu"))
    assert runner.graphs.context_buckets == [16, 32]
    used = []
    run = runner.graphs.run
    runner.graphs.run = lambda *a: (used.append(a[0].shape[0]), run(*a))[1]
    graphed = llm.generate(prompts, params)
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    assert used and set(used) > {5}  # decode steps of 5 rows ran padded to the 8-row graph
