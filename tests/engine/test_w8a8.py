"""W8A8 on the int8 units (issues 33, 41): kiln's kernels (vpdpbusd on zmm or ymm, or AVX2's vpmaddubsw) against
the same quantized math in float64, each instruction the host can run (chosen by the ISA cap), the candidate
through the table (pack, run, why_not, timing, choice), an int8 engine forced onto it against the float engine,
the quality gate's switch, and hosts without VNNI (simulated by the ISA cap)."""

from __future__ import annotations

import platform
import shutil

import pytest
import torch
from engine_testlib import random_prompts
from kiln.engine.cpu_target import cpu_flags
from kiln.engine.kernels import candidates, isa, native
from kiln.engine.layers.quant import quantize_weight
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.tactics import host_signature
from kiln.engine.tactics.resolve import measure, packing
from kiln.engine.tactics.table import choose
from kiln.engine.tactics.timing import BucketTiming, LinearSite

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("cc") is None,
                                reason="W8A8 runs in kiln's x86-64 library, compiled here")


def _w8a8_kernels_or_skip() -> native.Kernels:
    kernels = native.kernels()
    why = "kiln's kernels do not load" if kernels is None else kernels.gemm_kernels[torch.float32]["w8a8"]
    if why:
        pytest.skip(f"W8A8 does not run here: {why}")
    return kernels


@pytest.fixture
def units(w8a8_fresh):
    return _w8a8_kernels_or_skip()


# $KILN_CPU_ISA -> the instruction W8A8's tiles then use (None: the host's best)
ISA_TILES = {None: None, "x86-64-v3": "avx2", "avx_vnni": "avx_vnni", "x86-64-v4": "avx512bw"}


@pytest.fixture(params=list(ISA_TILES), ids=lambda cap: cap or "best")
def each_units(w8a8_fresh, monkeypatch, request):
    """The kernels once per instruction W8A8 can run on here: the host's best, the x86-64-v3 library's AVX2
    and AVX-VNNI tiles (skipped where the CPU lacks avx_vnni), and the x86-64-v4 library's AVX512BW tiles (a
    Skylake-SP; skipped where the CPU has no AVX-512)."""
    if request.param:
        monkeypatch.setenv(isa.ISA_ENV, request.param)
    native.reset()
    kernels = _w8a8_kernels_or_skip()
    if ISA_TILES[request.param] and kernels.w8a8_isa != ISA_TILES[request.param]:
        pytest.skip(f"$KILN_CPU_ISA={request.param} runs W8A8 on {kernels.w8a8_isa} here (the CPU lacks "
                    f"{ISA_TILES[request.param]})")
    return kernels


def _reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's quantization in torch: float32 127 / max|x| per row and 32-block of K, round half to even,
    clamp; (int8 [rows, k], scales [rows, blocks])."""
    m, k = x.shape
    blocks = -(-k // 32)
    x32 = torch.nn.functional.pad(x.float(), (0, blocks * 32 - k)).view(m, blocks, 32)
    amax = x32.abs().amax(dim=2, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = (x32 * inv).round().clamp(-127, 127).to(torch.int8).view(m, blocks * 32)[:, :k]
    return q, (amax / 127).squeeze(2)


def _w8a8_math(xq: torch.Tensor, sx: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The W8A8 product in float64: each block's exact int32 dot product times its activation scale, summed
    over the blocks, times the weight's channel scale."""
    k, blocks = xq.shape[1], sx.shape[1]
    pad = blocks * 32 - k
    xb = torch.nn.functional.pad(xq.double(), (0, pad)).view(-1, blocks, 32)
    qb = torch.nn.functional.pad(q.double(), (0, pad)).view(-1, blocks, 32)
    acc = torch.einsum("mbk,nbk->mnb", xb, qb)  # exact: integers far below 2^53
    return (acc * sx.double()[:, None, :]).sum(-1) * s.double()[None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(72, 200), (130, 37), (5, 3), (200, 1001), (64, 64), (257, 130)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_is_the_quantized_math(each_units, dtype, n, k, bias):
    """Odd N and K (no tile, panel, quad or block divides them), rows 1..40: the activations are quantized
    exactly as the reference does (int8 equal, block scales equal), and the output is each block's exact int32
    sum times its scale, summed, times the channel's scale, plus the bias: within float32's roundings of that
    sum (one per block; bf16: one bf16 rounding of it)."""
    gen = torch.Generator().manual_seed(n * k)
    q, s = quantize_weight(torch.randn(n, k, generator=gen) * 0.05, "int8")
    b = torch.randn(n, generator=gen) if bias else None
    units = each_units
    if units.gemm_kernels[dtype]["w8a8"]:
        pytest.skip(f"W8A8 of {dtype} activations does not run here: {units.gemm_kernels[dtype]['w8a8']}")
    packed = units.pack_linear(q, ["w8a8"] * 16, s, dtype)
    for m in (1, 2, 5, 6, 7, 13, 40):
        x = torch.randn(m, k, generator=gen).to(dtype)
        x[0, 0] = 0.0
        xq, sx = units.w8a8_quantize(x)
        ref_q, ref_s = _reference_quantize(x)
        assert torch.equal(xq, ref_q) and torch.equal(sx, ref_s)
        product = _w8a8_math(xq, sx, q, s)
        ref = product + (0 if b is None else b.double())
        # the float32 roundings of the block sum: bounded by the sum of the blocks' magnitudes
        blocks = _w8a8_math(xq.abs(), sx, q.abs(), s.abs())
        y = packed(x, b).double()
        ulp = 2.0 ** -23 if dtype == torch.float32 else 2.0 ** -8  # the sum's roundings, then the bias's
        spread = (sx.shape[1] + 4) * 2.0 ** -23 * blocks if dtype == torch.bfloat16 else (sx.shape[1] + 4) * ulp * blocks
        bound = 4 * ulp * (product.abs() + (0 if b is None else b.double().abs())) + spread + 1e-30
        assert ((y - ref).abs() <= bound).all(), (m, (y - ref).abs().max())


def test_a_zero_row_gives_the_bias(each_units):
    q, s = quantize_weight(torch.randn(40, 24), "int8")
    b = torch.randn(40)
    y = each_units.pack_linear(q, ["w8a8"] * 16, s, torch.float32)(torch.zeros(3, 24), b)
    assert torch.equal(y, b.expand(3, 40))


def test_the_extreme_bytes_do_not_saturate(each_units):
    """Weights of -128 and +127 against activations at +-127 (every int16 pair sum AVX2's vpmaddubsw makes at
    its largest): the sums are exact, so the output is the float64 product within float32's roundings."""
    k = 64
    q = torch.full((24, k), 127, dtype=torch.int8)
    q[::2] = -128
    s = torch.full((24,), 0.01)
    packed = each_units.pack_linear(q, ["w8a8"] * 16, s, torch.float32)
    x = torch.ones(3, k)
    x[1] = -1.0
    x[2, ::2] = -1.0
    xq, sx = each_units.w8a8_quantize(x)
    assert xq.abs().max() == 127
    ref = _w8a8_math(xq, sx, q, s)
    assert torch.allclose(packed(x).double(), ref, rtol=1e-6, atol=0), (packed(x), ref)


def test_the_same_panels_run_weight_only_and_w8a8_per_bucket(units):
    """One packed copy: a bucket running W8A8 and one running the weight-only kernel on the same weight."""
    gen = torch.Generator().manual_seed(3)
    q, s = quantize_weight(torch.randn(96, 80, generator=gen), "int8")
    x = torch.randn(8, 80, generator=gen)
    weight_only = x.double() @ (q.double() * s.double()[:, None]).t()
    packed = units.pack_linear(q, ["w8a8"] + ["fma"] * 15, s, torch.float32)
    assert torch.allclose(packed(x).double(), weight_only, rtol=1e-5, atol=1e-5)  # 8 rows: bucket 3, fma
    xq, sx = units.w8a8_quantize(x[:1])
    w8a8 = _w8a8_math(xq, sx, q, s)
    assert torch.allclose(packed(x[:1]).double(), w8a8, rtol=1e-5, atol=1e-5)  # 1 row: bucket 0, W8A8
    with pytest.raises(ValueError, match="int8 weights"):
        units.pack_linear(torch.randn(16, 16), ["w8a8"] * 16)


def test_candidate_pack_run_why_not(units):
    assert candidates.LINEAR["kiln-w8a8"].layout == "kiln" and "kiln-w8a8" in candidates.ACTIVATION_QUANT
    assert "float ones" in candidates.why_not("kiln-w8a8", torch.float32, units, None)
    assert candidates.why_not("kiln-w8a8", torch.float32, units, "int8") is None
    assert candidates.why_not("kiln-w8a8", torch.bfloat16, units, "int8") == units.gemm_kernels[torch.bfloat16]["fma"]
    q, s = quantize_weight(torch.randn(33, 48), "int8")
    p = candidates.pack("kiln", q, units, tactics=["w8a8"] * 16, scale=s, dtype=torch.float32)
    x = torch.randn(3, 48)
    assert torch.equal(candidates.run(p, x, None), p(x))
    if candidates.why_not("torch-w8a8", torch.float32, units, "int8") is None:
        t = candidates.pack("qlinear", q, units, scale=s, dtype=torch.float32)
        ref = x @ (q.float() * s[:, None]).t()
        assert (candidates.run(t, x, None) - ref).abs().max() < 0.05 * ref.abs().max()


def test_the_table_times_and_picks_it(units):
    """An int8 site is timed on W8A8 beside the weight-only kernels; a bucket W8A8 wins runs it, packed so."""
    site = LinearSite(torch.float32, 128, 256, max_rows=4, quant="int8")
    table = measure([site], units, budget_s=5.0)
    timed = {name for b in table.linear[site.key].buckets for name in b["us"]}
    assert {"kiln-w8a8", "kiln-fma"} <= timed
    timings = [BucketTiming(rows, {"kiln-w8a8": 1e-6, "kiln-fma": 3e-6, "aten": 5e-6}) for rows in (1, 2, 4)]
    choice = choose(site.key, timings)
    assert choice.layout == "kiln" and [b["runs"] for b in choice.buckets] == ["kiln-w8a8"] * 3
    assert packing(choice, site, units) == ("kiln", ["w8a8"] * 16)


def test_the_quality_switch_takes_it_out(units, monkeypatch):
    """$KILN_TACTICS_EXCLUDE=w8a8 (the quality gate's switch): never timed, a table that runs it is refused
    here, and the host signature says so (a table measured with it is not this host's)."""
    site = LinearSite(torch.float32, 64, 64, max_rows=2, quant="int8")
    before = host_signature.signature_key(host_signature.cpu_signature())
    choice = choose(site.key, [BucketTiming(r, {"kiln-w8a8": 1e-6, "kiln-fma": 2e-6}) for r in (1, 2)])
    monkeypatch.setenv(candidates.EXCLUDE_ENV, "w8a8")
    assert candidates.excluded() == frozenset(candidates.ACTIVATION_QUANT)
    assert "KILN_TACTICS_EXCLUDE" in candidates.why_not("kiln-w8a8", torch.float32, units, "int8")
    table = measure([site], units, budget_s=2.0)
    assert not {name for b in table.linear[site.key].buckets for name in b["us"]} & set(candidates.ACTIVATION_QUANT)
    with pytest.raises(Exception, match="cannot run here"):
        packing(choice, site, units)
    assert host_signature.cpu_signature()["excluded"] == sorted(candidates.ACTIVATION_QUANT)
    assert host_signature.signature_key(host_signature.cpu_signature()) != before


@pytest.mark.parametrize("cap", ["x86-64-v4", "avx_vnni", "x86-64-v3"])
def test_a_host_without_avx512_vnni_runs_it_on_its_own_tiles(w8a8_fresh, monkeypatch, cap):
    """The x86-64-v3 library (an AVX2-only host, or any host capped there) runs W8A8 on AVX-VNNI where the CPU
    and the cap allow it, else on AVX2; the AVX-512 library capped below VNNI (a Skylake-SP) on AVX512BW's
    vpmaddubsw; and the table times it either way."""
    monkeypatch.setenv(isa.ISA_ENV, cap)
    native.reset()
    kernels = native.kernels()
    if kernels is None:
        pytest.skip("kiln's kernels do not load")
    why = candidates.why_not("kiln-w8a8", torch.float32, kernels, "int8")
    site = LinearSite(torch.float32, 64, 64, max_rows=2, quant="int8")
    timed = {name for b in measure([site], kernels, budget_s=2.0).linear[site.key].buckets for name in b["us"]}
    if kernels.level == "x86-64-v4":
        assert why is None and kernels.w8a8_isa == "avx512bw" and "kiln-w8a8" in timed
        return
    vnni = isa.feature_missing("avx_vnni", kernels.level) is None  # the CPU has it, the cap allows it
    assert vnni == ("avx_vnni" in cpu_flags() and cap != "x86-64-v3")
    assert why is None and kernels.w8a8_isa == ("avx_vnni" if vnni else "avx2") and "kiln-w8a8" in timed


def test_the_256_bit_and_avx512bw_tiles_give_the_zmm_tiles_bits(w8a8_fresh, monkeypatch):
    """Every form sums the same integers exactly and runs the same float epilogue: on a host that loads the
    AVX-512 library with VNNI, its output equals, bit for bit, the x86-64-v3 library's (AVX2 tiles, or AVX-VNNI
    where the CPU has it) and the AVX512BW tiles' (the same library capped below VNNI) on the same weight and
    activations."""
    best = native.kernels()
    if best is None or best.w8a8_isa != "avx512_vnni":
        pytest.skip("needs a host whose best library runs W8A8 on AVX512-VNNI")
    gen = torch.Generator().manual_seed(7)
    cases = [(quantize_weight(torch.randn(n, k, generator=gen) * 0.05, "int8"), torch.randn(n, generator=gen),
              torch.randn(m, k, generator=gen)) for n, k, m in ((72, 200, 5), (257, 130, 1), (960, 576, 13))]
    outs = [best.pack_linear(q, ["w8a8"] * 16, s, torch.float32)(x, b) for (q, s), b, x in cases]
    monkeypatch.setenv(isa.ISA_ENV, "avx_vnni")
    native.reset()
    ymm = native.kernels()
    assert ymm.level == "x86-64-v3" and ymm.w8a8_isa in ("avx2", "avx_vnni")
    for ((q, s), b, x), want in zip(cases, outs, strict=True):
        assert torch.equal(ymm.pack_linear(q, ["w8a8"] * 16, s, torch.float32)(x, b), want)
    monkeypatch.setenv(isa.ISA_ENV, "x86-64-v4")
    native.reset()
    bw = native.kernels()
    assert bw.level == "x86-64-v4" and bw.w8a8_isa == "avx512bw"
    for ((q, s), b, x), want in zip(cases, outs, strict=True):
        assert torch.equal(bw.pack_linear(q, ["w8a8"] * 16, s, torch.float32)(x, b), want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_int8_engine_on_w8a8_follows_the_float_engine(units, toy_model, make_llm, dtype):
    """The toy model, quantization int8, every int8 linear forced onto kiln-w8a8 (the stack runs it too): its
    greedy tokens against the float engine's. Measured: float32 20/20 and bf16 19-20/20 tokens agree (the
    random toy's logits are far apart); held to 80 %, and to the weight-only int8 engine's agreement
    minus 10 points."""
    if candidates.why_not("kiln-w8a8", getattr(torch, dtype), units, "int8"):
        pytest.skip(candidates.why_not("kiln-w8a8", getattr(torch, dtype), units, "int8"))
    model_dir = toy_model("llama-tiny", dtype=dtype)
    prompts = random_prompts([12, 30, 7, 21], seed=4)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    kw = dict(attention_backend="native", dtype=dtype, num_kv_blocks=64, block_size=16, max_num_tokens=256,
              max_batch_size=4, device="cpu")
    outs = {}
    for name, extra in (("float", {}), ("w8a8", {"quantization": "int8", "tactics": "kiln-w8a8"}),
                        ("int8", {"quantization": "int8", "tactics": "kiln-fma"})):
        llm = make_llm(model_dir, **kw, **extra)
        if name == "w8a8":
            runs = {t for m in llm.engine.runner.model.modules()
                    if getattr(getattr(m, "packed_weight", None), "int8", False) for t in m.packed_weight.tactics}
            assert runs == {"w8a8"}
        outs[name] = [o.token_ids for o in llm.generate(prompts, params)]

    def agree(name):
        return sum(a == b for x, y in zip(outs["float"], outs[name], strict=True) for a, b in zip(x, y, strict=True)) / 20

    assert agree("w8a8") >= max(0.8, agree("int8") - 0.1), (agree("w8a8"), agree("int8"))


def test_tactics_exclude_is_an_engine_setting_passed_not_global(toy_model, w8a8_fresh):
    """What the build writes into engine.json when its quality gate refuses W8A8 for a model: the engine that
    loads it passes its ``tactics_exclude`` to the tactics (a parameter), so its tables leave W8A8 out and
    their host signature says so, while another engine of the same process, or a second config, is not
    touched (it was a process-global set by the config loaded last)."""
    from kiln.engine import ConfigError
    from kiln.engine.config import EngineConfig

    model = str(toy_model("llama-tiny"))
    cfg = EngineConfig(model=model, device="cpu", tactics_exclude="w8a8")  # as the serve flag spells it
    assert not set(candidates.ACTIVATION_QUANT) & candidates.excluded()  # nothing process-wide
    assert set(candidates.ACTIVATION_QUANT) <= candidates.excluded(cfg.tactics_exclude)
    assert "tactics_exclude" in candidates.why_not("kiln-w8a8", torch.bfloat16, None, "int8", cfg.tactics_exclude)
    site = LinearSite(torch.float32, 64, 64, max_rows=2, quant="int8")
    table = measure([site], native.kernels(), budget_s=2.0, exclude=cfg.tactics_exclude)
    assert not {name for b in table.linear[site.key].buckets for name in b["us"]} & set(candidates.ACTIVATION_QUANT)
    assert table.host["excluded"] == sorted(candidates.ACTIVATION_QUANT)
    assert "excluded" not in host_signature.cpu_signature()
    with pytest.raises(ConfigError, match=r"^tactics_exclude must list candidates .*got \['int4'\]"):
        EngineConfig(model=model, device="cpu", tactics_exclude=["int4"])


def test_an_int8_engine_packs_its_lm_head_int8_only_where_w8a8_may_run(units, toy_model, make_llm, monkeypatch):
    """The LM head of an int8 engine gets an int8 copy (run by the int8 candidates the table times) where a
    W8A8 candidate may run; with W8A8 excluded (the gate's verdict), lm_head_int8 'off', or a float engine,
    it stays in the engine's dtype. (Whether the head's rounding is acceptable for a model is the build's
    quality gate's call, which measures W8A8 with the head in int8 and again without: tests/builder.)"""
    from kiln.engine.layers.embedding import ParallelLMHead

    if candidates.why_not("kiln-w8a8", torch.bfloat16, units, "int8"):  # an AVX2 host: W8A8 of float32 only
        pytest.skip(candidates.why_not("kiln-w8a8", torch.bfloat16, units, "int8"))
    model_dir = toy_model("llama-tiny", dtype="bfloat16")
    kw = dict(attention_backend="native", dtype="bfloat16", num_kv_blocks=64, block_size=16, max_num_tokens=256,
              max_batch_size=4, device="cpu")

    prompts = random_prompts([12, 30, 7, 21], seed=5)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    def head(**extra):
        llm = make_llm(model_dir, **kw, **extra)
        m = next(m for m in llm.engine.runner.model.modules() if isinstance(m, ParallelLMHead))
        info = llm.engine.config.tactics_info["lm_head"]
        int8 = bool(getattr(m.packed_weight, "int8", False))
        assert m.weight_int8 is None and m.weight_scale is None  # the quantized copy lives only in the packing
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
        llm.shutdown()
        return int8, info, tokens

    def agree(tokens):
        return sum(a == b for x, y in zip(ref, tokens, strict=True) for a, b in zip(x, y, strict=True)) / 20

    _, info, ref = head()
    assert info == "as built"
    int8, info, tokens = head(quantization="int8", tactics="kiln-w8a8")
    assert int8 and info.startswith("int8 (W8A8 may run here: kiln-w8a8")
    kept = {}
    for extra in ({"lm_head_int8": "off"}, {"tactics_exclude": "w8a8"}):
        int8, info, kept[str(extra)] = head(quantization="int8", tactics="kiln-w8a8", **extra)
        assert not int8 and info.startswith("as built"), (extra, info)
    assert agree(tokens) > 0.3 and agree(kept[str({"lm_head_int8": "off"})]) >= 0.7  # runs the toy's model
