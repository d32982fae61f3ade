"""Quantized GEMMs: the int8 weight-only Triton kernel, the fp8 ``_scaled_mm`` path, and the dispatch rule.

Without CUDA the int8 kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, set here
before triton is imported) on CPU tensors; with CUDA the same tests run natively. The fp8 math
is checked on CPU with the very call the GPU makes (torch 2.13 has a CPU ``_scaled_mm``), and on
the ``meta`` device, whose ``_scaled_mm`` applies the CUDA kernel's layout rules (row-major A,
column-major B, K and N multiples of 16). Tests marked ``gpu`` run the real thing on a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import time

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kiln.engine.kernels.fp8 import (  # noqa: E402
    FP8_DTYPE,
    FP8_MIN_CAPABILITY,
    can_use_scaled_mm,
    device_runs_fp8,
    emulate_fp8_linear,
    fp8_gemm_supported,
    fp8_linear,
    quantize_activation,
)
from kiln.engine.kernels.quant_linear import dequantize, quant_path  # noqa: E402
from kiln.engine.layers.linear import LinearBase  # noqa: E402
from kiln.engine.layers.quant import quantize_weight  # noqa: E402

from kiln.skus import FP8_MIN_COMPUTE_CAPABILITY, GPU_SKUS  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install 'kiln[test]')")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
EPS = {torch.float32: 1e-5, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def int8_problem(m: int, k: int, n: int, dtype: torch.dtype, bias: bool, seed: int = 0, device: str = DEVICE):
    g = torch.Generator().manual_seed(seed)
    q, scale = quantize_weight(torch.randn(n, k, generator=g), "int8")
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x.to(device), q.to(device), scale.to(device), None if b is None else b.to(device)


def int8_reference(x, q, scale, b):
    y = x.float() @ (q.float() * scale[:, None]).t()
    return y if b is None else y + b.float()


def assert_close_in(dtype, y, ref):
    """Within a few units of the output dtype's rounding (plus fp32 summation-order noise)."""
    torch.testing.assert_close(y.float(), ref.float(), rtol=2 * EPS[dtype], atol=1e-4 * ref.abs().max().item())


# -- int8: the Triton kernel --------------------------------------------------------------------

@pytest.fixture(scope="module")
def int8_gemm():
    pytest.importorskip("triton", reason="triton is not installed (pip install 'kiln[test]')")
    from kiln.engine.kernels import int8_gemm

    return int8_gemm


@pytest.mark.kernels
@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_kernel_matches_the_float_reference(int8_gemm, m, dtype, bias):
    x, q, scale, b = int8_problem(m, 200, 72, dtype, bias)  # K, N: multiples of no block size
    y = int8_gemm.int8_weight_only_linear(x, q, scale, b)
    assert y.shape == (m, 72) and y.dtype == dtype
    assert_close_in(dtype, y, int8_reference(x, q, scale, b))


@pytest.mark.kernels
def test_every_block_config_is_correct(int8_gemm):
    """Each autotuning candidate, forced, on a shape none of them tiles evenly."""
    for dtype, configs in ((torch.float16, int8_gemm.CONFIGS), (torch.float32, int8_gemm.F32_CONFIGS)):
        x, q, scale, b = int8_problem(37, 328, 136, dtype, True, seed=1)
        ref = int8_reference(x, q, scale, b)
        for config in configs:
            y = int8_gemm.int8_weight_only_linear(x, q, scale, b, config=config)
            assert_close_in(dtype, y, ref)


@pytest.mark.kernels
def test_int8_kernel_takes_strided_and_batched_inputs(int8_gemm):
    x, q, scale, _ = int8_problem(6, 96, 40, torch.float32, False, seed=2)
    wide = torch.cat([x, torch.randn(6, 8, device=x.device)], dim=1)[:, :96]  # row stride 104, not 96
    assert not wide.is_contiguous()
    assert_close_in(torch.float32, int8_gemm.int8_weight_only_linear(wide, q, scale), int8_reference(x, q, scale, None))
    y3 = int8_gemm.int8_weight_only_linear(x.view(2, 3, 96), q, scale)
    assert y3.shape == (2, 3, 40)
    assert_close_in(torch.float32, y3.view(6, 40), int8_reference(x, q, scale, None))
    assert int8_gemm.int8_weight_only_linear(x[:0], q, scale).shape == (0, 40)
    with pytest.raises(ValueError, match="do not fit"):
        int8_gemm.int8_weight_only_linear(x[:, :64], q, scale)


@pytest.mark.kernels
def test_autotuning_key_buckets_m_and_prunes_tall_tiles(int8_gemm):
    assert [int8_gemm.m_bucket(m) for m in (1, 16, 17, 64, 65, 300, 4096)] == [16, 16, 32, 64, 128, 512, 512]
    for bucket in (16, 32, 64, 512):
        kept = int8_gemm._prune(int8_gemm.CONFIGS, {"M_BUCKET": bucket})
        assert kept and all(c.kwargs["BLOCK_M"] <= bucket for c in kept)
        assert len(kept) == sum(c.kwargs["BLOCK_M"] <= bucket for c in int8_gemm.CONFIGS)


# -- fp8: activation quantization and the _scaled_mm call ---------------------------------------

def fp8_problem(m: int, k: int, n: int, dtype: torch.dtype, seed: int = 0, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    q, scale = quantize_weight(torch.randn(n, k, generator=g) * 0.05, "fp8")
    x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 1, m)[:, None]).to(dtype)  # rows of different sizes
    return x.to(device), q.to(device), scale.to(device), torch.randn(n, generator=g).to(dtype).to(device)


# Hopper's FP8 tensor cores keep about 14 bits of a running sum between cuBLAS's promotions to float32
# (DeepSeek-V3 technical report, section 3.3.2): a few such additions per promoted chunk put each output within
# 2^-11 of the sum of its terms' magnitudes. Seen on an H200 (2026-11-30): at K=4096 some outputs a bf16 ulp
# or two off where the terms cancel, past the float32 bound the CPU's _scaled_mm meets.
FP8_ACCUMULATION = 2.0 ** -11


def assert_fp8_close(y, emulated, bias, x=None, weight=None, weight_scale=None):
    """The GEMM's bf16 output and the bias add round once each: within an ulp of each term (plus fp32
    summation-order noise). Given the operands, also within the tensor cores' accumulation bound of the
    terms' magnitudes, and no more than an ulp off on average."""
    b = bias.float()
    bound = 2 * EPS[torch.bfloat16] * ((emulated - b).abs() + b.abs()) + 1e-5 * emulated.abs().max()
    err = (y.float() - emulated).abs()
    if x is not None:
        x_q, x_scale = quantize_activation(x.reshape(-1, x.shape[-1]))
        terms = (x_q.float().abs() @ weight.float().abs().t()) * x_scale * weight_scale.float()[None, :]
        bound = bound + FP8_ACCUMULATION * terms
        assert err.mean() <= EPS[torch.bfloat16] * emulated.abs().mean()
    assert (err <= bound).all(), f"worst {(err - bound).max().item():.3g} past the bound"


def test_activation_quantization_round_trip():
    x = torch.randn(5, 64) * torch.tensor([1e-3, 1.0, 30.0, 500.0, 1.0])[:, None]
    x[4] = 0.0
    q, scale = quantize_activation(x.to(torch.bfloat16))
    assert q.dtype == FP8_DTYPE and q.shape == (5, 64) and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (5, 1)
    assert torch.equal(q[:4].float().abs().amax(dim=1), torch.full((4,), 448.0))  # each row's max hits e4m3's max
    back = q.float() * scale
    xb = x.to(torch.bfloat16).float()
    # e4m3: 3 mantissa bits (half an ulp is 2^-4 relative), subnormal step 2^-9 of the scale.
    assert ((back - xb).abs() <= xb.abs() * 2.0 ** -4 + scale * 2.0 ** -10).all()
    assert torch.equal(back[4], torch.zeros(64))  # an all-zero row: zeros, no NaN


@pytest.mark.parametrize("m", [1, 3, 17, 64])
def test_scaled_mm_call_computes_the_emulated_fp8_linear(m):
    """The exact GPU call (row-wise scales [M,1] x [1,N], W^T column-major) through torch's CPU _scaled_mm."""
    x, q, scale, b = fp8_problem(m, 128, 48, torch.bfloat16)
    y = fp8_linear(x, q, scale, b)
    assert y.shape == (m, 48) and y.dtype == torch.bfloat16
    emulated = emulate_fp8_linear(x, q, scale, b).float()
    assert_fp8_close(y, emulated, b)
    # ... and both are the float linear up to the activations' fp8 rounding (2^-4 relative per element).
    exact = F.linear(x.float(), dequantize(q, scale, torch.float32), b.float())
    err = (emulated - exact).abs().amax(dim=1)
    row = (x.float().abs() @ dequantize(q, scale, torch.float32).abs().t()).amax(dim=1)
    assert (err <= row * 2.0 ** -4 + 0.02).all()


def test_scaled_mm_arguments_pass_the_cuda_layout_checks():
    """On ``meta``, _scaled_mm checks what the CUDA kernel demands; the stored [N, K] weight's .t() is column-major."""
    x = torch.empty(7, 4096, dtype=torch.bfloat16, device="meta")
    w = torch.empty(11008, 4096, dtype=FP8_DTYPE, device="meta")
    y = fp8_linear(x.view(1, 7, 4096), w, torch.empty(11008, device="meta"))
    assert y.shape == (1, 7, 11008) and y.dtype == torch.bfloat16
    x_q, x_scale = quantize_activation(x)
    with pytest.raises(RuntimeError, match="col_major"):  # the check is live: a row-major B is refused
        torch._scaled_mm(x_q, w.t().contiguous(), scale_a=x_scale, scale_b=torch.empty(1, 11008, device="meta"),
                         out_dtype=torch.bfloat16)


# -- the rules: which devices run what ----------------------------------------------------------

def test_scaled_mm_support_is_asked_of_torch_once_and_a_refusal_falls_back(monkeypatch, caplog):
    """Which output dtypes the row-wise kernels take changed between torch releases: a refusal warns
    once and the layer dequantizes instead of raising on its first forward."""
    import logging

    from kiln.engine.kernels import fp8

    fp8.rowwise_scaled_mm_works.cache_clear()
    assert fp8.rowwise_scaled_mm_works(torch.device("cpu"), torch.bfloat16)  # torch 2.13's CPU kernel takes it
    calls = []

    def refuse(*args, **kwargs):
        calls.append(kwargs["out_dtype"])
        raise RuntimeError("Only bf16 high precision output types are supported for row-wise scaling.")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    fp8.rowwise_scaled_mm_works.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="kiln.engine.fp8"):
            assert not fp8.rowwise_scaled_mm_works(torch.device("cpu"), torch.float16)
            assert not fp8.rowwise_scaled_mm_works(torch.device("cpu"), torch.float16)
    finally:
        fp8.rowwise_scaled_mm_works.cache_clear()
    assert calls == [torch.float16]
    (line,) = [r.getMessage() for r in caplog.records]
    assert "row-wise scales with torch.float16" in line and "dequantized per call" in line


def test_fp8_rule_is_compute_capability_8_9():
    assert [fp8_gemm_supported(c) for c in [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]] == \
        [False, False, False, True, True, True, True]
    assert not fp8_gemm_supported(None)
    assert not device_runs_fp8(torch.device("cpu")) and not device_runs_fp8(torch.device("meta"))


def test_sku_table_agrees_with_the_engine_fp8_rule():
    """kiln/skus.py may not import the engine: this pins that its supports_fp8 is the engine's rule."""
    assert FP8_MIN_COMPUTE_CAPABILITY == FP8_MIN_CAPABILITY
    for name, sku in GPU_SKUS.items():
        if sku.is_cpu:
            # cpu is allowed as the reference path: the engine dequantizes fp8 there (quant_path below).
            assert sku.supports_fp8 and not fp8_gemm_supported(None), name
            continue
        major, minor = (int(v) for v in sku.compute_capability.split("."))
        assert sku.arch == f"sm{major}{minor}", name
        assert sku.supports_fp8 == fp8_gemm_supported((major, minor)), name
    assert {n for n, s in GPU_SKUS.items() if s.supports_fp8 and not s.is_cpu} == {"L4", "L40S", "H100-80GB",
                                                                                   "H200-141GB"}


def quantized_linear_layer(method: str, k: int, n: int, dtype: torch.dtype, device: str) -> LinearBase:
    with torch.device(device):
        layer = LinearBase(k, n, bias=True).to(dtype)
    g = torch.Generator().manual_seed(3)
    layer.weight.data.copy_(torch.randn(n, k, generator=g) * 0.05)
    layer.bias.data.copy_(torch.randn(n, generator=g))
    layer.quantize_(method)
    return layer


@pytest.mark.parametrize("method,dtype,k,path", [
    ("int8", torch.bfloat16, 64, "int8pack"), ("int8", torch.bfloat16, 48, "dequantize"),
    ("int8", torch.float32, 64, "dequantize"), ("fp8", torch.bfloat16, 64, "dequantize"),
    ("fp8", torch.float32, 64, "dequantize"),
])
def test_cpu_paths_are_unchanged(method, dtype, k, path):
    """On CPU nothing new runs: torch's int8-weight matmul where it applies, else dequantize per call."""
    layer = quantized_linear_layer(method, k, 32, dtype, "cpu")
    x = torch.randn(5, k).to(dtype)
    assert quant_path(x, layer.weight) == path
    assert not can_use_scaled_mm(x, layer.weight)
    y = layer(x)
    if path == "dequantize":
        assert torch.equal(y, F.linear(x, dequantize(layer.weight, layer.weight_scale, dtype), layer.bias))
    else:
        ref = torch._weight_int8pack_mm(x, layer.weight, layer.weight_scale.to(dtype)) + layer.bias
        assert torch.equal(y, ref)


# -- on a GPU -----------------------------------------------------------------------------------

def _time(fn, reps: int = 50) -> str:
    """Microseconds a call, eager (back to back: launches included) and replayed from a CUDA graph (the GPU's
    own time, as a served decode step runs it). The H200's first figures were eager alone, which cannot tell
    a slow kernel from a launch-bound one (docs/gpu.md)."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    eager = (time.perf_counter() - t) / reps * 1e6
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps // 10):
        graph.replay()
    torch.cuda.synchronize()
    return f"{eager:.1f} eager / {(time.perf_counter() - t) / (reps // 10 * 10) * 1e6:.1f} graph"


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("m", [1, 32, 512])
def test_int8_linear_on_cuda_runs_the_triton_kernel(m):
    layer = quantized_linear_layer("int8", 4096, 11008, torch.bfloat16, "cuda")
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    assert quant_path(x, layer.weight) == "triton_int8"
    assert_close_in(torch.bfloat16, layer(x), int8_reference(x, layer.weight, layer.weight_scale, layer.bias))
    w16 = dequantize(layer.weight, layer.weight_scale, torch.bfloat16)
    print(f"\nint8 M={m} K=4096 N=11008: triton {_time(lambda: layer(x))} us, "
          f"bf16 F.linear {_time(lambda: F.linear(x, w16, layer.bias))} us")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(not torch.cuda.is_available() or not device_runs_fp8(torch.device("cuda")),
                    reason="needs a GPU of compute capability >= 8.9")
@pytest.mark.parametrize("m", [1, 32, 512])
def test_fp8_linear_on_cuda_runs_scaled_mm(m):
    layer = quantized_linear_layer("fp8", 4096, 11008, torch.bfloat16, "cuda")
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    assert quant_path(x, layer.weight) == "scaled_mm"
    y = layer(x)
    assert_fp8_close(y, emulate_fp8_linear(x, layer.weight, layer.weight_scale, layer.bias).float(), layer.bias,
                     x, layer.weight, layer.weight_scale)
    w16 = dequantize(layer.weight, layer.weight_scale, torch.bfloat16)
    print(f"\nfp8 M={m} K=4096 N=11008: _scaled_mm {_time(lambda: layer(x))} us, "
          f"bf16 F.linear {_time(lambda: F.linear(x, w16, layer.bias))} us")
