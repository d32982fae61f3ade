"""Tactics (kiln.engine.tactics): every candidate a linear can run computes F.linear, the table chooses by
measurement and keeps to its layout, survives a round trip and refuses what is corrupt or foreign, an
engine packs by it, and a table measured on another kind of host is re-timed and cached, not trusted."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from kiln.engine.kernels import candidates, native
from kiln.engine.tactics import host_signature, resolve
from kiln.engine.tactics.table import TacticsError, TacticTable, _digest, choose
from kiln.engine.tactics.timing import BucketTiming, LinearSite, bucket_rows


def _runnable(name, dtype):
    return candidates.why_not(name, dtype, native.kernels())


@pytest.mark.parametrize("quant", [None, "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(candidates.LINEAR))
def test_every_candidate_computes_the_linear(name, dtype, quant):
    """Float weights, and int8 weights with their per-channel scales (weight-only: x (q s)^T exactly, up to
    the activation dtype's rounding), at decode and prefill row counts and a K that is no multiple of 32."""
    from kiln.engine.layers.quant import quantize_weight

    why = candidates.why_not(name, dtype, native.kernels(), quant)
    if why:
        pytest.skip(f"{name} on {dtype} {quant or ''}: {why}")
    cand = candidates.LINEAR[name]
    g = torch.Generator().manual_seed(1)
    w, b = (torch.randn(200, 96 + 14, generator=g) * 0.05).to(dtype), torch.randn(200, generator=g).to(dtype)
    scale = None
    if quant:
        w, scale = quantize_weight(w, quant)
    tactics = [cand.gemm_kernel] * native.ROW_BUCKETS if cand.gemm_kernel else None
    packed = candidates.pack(cand.layout, w, native.kernels(), 16, tactics, scale, dtype)
    exact = w.double() if scale is None else w.double() * scale.double()[:, None]
    for rows in (1, 7, 16, 40):
        x = torch.randn(rows, w.shape[1], generator=g).to(dtype)
        y = candidates.run(packed, x, b, plain=cand.layout == "plain", scale=scale)
        ref = F.linear(x.double(), exact, b.double())
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        if cand.quantizes_activations:  # W8A8: the activations' int8 rounding (exactness: test_w8a8.py)
            tol = 4e-2
        torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)


def test_buckets_cover_every_row_count():
    assert bucket_rows(1) == [1]
    assert bucket_rows(48) == [1, 2, 4, 8, 16, 32, 48]
    assert bucket_rows(2048)[-1] == 2048 and len(bucket_rows(2048)) == 12
    for rows in (1, 2, 3, 17, 64, 65, 2048):  # the bucket a call lands in was timed at >= its rows
        b = native.row_bucket(rows)
        assert bucket_rows(4096)[b] >= rows and (b == 0 or bucket_rows(4096)[b - 1] < rows)


def _timings(per_rows: dict[int, dict[str, float]]) -> list[BucketTiming]:
    return [BucketTiming(rows, {k: v * 1e-6 for k, v in times.items()}) for rows, times in per_rows.items()]


def test_choice_is_the_layout_cheapest_per_token_then_the_fastest_kernel_of_it():
    # kiln's AMX wins small calls, oneDNN large ones: per token, kiln's layout costs less overall
    t = _timings({1: {"kiln-fma": 10, "kiln-amx": 11, "onednn": 20, "aten": 30},
                  16: {"kiln-fma": 40, "kiln-amx": 15, "onednn": 25, "aten": 40},
                  256: {"kiln-fma": 900, "kiln-amx": 120, "onednn": 100, "aten": 110}})
    c = choose("bfloat16:64x64", t)
    assert c.layout == "kiln" and c.kernels() == ["kiln-fma", "kiln-amx", "kiln-amx"]
    assert [b["winner"] for b in c.buckets] == ["kiln-fma", "kiln-amx", "onednn"]  # the report shows the cost
    # where oneDNN is faster everywhere, its layout wins and runs every bucket
    t = _timings({1: {"kiln-fma": 30, "onednn": 20}, 64: {"kiln-fma": 300, "onednn": 100}})
    assert choose("float32:64x64", t).kernels() == ["onednn", "onednn"]


def _table() -> TacticTable:
    t = TacticTable(host=host_signature.cpu_signature())
    t.linear["float32:8x4"] = choose("float32:8x4", _timings({1: {"kiln-fma": 1, "aten": 2}}))
    t.model["decoder_stack"] = {"winner": "fused", "us": {"fused": 1.0, "modules": 2.0}}
    return t


def test_table_round_trip_and_refusals(tmp_path):
    path = _table().save(tmp_path / "tactics.json")
    back = TacticTable.load(path)
    assert back.linear["float32:8x4"].kernels() == ["kiln-fma"] and back.model["decoder_stack"]["winner"] == "fused"
    doc = json.loads(path.read_text())

    def refused(mutate, match):
        bad = json.loads(json.dumps(doc))
        mutate(bad)
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(TacticsError, match=match):
            TacticTable.load(tmp_path / "bad.json")

    refused(lambda d: d["linear"][0]["buckets"][0].update(runs="aten"), "sha256 does not match")
    refused(lambda d: d.update(format="kiln-tactics/0"), "this kiln reads 'kiln-tactics/1'")

    def sign(d, **bucket):
        d["linear"][0]["buckets"][0].update(bucket)
        d["sha256"] = _digest(d)

    refused(lambda d: sign(d, runs="cublas"), "runs 'cublas', which is not a candidate")
    refused(lambda d: sign(d, runs="onednn"), "runs onednn on weights packed for kiln")
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(TacticsError, match=r"junk.json is unreadable.*delete the file"):
        TacticTable.load(tmp_path / "junk.json")


def test_another_models_table_is_refused(tmp_path):
    path = _table().save(tmp_path / "tactics.json")
    site = LinearSite(torch.float32, 16, 16, 4)
    with pytest.raises(TacticsError, match=r"no entry for the model's linear\(s\) float32:16x16"):
        resolve.resolve(str(path), [site], native.kernels(), str(tmp_path / "cache"))


def test_a_stage_times_only_the_shapes_its_build_did_not_load(tmp_path):
    """Pipeline stages past the first have linears (the LM head) the build's load never saw: those are
    timed at load, the rest run as built."""
    built, extra = LinearSite(torch.float32, 64, 64, 4), LinearSite(torch.float32, 96, 64, 4)
    path = resolve.measure([built], native.kernels(), 5).save(tmp_path / "tactics.json")
    table, info = resolve.resolve(str(path), [built, extra], native.kernels(), str(tmp_path / "cache"))
    assert info["source"] == "artifact (+1 shape(s) timed here)" and set(table.linear) == {built.key, extra.key}


def test_matching_host_uses_the_table_as_is_and_another_host_retimes_once(tmp_path, monkeypatch):
    sites = [LinearSite(torch.float32, 64, 64, 8)]
    table = resolve.measure(sites, native.kernels(), 10)
    assert table.host == host_signature.cpu_signature() and set(table.linear) == {"float32:64x64"}
    table.model["decoder_stack"] = {"winner": "modules"}
    path = table.save(tmp_path / "tactics.json")

    calls = []
    real = resolve.measure
    monkeypatch.setattr(resolve, "measure", lambda *a, **k: calls.append(1) or real(*a, **k))
    got, info = resolve.resolve(str(path), sites, native.kernels(), str(tmp_path / "cache"))
    assert info["source"] == "artifact" and not calls  # no timing at start

    doc = json.loads(path.read_text())
    doc["host"]["model"] = "Some Other CPU"
    del doc["sha256"]
    foreign = TacticTable.from_json({**doc, "sha256": _digest(doc)})
    path = foreign.save(tmp_path / "foreign.json")
    got, info = resolve.resolve(str(path), sites, native.kernels(), str(tmp_path / "cache"))
    assert info["source"] == "re-timed" and len(calls) == 1
    assert any(d.startswith("model: 'Some Other CPU'") for d in info["differs"])
    assert got.model == {"decoder_stack": {"winner": "modules"}}  # the build's model-level choices stay
    assert os.path.isfile(info["table"])
    got, info = resolve.resolve(str(path), sites, native.kernels(), str(tmp_path / "cache"))
    assert info["source"] == "re-timed (cached)" and len(calls) == 1


def test_a_candidate_the_host_cannot_run_is_refused():
    why = _runnable("kiln-amx", torch.float32)
    assert why == "AMX multiplies bf16, not float32" or "not loaded" in why
    choice = choose("float32:64x64", _timings({1: {"kiln-amx": 1, "kiln-fma": 2}}))
    with pytest.raises(TacticsError, match="runs kiln-amx, which cannot run here"):
        resolve.packing(choice, LinearSite(torch.float32, 64, 64, 1), native.kernels())


@pytest.mark.parametrize("tactics,kind", [("kiln-fma", "kiln"), ("onednn", "onednn"), ("aten", "plain")])
@pytest.mark.parametrize("tied", [False, True])
def test_engine_packs_every_linear_by_its_table(toy_model, make_llm, tactics, kind, tied):
    """Each layout serves every linear and the LM head from one copy: kiln's panels or oneDNN's blocked
    weight replace the plain one (a tied head's is the embedding's, kept for lookups); plain keeps it.
    The tokens are the same as torch's float32 linear would give (float32, tolerance-free: a random
    tiny model's greedy argmax is far from ties)."""
    from kiln.engine import SamplingParams
    from kiln.engine.layers.embedding import ParallelLMHead
    from kiln.engine.layers.linear import LinearBase

    why = _runnable(tactics, torch.float32)
    if why:
        pytest.skip(f"{tactics}: {why}")
    model_dir = toy_model("llama-tiny", tie_word_embeddings=tied)
    llm = make_llm(model_dir, attention_backend="auto", num_kv_blocks=16, device="cpu", tactics=tactics)
    model = llm.engine.runner.model
    assert llm.engine.config.tactics_info["layouts"] == {kind: 9}
    linears = [m for m in model.modules() if isinstance(m, (LinearBase, ParallelLMHead))]
    want = {"kiln": native.PackedLinear, "onednn": torch.Tensor, "plain": type(None)}[kind]
    assert all(isinstance(m.packed_weight, want) for m in linears)
    assert all((m.weight.numel() == 0) == (kind != "plain") for m in linears if isinstance(m, LinearBase))
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert model.model.embed_tokens.weight.numel() > 0
    out = llm.generate([[5, 9, 33, 2, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(out[0].token_ids) == 6


_CAPPED = """
import json, torch
from kiln.engine.kernels import candidates, native
k = native.kernels()
print(json.dumps({"level": k and k.level, "onednn_isa": torch.backends.mkldnn.is_available(),
                  "runnable": {dt: [n for n in candidates.LINEAR if candidates.why_not(n, getattr(torch, dt), k) is None]
                               for dt in ("float32", "bfloat16")}}))
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 ISA caps")
@pytest.mark.parametrize("cap", ["avx2", "avx512", "avx512_bf16"])
def test_isa_caps_emulate_the_other_host_kinds(cap):
    """--max-isa's environment, set before torch starts: kiln's kernels stay at or below the cap (an AVX2
    host's library, no vdpbf16ps without AVX512-BF16, no AMX below it), so one host runs the others' paths."""
    from kiln.engine import cpu_target
    from kiln.engine.kernels.isa import ISA_CAPS

    flags = cpu_target.cpu_flags()
    if cap != "avx2" and "avx512f" not in flags:
        pytest.skip(f"this host has no AVX-512 to cap at {cap}")
    env = {**os.environ, **ISA_CAPS[cap]}
    out = subprocess.run([sys.executable, "-P", "-c", _CAPPED], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["level"] == ("x86-64-v3" if cap == "avx2" else "x86-64-v4")
    assert "kiln-amx" not in got["runnable"]["bfloat16"]
    assert ("kiln-fma" in got["runnable"]["bfloat16"]) == (cap == "avx512_bf16" and "avx512_bf16" in flags)
    assert "kiln-fma" in got["runnable"]["float32"]


_CAPPED_ONEDNN = """
import torch, torch.nn.functional as F
from kiln.engine.kernels import native
k = native.kernels()
g = torch.Generator().manual_seed(3)
for m, kk, n in ((13, 768, 1280), (5, 77, 70), (40, 1024, 64)):
    w, x = (torch.randn(n, kk, generator=g) * 0.05).bfloat16(), torch.randn(m, kk, generator=g).bfloat16()
    y, ref = k.pack_linear(w, ["fma"] * native.ROW_BUCKETS)(x).double(), F.linear(x, w).double()
    assert ((y - ref).abs() <= torch.maximum(y.abs(), ref.abs()) * 2 ** -7 + 1e-5).all(), (m, kk, n)
print("close")
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 ISA caps")
def test_capped_onednn_runs_below_amx_and_agrees_with_kilns_bf16_kernel():
    """Capped at avx512_bf16 (a Zen 4's ISA), oneDNN really runs its AVX512-BF16 kernels, not AMX (its own
    verbose log says which), and kiln's vdpbf16ps GEMM is within one bf16 ulp of it. Not bit for bit: even
    with the same instruction, oneDNN's K blocking depends on the host (equal up to K = 1024 on a Zen 4,
    one ulp apart at K = 768 on a Xeon capped so)."""
    from kiln.engine import cpu_target
    from kiln.engine.kernels.isa import ISA_CAPS

    if "avx512_bf16" not in cpu_target.cpu_flags():
        pytest.skip("the CPU has no AVX512-BF16: kiln's bf16 FMA kernel does not run here")
    env = {**os.environ, **ISA_CAPS["avx512_bf16"], "ONEDNN_VERBOSE": "1"}
    out = subprocess.run([sys.executable, "-P", "-c", _CAPPED_ONEDNN], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("close"), out.stderr[-2000:]
    kernels = [line.split(",")[6] for line in out.stdout.splitlines() if ",exec,cpu,matmul," in line]
    assert kernels and all("avx512_core_bf16" in k and "amx" not in k for k in kernels), kernels


def test_a_bad_tactics_setting_names_the_field(toy_model):
    from kiln.engine import ConfigError
    from kiln.engine.config import EngineConfig

    with pytest.raises(ConfigError, match=r"^tactics must be 'auto', a candidate \(kiln-fma, kiln-amx, onednn-panels, "
                                          r"onednn, aten, kiln-w8a8, kiln-w8a8-amx, torch-w8a8, kiln-gguf, kiln-gguf-f32\) or a "
                                          r"tactics.json file, "
                                          r"got 'fastest'$"):
        EngineConfig(model=str(toy_model("llama-tiny")), device="cpu", tactics="fastest")


def test_steps_that_run_onednn_leave_the_stack_and_agree_with_the_module_path(toy_model, make_llm, monkeypatch,
                                                                             tmp_path):
    """A table whose small buckets run kiln's C kernels and large ones oneDNN on the same panels
    (``onednn-panels``): prefill steps take the module path (only Python can call oneDNN), decode steps the
    decoder stack, and the tokens and logprobs equal a run that is all module path."""
    from engine_testlib import random_prompts
    from kiln.engine import SamplingParams
    from kiln.engine.tactics.table import LinearChoice

    if _runnable("onednn-panels", torch.bfloat16) or _runnable("kiln-fma", torch.bfloat16):
        pytest.skip("needs kiln's bf16 kernels and oneDNN's bf16 GEMM: " + str(
            _runnable("onednn-panels", torch.bfloat16) or _runnable("kiln-fma", torch.bfloat16)))
    model_dir = toy_model("llama-tiny", dtype="bfloat16", hidden_size=128, intermediate_size=256,
                          tie_word_embeddings=False)
    kwargs = dict(dtype="bfloat16", attention_backend="native", num_kv_blocks=64, max_num_tokens=256,
                  max_batch_size=4, device="cpu")
    sites = make_llm(model_dir, tactics="aten", **kwargs).engine.runner.tactic_sites
    table = TacticTable(host=host_signature.cpu_signature(), model={"decoder_stack": {"winner": "fused"}})
    for s in sites:
        table.linear[s.key] = LinearChoice(s.key, "kiln", [
            {"rows": r, "runs": "kiln-fma" if r <= 16 else "onednn-panels", "winner": "kiln-fma", "runner_up": None,
             "us": {}, "pruned": [], "inferred_from": None} for r in bucket_rows(s.max_rows)])
    path = table.save(tmp_path / "tactics.json")
    calls = []
    run = native.DecoderStack.__call__
    monkeypatch.setattr(native.DecoderStack, "__call__", lambda self, *a: calls.append(a[0].shape[0]) or run(self, *a))
    prompts = random_prompts([40, 70], seed=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = {}
    for name in ("stack", "modules"):
        llm = make_llm(model_dir, tactics=str(path), **kwargs)
        assert llm.engine.config.tactics_info["source"] == "artifact"
        if name == "modules":
            llm.engine.runner.model.model.native_stack = None
        outs[name] = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
    assert outs["stack"] == outs["modules"]
    assert calls and max(calls) <= 16  # decode steps in the stack, the 110-token prefill step not


def test_prefill_attention_on_tiles_is_timed_and_applied(toy_model, make_llm):
    """A bf16 engine on kiln's attention times a prefill group on AMX tiles against vdpbf16ps and runs the
    winner (tiles from 16 query vectors on); the stack gets the same choice."""
    if _runnable("kiln-amx", torch.bfloat16):
        pytest.skip(f"AMX: {_runnable('kiln-amx', torch.bfloat16)}")
    model_dir = toy_model("llama-tiny", dtype="bfloat16", hidden_size=128, intermediate_size=256)  # head_dim 32
    llm = make_llm(model_dir, dtype="bfloat16", attention_backend="native", num_kv_blocks=32, device="cpu")
    tiles = llm.engine.runner.tactics.model["attention_tiles"]
    assert set(tiles["us"]) == {"amx", "vdpbf16ps"} and tiles["winner"] == min(tiles["us"], key=tiles["us"].get)
    assert native.kernels().attention_amx_queries == (16 if tiles["winner"] == "amx" else 0)
    stack = llm.engine.runner.model.model.native_stack
    assert stack is not None and stack.shape.attn_amx_queries == native.kernels().attention_amx_queries


def test_a_tensor_parallel_rank_times_its_mlp_slices_without_collectives(monkeypatch):
    """Ranks time the MLP's slices apart and repeat it a different number of times each: an all-reduce inside
    that timing pairs with another rank's of another size (gloo: 'collective mismatch'), so none may run."""
    from kiln.engine import parallel
    from kiln.engine.models.llama import LlamaMLP
    from kiln.engine.tactics.timing import time_mlp_slices

    def no_peer(*args, **kwargs):
        raise AssertionError("a collective ran while timing one rank's MLP")

    monkeypatch.setattr(parallel.dist, "all_reduce", no_peer)
    with parallel.shard_context(0, 2):
        mlp = LlamaMLP({"hidden_size": 64, "intermediate_size": 128}).to(torch.float32)
        for p in mlp.parameters():
            torch.nn.init.normal_(p, std=0.02)
        mlp.native_ops = native.kernels()
        us = time_mlp_slices(mlp, 64, torch.float32, 512, (256, 512))
        assert set(us) == {"256", "512"} and mlp.mlp_rows == 256
        with pytest.raises(AssertionError, match="collective"):  # outside the timing the layer does all-reduce
            mlp(torch.randn(4, 64))


@pytest.mark.parametrize("tokens,choices", [(100, (256,)), (256, (256,)), (300, (256, 512)), (512, (256, 512)),
                                            (1024, (256, 512, 1024)), (4096, (256, 512, 1024))])
def test_a_build_and_a_load_time_the_same_mlp_slices_for_a_step(tokens, choices):
    """One rule for both: each slice smaller than the step and the smallest holding it whole (a larger one runs
    the same unsliced MLP); a load caps its step at the largest slice."""
    from kiln.engine.models.llama import MLP_ROWS_CHOICES, mlp_rows_at_load, mlp_rows_choices

    assert mlp_rows_choices(tokens) == choices
    rows, at_load = mlp_rows_at_load(tokens)
    assert rows == min(tokens, max(MLP_ROWS_CHOICES)) and at_load == mlp_rows_choices(rows)
