"""kiln's CPU kernels (engine/kernels/csrc via native.py): numerics against a PyTorch reference,
the engine's tokens against the torch backend, ISA levels, shipping in an artifact, and every fallback.
Which GEMM kernel runs is the tactic table's business (tests/engine/test_tactics.py); tests here that need
kiln's GEMM under the layer stack force it (``tactics="kiln-fma"``)."""

from __future__ import annotations

import logging
import os
import platform
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F
from engine_testlib import random_prompts
from kiln.engine import ConfigError, SamplingParams, cpu_target
from kiln.engine.config import EngineConfig
from kiln.engine.kernels import cpu_library, isa, native

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64") or shutil.which("cc") is None,
                                reason="kiln's CPU kernels need x86-64 or aarch64 and a C compiler")


@pytest.fixture
def fresh(monkeypatch, tmp_path, module_kernels_dir):
    """A process state with no library loaded or shipped, compiling into this module's directory (each level
    compiled once for the module, not once per test: a compile is seconds)."""
    monkeypatch.setenv("KILN_CPU_KERNELS_DIR", str(module_kernels_dir))
    monkeypatch.setattr(cpu_library, "_shipped", {})
    native.reset()
    yield tmp_path
    native.reset()


@pytest.fixture(scope="module")
def module_kernels_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cpu-kernels")


def test_an_artifacts_library_installed_after_a_load_is_loaded(fresh):
    """cpu_library (beneath native) never calls native: the loaded library is keyed by its install count."""
    first = native.kernels()
    if first is None:
        pytest.skip("kiln's CPU kernels do not load here")
    assert native.kernels() is first
    path = first.path
    cpu_library.install_shipped({first.level: path})
    again = native.kernels()
    assert again is not first and again.path == path and again.level == first.level


@pytest.fixture
def fresh_cache(fresh, monkeypatch):
    """``fresh``, compiling into ``<tmp_path>/cache``, empty: for tests of what is compiled, and when."""
    monkeypatch.setenv("KILN_CPU_KERNELS_DIR", str(fresh / "cache"))
    return fresh


def reference(q, k_cache, v_cache, tables, lens, scale):
    """Per row: gather the context's K/V, repeat for GQA, softmax(q K^T) V in float64."""
    rows, heads, d = q.shape
    kvh, _, bs, _ = k_cache.shape
    out = []
    for r in range(rows):
        n = int(lens[r])
        blocks = tables[r, : -(-n // bs)].long()
        keys = k_cache[:, blocks].reshape(kvh, -1, d)[:, :n].double().repeat_interleave(heads // kvh, 0)
        vals = v_cache[:, blocks].reshape(kvh, -1, d)[:, :n].double().repeat_interleave(heads // kvh, 0)
        scores = torch.einsum("hd,hnd->hn", q[r].double(), keys) * scale
        out.append(torch.einsum("hn,hnd->hd", scores.softmax(-1), vals))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,d,block_size", [
    (12, 4, 64, 16),   # GQA, the vectorized head size 64
    (8, 8, 128, 16),   # MHA, head size 128
    (8, 1, 24, 32),    # MQA, a head size on the generic path, a block size on the generic path
    (4, 2, 80, 16),    # another generic head size
])
@pytest.mark.parametrize("amx_queries", [0, 16])
def test_attention_matches_reference(fresh, dtype, heads, kv_heads, d, block_size, amx_queries, monkeypatch):
    """Decode rows with their own tables, then the tokens of a prefill chunk (one table, causal lengths,
    attended in groups of rows that share the table), against a float64 reference; bf16 with 16-token blocks
    and head sizes 64/128 in the pair layout where the host runs vdpbf16ps (``kv_mode`` 2), whose groups of at
    least ``amx_queries`` query vectors attend on AMX tiles where the host has them."""
    kernels = native.kernels()
    monkeypatch.setattr(kernels, "attention_amx_queries", amx_queries)
    g = torch.Generator().manual_seed(heads * d + block_size)
    num_blocks = 64
    k_cache = torch.randn(kv_heads, num_blocks, block_size, d, generator=g).to(dtype)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, d, generator=g).to(dtype)
    decode_lens = [1, block_size, block_size + 1, 7, 3 * block_size - 1, 20 * block_size - 5]
    chunk = list(range(2 * block_size - 3, 2 * block_size + 8))  # 11 tokens after a cached prefix
    lens = torch.tensor(decode_lens + chunk, dtype=torch.int32)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:24] for _ in decode_lens]
                         + [torch.randperm(num_blocks, generator=g)[:24]] * len(chunk)).to(torch.int32)
    nd = len(decode_lens)
    row_starts = torch.tensor([*range(nd + 1), nd + 4, nd + 5, len(lens)], dtype=torch.int32)  # groups 4, 1, 6
    # q as the model hands it over: a strided view of the packed q|k projection output
    packed = torch.randn(len(lens), heads + kv_heads, d, generator=g).to(dtype)
    q = packed[:, :heads]
    stored_k, stored_v = torch.empty_like(k_cache), torch.empty_like(v_cache)  # in the kernels' own layout
    kernels.store_cache(k_cache, v_cache, stored_k, stored_v)
    read_k, read_v = kernels.read_cache(stored_k, stored_v)
    assert torch.equal(read_k, k_cache) and torch.equal(read_v, v_cache)
    want = reference(q, k_cache, v_cache, tables, lens, d ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for groups in (row_starts, None):  # grouped, and every row alone
        out = torch.full((len(lens), heads, d), float("nan"), dtype=dtype)
        kernels.paged_attention(q, stored_k, stored_v, tables, lens, d ** -0.5, out, groups)
        torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


def test_token_rows_groups_prefill_tokens():
    from kiln.engine.layers.paged_metadata import PREFILL_ROWS_PER_GROUP, token_rows

    decode = torch.tensor([[3, 4, 0], [5, 6, 7]])
    tables, lens, starts = token_rows(decode, torch.tensor([20, 40]), [(2, 20, 30, torch.tensor([9, 8]))])
    assert tables.dtype == lens.dtype == starts.dtype == torch.int32
    assert tables[:2].tolist() == decode.tolist() and all(row[:2].tolist() == [9, 8] for row in tables[2:])
    assert lens.tolist() == [20, 40, *range(11, 31)]  # causal after a 10-token cached prefix
    assert starts.tolist() == [0, 1, *range(2, 22, PREFILL_ROWS_PER_GROUP), 22]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pointwise_kernels_match_the_torch_ops(fresh, dtype):
    """Rotary, the residual add, the cache write and every bf16 op are bit-identical to torch's ops; in
    float32 SiLU's exp and RMSNorm's sum of squares differ in the last bits only."""
    from kiln.engine.layers.norm import RMSNorm
    from kiln.engine.layers.rotary import RotaryEmbedding, apply_rotary_qk

    kernels = native.kernels()
    g = torch.Generator().manual_seed(5)
    exact = dtype == torch.bfloat16
    close = dict(rtol=0, atol=0) if exact else dict(rtol=2e-6, atol=2e-6)

    gate_up = (4 * torch.randn(37, 2 * 300, generator=g)).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_mul(gate_up), F.silu(gate) * up, **close)

    norm = RMSNorm(96, eps=1e-5).to(dtype)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(96, generator=g))
    x, residual = (3 * torch.randn(9, 96, generator=g)).to(dtype), torch.randn(9, 96, generator=g).to(dtype)
    want, want_residual = norm(x, residual)
    got, got_residual = kernels.rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(got_residual, want_residual)
    torch.testing.assert_close(got, want, **close)
    torch.testing.assert_close(kernels.rms_norm(x, None, norm.weight, norm.eps), norm(x), **close)

    rope = RotaryEmbedding(64, 512, {"rope_theta": 10000.0, "rope_type": "default"})
    cos_sin = rope.cos_sin(torch.randint(0, 512, (11,), generator=g), dtype)
    qkv = torch.randn(11, 12 + 2 * 4, 64, generator=g).to(dtype)  # rotate the q|k heads of a packed q|k|v
    want = apply_rotary_qk(cos_sin, qkv[:, :16].clone())
    v_before = qkv[:, 16:].clone()
    assert torch.equal(kernels.rotary_(qkv[:, :16], *cos_sin), want)
    assert torch.equal(qkv[:, :16], want) and torch.equal(qkv[:, 16:], v_before)  # in place, v untouched

    k_cache, v_cache = torch.zeros(4, 6, 16, 64, dtype=dtype), torch.zeros(4, 6, 16, 64, dtype=dtype)
    slots = torch.tensor([5, 17, 95, 40, 0, 63, 64, 81, 2, 33, 90])
    kernels.cache_write(qkv[:, 12:16], qkv[:, 16:], k_cache, v_cache, slots)
    keys, values = (t.reshape(4, 96, 64) for t in kernels.read_cache(k_cache, v_cache))
    assert torch.equal(keys[:, slots], qkv[:, 12:16].transpose(0, 1))
    assert keys[:, 1].abs().max() == 0  # slot 1 is no token's
    assert torch.equal(values[:, slots], qkv[:, 16:].transpose(0, 1))
    assert values[:, 1].abs().max() == 0  # nothing else written


@pytest.mark.parametrize("m,k,n,bias", [
    (1, 64, 64, False),     # one decode row, one panel
    (5, 100, 1000, True),   # one tile; n not a multiple of the panel (zero-padded last panel)
    (13, 2048, 768, True),  # tiles of 5 + 4 + 4 rows, next panels prefetched
    (7, 1500, 70, False),   # k over one K block (1024): partial sums accumulated into y
    (450, 96, 200, True),   # several row chunks (LIN_MC) shared between threads
    (3, 5, 3, True),        # smaller than a vector everywhere
    (0, 64, 64, True),      # no rows
])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_matches_float64(fresh, m, k, n, bias, threads):
    """kiln's float32 GEMM over its packed weight is F.linear to float32 rounding, at every tiling."""
    g = torch.Generator().manual_seed(m * 7 + n)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        packed = native.kernels().pack_linear(w)
        y = packed(x, b)
    finally:
        torch.set_num_threads(before)
    assert y.shape == (m, n) and y.dtype == torch.float32
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=2e-5 * k ** 0.5)


@pytest.mark.parametrize("m,k,n,bias", [(13, 768, 1280, False), (5, 77, 70, True), (300, 2048, 768, True),
                                         (1, 3, 5, True), (0, 8, 8, False), (17, 64, 100, True), (33, 96, 64, False), (20, 688, 256, True), (3, 45, 64, True),
                                         (16, 128, 130, True), (257, 64, 64, True)])
@pytest.mark.parametrize("kernel", ["fma", "amx"])
def test_bf16_gemm_kernels_match_float64(fresh, m, k, n, bias, kernel):
    """Each bf16 GEMM kernel (vdpbf16ps over K pairs, odd K padded; AMX tiles, 1 x 4 up to 16 rows and 2 x 2
    blocks past them, partial blocks, a K tail past the tiles' 32) is F.linear in float64 rounded once to bf16: within one bf16 ulp of it
    plus the float32 accumulation's error. Bit-equality with torch is no property here: oneDNN sums in
    another order where it runs AMX (test_tactics.py asserts it where it is one)."""
    kernels = native.kernels()
    why = kernels.gemm_kernels[torch.bfloat16][kernel]
    if why:
        pytest.skip(f"bf16 GEMM kernel {kernel}: {why}")
    g = torch.Generator().manual_seed(m + k)
    w, x = (torch.randn(n, k, generator=g) * 0.05).bfloat16(), torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    y = kernels.pack_linear(w, [kernel] * native.ROW_BUCKETS)(x, b)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    err = (y.double() - ref).abs()
    absprod = F.linear(x.double().abs(), w.double().abs())  # what the float32 sums' rounding scales with
    bound = ref.abs() * 2 ** -8 + absprod * k * 2 ** -23 + 1e-6
    assert (err <= bound).all(), f"max error {err.max():.3g}"


def test_linear_takes_any_leading_shape_and_strided_rows(fresh):
    kernels = native.kernels()
    w = torch.randn(96, 40)
    packed = kernels.pack_linear(w[:, :40].clone())
    x = torch.randn(2, 3, 80)[..., ::2]  # last dim strided: copied once, not misread
    torch.testing.assert_close(packed(x), F.linear(x, w))
    rows = torch.randn(10, 64)[:, 8:48]  # rows strided, last dim contiguous: used in place
    torch.testing.assert_close(packed(rows), F.linear(rows, w))
    with pytest.raises(ValueError, match="float32"):
        kernels.pack_linear(w.half())
    with pytest.raises(TypeError, match="input torch.float64"):
        packed(x.double())


def test_engine_native_equals_torch(fresh, toy_model, make_llm):
    """Greedy tokens of mixed steps, chunked prefill and a prefix hit are the same on both CPU backends,
    and the native run really called the kernel."""
    calls = []
    model_dir = toy_model("llama-tiny")
    shared = random_prompts([40], seed=7)[0][1:]
    prompts = random_prompts([45, 52], seed=2, prefix=shared) + random_prompts([9, 23, 70], seed=3)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 4, 30, 5, 12)]
    kwargs = dict(num_kv_blocks=40, block_size=16, max_num_tokens=24, max_batch_size=4, device="cpu")
    outs = {}
    for backend in ("torch", "native"):
        llm = make_llm(model_dir, attention_backend=backend, **kwargs)
        assert llm.engine.runner.attention_backend == backend
        fused = [m for m in llm.engine.runner.model.modules() if getattr(m, "native_ops", None) is not None]
        assert bool(fused) == (backend == "native")  # norms, MLPs and attention blocks use the fused kernels
        if backend == "native":
            llm.engine.runner.attention_metadata = _spy(llm.engine.runner.attention_metadata, calls)
        first = llm.generate(prompts[:1], params[:1])  # fills the prefix cache
        rest = llm.generate(prompts[1:], params[1:])
        assert rest[0].num_cached_tokens == 32
        outs[backend] = [o.token_ids for o in first + rest]
    assert outs["native"] == outs["torch"]
    # mixed steps (decodes + a prefill chunk after a cached prefix), every token through the kernel
    assert any(inputs.num_decodes and any(q_len < ctx for _, q_len, ctx, _ in inputs.prefills)
               and md.native is not None and md.num_decode_tokens == inputs.input_ids.shape[0] for inputs, md in calls)


def test_long_prefill_in_mlp_slices_equals_torch(fresh, toy_model, make_llm):
    """A step over CPU_MLP_ROWS tokens runs its MLP in slices; the tokens stay the torch backend's."""
    from kiln.engine.models.llama import CPU_MLP_ROWS

    model_dir = toy_model("llama-tiny")
    prompts = random_prompts([2 * CPU_MLP_ROWS + 37, 40], seed=11)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    kwargs = dict(num_kv_blocks=64, block_size=16, max_num_tokens=1024, max_batch_size=2, device="cpu")
    outs = {b: [o.token_ids for o in make_llm(model_dir, attention_backend=b, **kwargs).generate(prompts, params)]
            for b in ("torch", "native")}
    assert outs["native"] == outs["torch"]


STACK_MODELS = [("llama-tiny", {}, "float32", None), ("qwen2-tiny", {}, "float32", None),  # qwen2: q/k/v biases
                 ("llama-tiny", {"attention_bias": True, "mlp_bias": True}, "float32", None),  # o/gate_up/down biases
                 ("llama-tiny", {}, "bfloat16", None), ("qwen2-tiny", {}, "bfloat16", None),
                 ("llama-tiny", {}, "float32", "int8"), ("qwen2-tiny", {}, "bfloat16", "int8"),  # int8 GEMMs
                 ("qwen3-tiny", {}, "float32", None), ("qwen3-tiny", {}, "bfloat16", None),  # q/k norms, wide heads
                 ("smollm3-tiny", {}, "float32", None)]  # a layer without rotary


def _with_random_biases(src, dest):
    """A copy of a toy checkpoint whose biases are random (transformers initializes them to zero, which
    would hide a bias added twice, or not at all)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    state = load_file(dest / "model.safetensors")
    gen = torch.Generator().manual_seed(5)
    for name, t in state.items():
        if name.endswith(".bias"):
            state[name] = (torch.randn(t.shape, generator=gen) * 0.5).to(t.dtype)
    save_file(state, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize(("preset", "overrides", "dtype", "quant"), STACK_MODELS)
@pytest.mark.parametrize("gemm", ["kiln-fma", "kiln-amx", "kiln-w8a8", "kiln-w8a8-amx"])
def test_decoder_stack_equals_the_module_path(fresh, toy_model, make_llm, monkeypatch, preset, overrides, dtype, quant,
                                              gemm):
    """The layers as one C call (models/llama.LlamaModel.bind_native_stack) give the per-module path's tokens
    and logprobs bit for bit, on each GEMM kernel (the two paths call the same kernel for the same rows):
    decodes, chunked prefill after a cached prefix, and a step over CPU_MLP_ROWS tokens (the MLP in
    slices); and the stack really ran."""
    from kiln.engine.kernels.candidates import why_not
    from kiln.engine.models.llama import CPU_MLP_ROWS

    why = why_not(gemm, getattr(torch, dtype), native.kernels(), quant)
    if why:
        pytest.skip(f"{gemm} on {dtype}: {why}")
    model_dir = _with_random_biases(toy_model(preset, dtype=dtype, **overrides), fresh / "model")
    shared = random_prompts([40], seed=7)[0][1:]
    prompts = random_prompts([45, 52], seed=2, prefix=shared) + random_prompts([9, CPU_MLP_ROWS + 70], seed=3)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3) for n in (6, 4, 30, 5)]
    calls = []
    run = native.DecoderStack.__call__
    monkeypatch.setattr(native.DecoderStack, "__call__", lambda self, *a: calls.append(a[0].shape[0]) or run(self, *a))
    outs = {}
    for name in ("stack", "modules"):
        llm = make_llm(model_dir, attention_backend="native", dtype=dtype, num_kv_blocks=80, block_size=16,
                       max_num_tokens=512, max_batch_size=4, device="cpu", tactics=gemm, quantization=quant)
        model = llm.engine.runner.model.model
        assert model.native_stack is not None
        if name == "modules":
            model.native_stack = None
        first = llm.generate(prompts[:1], params[:1])  # fills the prefix cache
        rest = llm.generate(prompts[1:], params[1:])
        assert rest[0].num_cached_tokens == 32
        outs[name] = [(o.token_ids, o.logprobs) for o in first + rest]
    if gemm.startswith("kiln-w8a8"):  # tokens exact; logprobs to float32 rounding: seen once differing in the 7th digit
        for (s_ids, s_lps), (m_ids, m_lps) in zip(outs["stack"], outs["modules"], strict=True):
            assert s_ids == m_ids and [sorted(a) for a in s_lps] == [sorted(b) for b in m_lps]
            assert all(abs(a[t] - b[t]) < 1e-5 for a, b in zip(s_lps, m_lps, strict=True) for t in a)
    else:
        assert outs["stack"] == outs["modules"]
    assert calls and max(calls) > CPU_MLP_ROWS


def test_decoder_stack_stays_off_where_it_cannot_run(fresh, toy_model, make_llm):
    """Linears on torch's kernels (fp8 weights; a table that chose them) and the torch backend keep the
    per-module path, and say why."""
    model_dir = toy_model("llama-tiny")
    kwargs = dict(num_kv_blocks=16, device="cpu", tactics="kiln-fma")
    fp8 = make_llm(model_dir, attention_backend="native", quantization="fp8", **kwargs).engine.runner.model
    assert fp8.model.native_stack is None
    assert "not packed" in fp8.bind_native_stack(native.kernels())
    plain = make_llm(model_dir, attention_backend="native", **{**kwargs, "tactics": "aten"}).engine.runner.model
    assert plain.model.native_stack is None
    assert make_llm(model_dir, attention_backend="torch", **kwargs).engine.runner.model.model.native_stack is None
    assert make_llm(model_dir, attention_backend="native", **kwargs).engine.runner.model.model.native_stack is not None


def _spy(build, calls):
    def wrapped(inputs):
        md = build(inputs)
        calls.append((inputs, md))
        return md
    return wrapped


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 ISA levels")
def test_levels_follow_the_cpu_flags(monkeypatch):
    monkeypatch.delenv(isa.ISA_ENV, raising=False)  # uncapped, whatever cap the suite runs under
    v3 = set(isa.LEVEL_FLAGS["x86-64-v3"])
    assert isa.host_levels(frozenset(isa.LEVEL_FLAGS["x86-64-v4"])) == ["x86-64-v4", "x86-64-v3"]
    assert isa.host_levels(frozenset(v3)) == ["x86-64-v3"]  # an AVX2-only EPYC
    assert isa.host_levels(frozenset(v3 - {"avx2"})) == []
    assert isa.host_levels(cpu_target.cpu_flags())  # this machine runs one


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 ISA levels")
def test_isa_cap_keeps_the_kernels_at_or_below_it(fresh, monkeypatch, caplog):
    v4 = frozenset(isa.LEVEL_FLAGS["x86-64-v4"])
    monkeypatch.setenv(isa.ISA_ENV, "x86-64-v3")
    assert isa.host_levels(v4) == ["x86-64-v3"]
    assert isa.host_levels(frozenset(isa.LEVEL_FLAGS["x86-64-v3"])) == ["x86-64-v3"]
    assert native.kernels().level == "x86-64-v3"  # what an AVX2-only host loads, on this one
    monkeypatch.setenv(isa.ISA_ENV, "x86-64-v4")  # a cap above the host's best changes nothing
    assert isa.host_levels(frozenset(isa.LEVEL_FLAGS["x86-64-v3"])) == ["x86-64-v3"]
    for cap in ("x86-64-v4", "avx512_bf16"):  # the AVX-512 library, without AMX (and without vdpbf16ps)
        monkeypatch.setenv(isa.ISA_ENV, cap)
        native.reset()
        assert isa.host_levels(v4) == ["x86-64-v4", "x86-64-v3"]
        if native.kernels().level == "x86-64-v4":
            assert native.kernels().gemm_kernels[torch.bfloat16]["amx"] == f"$KILN_CPU_ISA={cap} caps it off" or \
                "lacks" in native.kernels().gemm_kernels[torch.bfloat16]["amx"]
            if cap == "x86-64-v4" and "avx512_bf16" in cpu_target.cpu_flags():
                assert torch.bfloat16 not in native.kernels().linear_dtypes
    monkeypatch.setenv(isa.ISA_ENV, "avx2")
    with caplog.at_level("WARNING", logger=isa.log.name):
        assert isa.host_levels(v4) == ["x86-64-v4", "x86-64-v3"]
    assert f"$KILN_CPU_ISA=avx2 is not an ISA level of x86_64 ({', '.join(isa.CAP_ORDER['x86_64'])})" in caplog.text
    assert "x86-64-v3, avx_vnni, x86-64-v4, avx512_vnni" in caplog.text  # lowest first


def test_artifact_ships_every_level_and_the_host_picks_its_own(fresh_cache, monkeypatch):
    art = fresh_cache / "engine"
    record = cpu_library.build_for_artifact(art)
    assert record["packed"] and record["source_sha256"] == cpu_library.source_digest()
    assert set(record["libraries"]) == set(isa.ARCH_LEVELS[platform.machine()])
    built = sorted((fresh_cache / "cache").glob("*.so"))  # the build compiles through the cache: one per level
    assert len(built) == len(record["libraries"])
    assert cpu_library.build_for_artifact(fresh_cache / "again")["packed"]  # a second build compiles nothing
    assert sorted((fresh_cache / "cache").glob("*.so")) == built
    assert cpu_library.install_from_artifact(art, {"kernels": record}, trusted=True) == sorted(record["libraries"])
    best = isa.host_levels()[0]
    loaded = native.kernels()
    assert loaded.level == best and loaded.path == art / cpu_library.CPU_DIR / f"{best}.so"
    assert sorted((fresh_cache / "cache").glob("*.so")) == built  # loading compiled nothing either


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 ISA levels")
def test_avx2_only_host_never_loads_the_avx512_library(fresh, monkeypatch):
    art = fresh / "engine"
    record = cpu_library.build_for_artifact(art)
    monkeypatch.setattr(cpu_target, "cpu_flags", lambda: frozenset(isa.LEVEL_FLAGS["x86-64-v3"]))
    cpu_library.install_from_artifact(art, {"kernels": record}, trusted=True)
    kernels = native.kernels()
    assert kernels.path.name == "x86-64-v3.so" and kernels.level == "x86-64-v3"
    # the AVX2 build computes the same attention (this host runs it too)
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(2, 8, 16, 64, generator=g), torch.randn(2, 8, 16, 64, generator=g)
    q, lens, tables = torch.randn(3, 6, 64, generator=g), torch.tensor([5, 16, 100], dtype=torch.int32), \
        torch.randint(0, 8, (3, 7), generator=g, dtype=torch.int32)
    stored_k, stored_v = torch.empty_like(k_cache), torch.empty_like(v_cache)
    kernels.store_cache(k_cache, v_cache, stored_k, stored_v)
    out = torch.empty_like(q)
    kernels.paged_attention(q, stored_k, stored_v, tables, lens, 0.125, out)
    torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, tables, lens, 0.125), rtol=1e-5, atol=1e-5)
    # and the same GEMM, over its own (16-column) panels
    w, x, b = torch.randn(70, 300, generator=g), torch.randn(13, 300, generator=g), torch.randn(70, generator=g)
    assert kernels.linear_panel == 16
    torch.testing.assert_close(kernels.pack_linear(w)(x, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 ISA levels")
def test_engine_on_the_avx2_library_gives_transformers_tokens(fresh, monkeypatch, toy_model, make_llm, hf_greedy):
    """The whole float32 engine on the x86-64-v3 library (an AVX2-only host's): GEMM panels of 16, the
    attention's 8-wide vectors and the layer stack, through chunked prefill and a prefix hit."""
    monkeypatch.setenv(isa.ISA_ENV, "x86-64-v3")
    model_dir = toy_model("llama-tiny")
    shared = random_prompts([33], seed=7)[0][1:]
    prompts = random_prompts([45, 50], seed=2, prefix=shared) + random_prompts([3, 71], seed=1)
    llm = make_llm(model_dir, attention_backend="native", num_kv_blocks=64, block_size=8, max_num_tokens=24,
                   max_batch_size=4, device="cpu", tactics="kiln-fma")
    assert native.kernels().level == "x86-64-v3" and llm.engine.runner.model.model.native_stack is not None
    max_tokens = [5, 7, 9, 6]
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens])
    for prompt, n, out in zip(prompts, max_tokens, outs, strict=True):
        assert out.token_ids == hf_greedy(model_dir, prompt, n), f"prompt of {len(prompt)} tokens"
    assert outs[1].num_cached_tokens > 0


def test_another_kilns_kernels_are_not_used(fresh, module_kernels_dir, caplog):
    art = fresh / "engine"
    record = {**cpu_library.build_for_artifact(art), "source_sha256": "0" * 64}
    with caplog.at_level(logging.WARNING, logger="kiln.engine.kernels.native"):
        assert cpu_library.install_from_artifact(art, {"kernels": record}, trusted=True) == []
    assert "another kiln's source" in caplog.text
    assert native.kernels().path.parent == module_kernels_dir  # this kiln's, from its compile cache, instead


def test_a_librarys_name_follows_its_extra_flags_and_the_files_they_name(tmp_path):
    header = tmp_path / "extra.h"
    header.write_text("#define A 1\n")
    plain, with_header = cpu_library.library_name("x86-64-v3"), cpu_library.library_name(
        "x86-64-v3", ("-include", str(header)))
    header.write_text("#define A 2\n")
    assert len({plain, with_header, cpu_library.library_name("x86-64-v3", ("-include", str(header)))}) == 3


def test_an_unverified_artifacts_library_is_never_loaded(fresh, module_kernels_dir, caplog):
    """A shipped library runs its constructors when it is loaded, so only a verified artifact's is loaded
    (kiln serve --verify-key); any other artifact runs the kernels this kiln compiles from its own source."""
    art = fresh / "engine"
    record = cpu_library.build_for_artifact(art)
    ran = fresh / "constructor-ran"
    planted = fresh / "planted.c"
    planted.write_text(f'#include <stdio.h>\n__attribute__((constructor)) static void run(void) '
                       f'{{ FILE *f = fopen("{ran}", "w"); if (f) fclose(f); }}\n')
    for info in record["libraries"].values():  # a store writer swaps every level for its own library
        subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-o", str(art / cpu_library.CPU_DIR /
                        info["file"]), str(planted)], check=True)
    with caplog.at_level(logging.WARNING, logger="kiln.engine.kernels.native"):
        assert cpu_library.install_from_artifact(art, {"kernels": record}) == []
    assert "signature was not verified" in caplog.text
    assert native.kernels().path.parent == module_kernels_dir  # this kiln's, compiled from its own source
    assert not ran.exists()


def test_without_a_compiler_cpu_runs_torch_and_says_why(fresh_cache, monkeypatch, caplog, toy_model):
    monkeypatch.setenv("CC", str(fresh_cache / "no-such-cc"))
    model_dir = str(toy_model("llama-tiny"))
    with caplog.at_level(logging.WARNING, logger="kiln.engine.kernels.native"):
        assert EngineConfig(model=model_dir, device="cpu").attention_backend == "torch"
    assert "no C compiler" in caplog.text and "attention runs on torch" in caplog.text
    with pytest.raises(ConfigError, match=r"^attention_backend 'native' .*C compiler.*use 'auto' or 'torch'$"):
        EngineConfig(model=model_dir, device="cpu", attention_backend="native")


def test_a_failing_compiler_is_reported(fresh_cache, monkeypatch, caplog):
    fake = fresh_cache / "cc"
    fake.write_text("#!/bin/sh\necho 'cc1: error: bad -march' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    with caplog.at_level(logging.WARNING, logger="kiln.engine.kernels.native"):
        assert native.kernels() is None
    assert "bad -march" in caplog.text
    assert not list((fresh_cache / "cache").iterdir())  # no half-written library left behind


def test_switched_off(fresh, monkeypatch, toy_model):
    monkeypatch.setenv("KILN_CPU_KERNELS", "0")
    assert native.kernels() is None
    assert EngineConfig(model=str(toy_model("llama-tiny")), device="cpu").attention_backend == "torch"
