"""A second copy of an int8 weight (candidates.SECOND_COPY): kiln's panels run the row buckets kiln's W8A8 wins, torch's
prepacked copy the buckets FBGEMM wins by the margin, where one layout per weight made one side pay (issue 41:
batch-1 decode at half speed where torch's layout won the summed time). The choice (table, packing), the packed
weight's two paths, and an int8 engine bound so: the decoder stack for decode steps, the copy for prefill."""

from __future__ import annotations

import platform
import shutil

import pytest
import torch
from engine_testlib import random_prompts
from kiln.engine.kernels import candidates, native, torch_w8a8
from kiln.engine.layers.quant import quantize_weight
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.tactics import host_signature
from kiln.engine.tactics.bind import stack_layout
from kiln.engine.tactics.resolve import packing
from kiln.engine.tactics.table import TacticTable, choose
from kiln.engine.tactics.timing import BucketTiming, LinearSite, bucket_rows

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("cc") is None,
                                reason="W8A8 runs in kiln's x86-64 library, compiled here")


@pytest.fixture
def units(w8a8_fresh, monkeypatch):
    """The host's own W8A8 tiles (conftest's ``w8a8_fresh``: from the shared compile cache), no second copy
    turned off."""
    monkeypatch.delenv(candidates.SECOND_COPY_ENV, raising=False)
    kernels = native.kernels()
    why = "kiln's kernels do not load" if kernels is None else kernels.gemm_kernels[torch.float32]["w8a8"]
    why = why or torch_w8a8.unavailable()
    if why:
        pytest.skip(f"W8A8 (kiln's and torch's) does not run here: {why}")
    return kernels


def timings(rows_list, kiln_upto: int = 1, ratio: float = 2.0) -> list[BucketTiming]:
    """kiln-w8a8 ``ratio`` times faster than torch-w8a8 up to ``kiln_upto`` rows, torch's that much faster above."""
    out = []
    for rows in rows_list:
        base = 1e-6 * rows
        kiln, torch_ = (base, base * ratio) if rows <= kiln_upto else (base * ratio, base)
        out.append(BucketTiming(rows, {"kiln-w8a8": kiln, "kiln-fma": 4 * base, "torch-w8a8": torch_}))
    return out


SITE = LinearSite(torch.float32, 128, 256, max_rows=64, quant="int8")
STACKED = LinearSite(torch.float32, 128, 256, max_rows=64, stacked=True, quant="int8")


def test_each_side_runs_the_buckets_it_wins_by_the_margin(units):
    choice = choose(SITE.key, timings(bucket_rows(64)))
    assert choice.layout == "qlinear"  # one layout per weight: torch's wins the summed time...
    layout, kernels = packing(choice, SITE, units)
    assert layout == "kiln" and kernels == ["w8a8"] + ["qlinear"] * 15  # ...its copy runs past one row only
    # the copy must win by the margin: no copy for 10 %
    near = choose(SITE.key, timings(bucket_rows(64), ratio=1.1))
    assert packing(near, SITE, units) == (near.layout, None if near.layout == "qlinear" else ["w8a8"] * 16)
    # a decoder layer's linear runs kiln's panels where they win at all (the stack; the timings are in cache, a
    # decode streams from memory); outside the stack (the LM head) they too must win by the margin
    one_row = BucketTiming(1, {"kiln-w8a8": 0.98e-6, "torch-w8a8": 1e-6})
    barely = choose(SITE.key, [one_row] + timings(bucket_rows(64)[1:]))
    assert packing(barely, STACKED, units) == ("kiln", ["w8a8"] + ["qlinear"] * 15)
    assert packing(barely, SITE, units) == ("qlinear", None)
    # the table chose kiln's layout, and torch wins big buckets: the copy runs them
    kiln_first = choose(SITE.key, timings([1, 2, 4, 8], kiln_upto=4, ratio=1.5))
    assert kiln_first.layout == "kiln"
    assert packing(kiln_first, SITE, units) == ("kiln", ["w8a8"] * 3 + ["qlinear"] * 13)


def test_no_second_copy_when_turned_off_excluded_or_one_kernel(units, monkeypatch):
    choice = choose(SITE.key, timings(bucket_rows(64)))
    assert packing(choice, SITE, units, one_kernel=True)[0] == "qlinear"  # batch_invariant: one kernel, one copy
    kiln_first = choose(SITE.key, timings([1, 2, 4, 8], kiln_upto=4, ratio=1.5))
    assert packing(kiln_first, SITE, units, exclude=("torch-w8a8",)) == ("kiln", ["w8a8"] * 16)
    monkeypatch.setenv(candidates.SECOND_COPY_ENV, "0")
    assert packing(choice, SITE, units) == ("qlinear", None)
    assert packing(kiln_first, SITE, units) == ("kiln", ["w8a8"] * 16)


def test_the_packed_weight_runs_each_bucket_on_its_copy(units):
    gen = torch.Generator().manual_seed(5)
    q, s = quantize_weight(torch.randn(96, 80, generator=gen), "int8")
    both = units.pack_linear(q, ["w8a8"] + ["qlinear"] * 15, s, torch.float32)
    kiln_only = units.pack_linear(q, ["w8a8"] * 16, s, torch.float32)
    torch_only = torch_w8a8.QLinear(q, s)
    assert both.qlinear is not None and kiln_only.qlinear is None
    one, many = torch.randn(1, 80, generator=gen), torch.randn(9, 80, generator=gen)
    bias = torch.randn(96, generator=gen)
    assert torch.equal(both(one, bias), kiln_only(one, bias))  # bucket 0: kiln's W8A8 on the panels
    assert torch.equal(both(many, bias), torch_only(many, bias))  # bucket 4: torch's on its copy
    with pytest.raises(ValueError, match="its own copy"):
        kiln_only.set_tactics(["qlinear"] * 16)
    with pytest.raises(ValueError, match="int8 weights"):
        units.pack_linear(torch.randn(16, 16), ["qlinear"] * 16)


def test_an_int8_engine_runs_decode_in_the_stack_and_prefill_on_the_copy(units, toy_model, make_llm, tmp_path,
                                                                          monkeypatch):
    """A table whose every int8 site is won by kiln at one row and by torch above it: every layer linear holds
    both copies, the decoder stack is bound (a decode step of one sequence runs it in C), a prefill runs the
    copy, and the greedy tokens follow the float engine's as the W8A8 engines' do (test_w8a8.py)."""
    model_dir = toy_model("llama-tiny", dtype="float32")
    kw = dict(attention_backend="native", dtype="float32", num_kv_blocks=64, block_size=16, max_num_tokens=256,
              max_batch_size=1, device="cpu")
    forced = make_llm(model_dir, quantization="int8", tactics="kiln-w8a8", **kw)
    table = TacticTable(host=host_signature.cpu_signature())
    for site in forced.engine.runner.tactic_sites:
        table.linear[site.key] = choose(site.key, timings(bucket_rows(site.max_rows)))
    path = table.save(tmp_path / "tactics.json")
    llm = make_llm(model_dir, quantization="int8", tactics=str(path), **kw)
    info = llm.engine.config.tactics_info
    model = llm.engine.runner.model
    layer_linears = 4 * len(model.model.layers)  # qkv, o, gate_up, down; the head sees one row: kiln's alone
    assert info["origin"] == "artifact" and info["layouts"] == {"kiln+qlinear": layer_linears, "kiln": 1}
    # the stack's layout rule counts a shape holding both copies at the faster side's cost: fused, kiln's layout
    sites = [(None, site) for site in forced.engine.runner.tactic_sites]
    assert any(site.stacked for _, site in sites)
    fused, why = stack_layout(table, sites, units)
    assert fused and why.startswith("kiln's layout (or its panels beside a second copy) within 1.1x"), why
    assert not stack_layout(table, sites, units, one_kernel=True)[0]  # no copy: torch's layout wins the shapes
    stack = model.model.native_stack
    assert stack is not None and stack.can_run(1) and not stack.can_run(12)
    calls = []
    original = torch_w8a8.QLinear.__call__
    monkeypatch.setattr(torch_w8a8.QLinear, "__call__",
                        lambda self, x, bias=None: calls.append(x.shape[0]) or original(self, x, bias))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = random_prompts([12, 30, 7, 21], seed=4)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert calls and min(calls) > 1  # prefills on the copy; no one-row call left the stack's W8A8
    float_llm = make_llm(model_dir, **kw)
    want = [o.token_ids for o in float_llm.generate(prompts, params)]
    agree = sum(a == b for x, y in zip(want, got, strict=True) for a, b in zip(x, y, strict=True)) / 20
    assert agree >= 0.8, (want, got)
