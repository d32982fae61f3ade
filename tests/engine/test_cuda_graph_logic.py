"""The CUDA-graph runner's buckets, padding rows and scratch block, checked on CPU.

A stand-in for ``torch.cuda.CUDAGraph`` "replays" by running the captured
forward again on the static buffers, which is what a real replay computes; the
real capture is covered by test_gpu.py where a GPU exists. The Triton backend's graphs run their
kernels under Triton's interpreter here (set before triton is imported, as in test_paged_kernels.py).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine_testlib import random_prompts  # noqa: E402
from kiln.engine import SamplingParams  # noqa: E402
from kiln.engine import cuda_graphs as cg  # noqa: E402
from kiln.engine.forward_context import get_forward_context  # noqa: E402


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
    # the graph runner's (CUDA) attention is the torch path's: so is the eager run it shares a cache layout with
    kwargs = dict(num_kv_blocks=64, block_size=4, max_batch_size=8, max_seq_len=128, attention_backend="torch")
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


@pytest.mark.kernels
def test_paged_graph_runner_matches_eager(toy_model, make_llm, fake_cuda_graphs):
    """Triton backend: one graph per batch bucket (no context buckets), same tokens as eager (the
    torch backend's eager run: test_paged_kernels.py shows the two backends agree)."""
    pytest.importorskip("triton", reason="triton is not installed (pip install 'kiln[test]')")
    model_dir = toy_model("llama-tiny")
    prompts = random_prompts([5, 9, 30, 12, 7], seed=2)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (7, 3, 5, 9, 4)]
    kwargs = dict(num_kv_blocks=64, block_size=16, max_batch_size=8, max_seq_len=128)
    eager = make_llm(model_dir, attention_backend="torch", **kwargs).generate(prompts, params)
    llm = make_llm(model_dir, attention_backend="triton", **kwargs)
    runner = llm.engine.runner
    runner.graphs = cg.CUDAGraphRunner(runner.model, 16, 8, runner.num_blocks, [1, 4, 8], torch.device("cpu"),
                                       paged_kv_heads=runner.num_kv_heads)
    assert fake_cuda_graphs == [(1, 8), (4, 8), (8, 8)]
    used = []
    run = runner.graphs.run
    runner.graphs.run = lambda *a: (used.append(a[0].shape[0]), run(*a))[1]
    graphed = llm.generate(prompts, params)
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    assert used and set(used) > {5}


class EchoModel(torch.nn.Module):
    """Stands in for a model: its "logits" are its inputs, and it records the attention metadata it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = []

    def forward(self, input_ids, positions):
        self.seen.append(get_forward_context().attention)
        return torch.stack([input_ids, positions], 1)

    def compute_logits(self, hidden):
        return hidden.clone()


@pytest.mark.parametrize("paged", [True, False])
def test_static_buffers_updated_in_place(fake_cuda_graphs, paged):
    scratch = 99
    runner = cg.CUDAGraphRunner(EchoModel(), 4, 20, scratch, [2, 4], torch.device("cpu"),
                                paged_kv_heads=2 if paged else None)
    # Paged kernels take lengths: batch buckets only. The gather needs context buckets too.
    assert runner.context_buckets == ([20] if paged else [16, 20])
    assert sorted(fake_cuda_graphs) == sorted((b, c) for b in (2, 4) for c in runner.context_buckets)
    md = runner.model.seen[-1]
    assert (md.paged is not None) == paged
    if paged:  # the kernels read int32 views of the static buffers; the split count is fixed per bucket
        assert md.paged.decode_block_tables.dtype == torch.int32
        assert md.paged.decode_block_tables.data_ptr() == runner.block_tables.data_ptr()
    ptrs = (runner.input_ids.data_ptr(), runner.block_tables.data_ptr(), runner.ctx_lens.data_ptr())
    # A step of 3 rows replays the 4-row graph; row 3 is padding (scratch slot, one token of the scratch block).
    out = runner.run(torch.tensor([7, 8, 9]), torch.tensor([10, 11, 12]), torch.tensor([40, 41, 42]),
                     torch.tensor([[10, 11, 12], [13, 0, 0], [14, 15, 0]]), torch.tensor([11, 2, 6]))
    assert out.tolist() == [[7, 10], [8, 11], [9, 12]]
    assert runner.bucket(3, 3) == ((4, 20) if paged else (4, 16))
    assert runner.ctx_lens.tolist()[:4] == [11, 2, 6, 1]
    assert runner.slot_mapping.tolist() == [40, 41, 42, scratch * 4]
    assert runner.block_tables[:3, :3].tolist() == [[10, 11, 12], [13, 0, 0], [14, 15, 0]]
    assert (runner.block_tables[:, 3:] == scratch).all()  # past the step's width: the scratch block
    # Then a step of 1 row (2-row graph): row 1 turns from a live row into padding; row 0's stale
    # second block is left as it was on the paged path (the kernel stops at the row's length) and
    # pointed at the scratch block on the gather path.
    runner.run(torch.tensor([5]), torch.tensor([6]), torch.tensor([50]), torch.tensor([[20]]), torch.tensor([3]))
    assert runner.ctx_lens[:2].tolist() == [3, 1] and runner.slot_mapping[:2].tolist() == [50, scratch * 4]
    assert runner.block_tables[0, 0] == 20 and runner.block_tables[1, 0] == scratch
    assert runner.block_tables[0, 1] == (11 if paged else scratch)
    assert (runner.input_ids.data_ptr(), runner.block_tables.data_ptr(), runner.ctx_lens.data_ptr()) == ptrs
