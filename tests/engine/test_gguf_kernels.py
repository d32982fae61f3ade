"""kiln's GGUF GEMM (csrc/gemm_gguf.c) against a float64 reference of the same block math: Q8_0, Q4_0, Q4_1,
odd N, K a multiple of 32, 1..40 rows; the VNNI and AVX2 paths, the dequantizing mode and bf16 activations."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from kiln.engine.kernels import gguf_blocks
from kiln.engine.kernels.native import ROW_BUCKETS, kernels

pytestmark = pytest.mark.skipif(kernels() is None, reason="kiln's CPU kernels do not load here")
TYPES = ("Q8_0", "Q4_0", "Q4_1")


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and 32-block, as the kernel: round_half_even(x * (127 / amax)) in float32, scale amax / 127."""
    b = x.float().reshape(x.shape[0], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (b * inv).round().clamp(-127, 127), amax / 127


def reference(x: torch.Tensor, blocks: torch.Tensor, kind: str, bias: torch.Tensor | None) -> torch.Tensor:
    """float64: sum over blocks of (dequantized weight block) . (dequantized activation block)."""
    xq, dx = quantize_x(x)
    xd = (xq.double() * dx.double()).reshape(x.shape[0], -1)
    w = gguf_blocks.dequantize(blocks, kind, torch.float64)
    y = xd @ w.T
    return y if bias is None else y + bias.double()


def run(x, blocks, kind, kernel="gguf", bias=None):
    packed = kernels().pack_linear(blocks, [kernel] * ROW_BUCKETS, dtype=x.dtype, gguf_type=kind)
    return packed(x, bias)


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("n,k", [(37, 64), (70, 96), (129, 256)])
def test_gguf_gemm_matches_block_math(kind, n, k):
    gen = torch.Generator().manual_seed(n + k)
    blocks = gguf_blocks.quantize(torch.randn(n, k, generator=gen) * 0.05, kind)
    bias = torch.randn(n, generator=gen)
    for rows in (1, 2, 3, 5, 8, 17, 40):
        x = torch.randn(rows, k, generator=gen)
        y = run(x, blocks, kind, bias=bias if rows % 2 else None)
        ref = reference(x, blocks, kind, bias if rows % 2 else None)
        torch.testing.assert_close(y.double(), ref, rtol=2e-5, atol=2e-5 * ref.abs().max().item())


@pytest.mark.parametrize("kind", TYPES)
def test_dequantizing_mode_is_the_float_linear(kind):
    gen = torch.Generator().manual_seed(3)
    blocks = gguf_blocks.quantize(torch.randn(75, 160, generator=gen) * 0.05, kind)
    x = torch.randn(9, 160, generator=gen)
    y = run(x, blocks, kind, "gguf_f32")
    ref = x.double() @ gguf_blocks.dequantize(blocks, kind, torch.float64).T
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


def test_bf16_activations():
    gen = torch.Generator().manual_seed(4)
    blocks = gguf_blocks.quantize(torch.randn(50, 128, generator=gen) * 0.05, "Q4_1")
    x = torch.randn(6, 128, generator=gen).bfloat16()
    y = run(x, blocks, "Q4_1")
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), reference(x, blocks, "Q4_1", None), rtol=1e-2, atol=1e-2)


def test_quantize_round_trip_and_sizes():
    w = torch.randn(8, 64) * 0.1
    for kind in TYPES:
        blocks = gguf_blocks.quantize(w, kind)
        assert blocks.shape == (8, gguf_blocks.row_bytes(64, kind))
        err = (gguf_blocks.dequantize(blocks, kind) - w).abs().max().item()
        assert err < (0.01 if kind == "Q8_0" else 0.05)


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo") or "avx2" not in open("/proc/cpuinfo").read(),
                    reason="needs an AVX2 host")
def test_avx2_library_agrees():
    """The x86-64-v3 library (maddubs; Q8_0 by the sign trick) gives the VNNI path's results."""
    here = os.path.dirname(__file__)
    code = (f"import torch, sys; sys.path.insert(0, {here!r}); from test_gguf_kernels import *; "
            "assert kernels().level == 'x86-64-v3', kernels().level; "
            "[test_gguf_gemm_matches_block_math(t, 70, 96) for t in TYPES]; print('ok')")
    env = {**os.environ, "KILN_CPU_ISA": "x86-64-v3"}
    out = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_a_gguf_linear_whose_k_is_not_the_layers_is_refused():
    """A linear's placeholder is [out, 0]: its K was never checked, and the C stack read past the blocks of a
    weight with fewer features than the layer (issue 38, low)."""
    from pathlib import Path

    from kiln.engine import ConfigError
    from kiln.engine.weights import _load_gguf
    from torch import nn

    model = nn.Module()
    model.lin = nn.Module()
    model.lin.input_size = 64
    param = nn.Parameter(torch.empty(4, 0, dtype=torch.uint8), requires_grad=False)
    model.lin.weight = param
    per_block = gguf_blocks.GGUF_TYPES["Q8_0"][1]
    with pytest.raises(ConfigError, match=r"lin.weight is GGUF Q8_0 \(4, 34\).*expects 4 rows of 64 features"):
        _load_gguf(model, "lin.weight", param, torch.zeros(4, per_block, dtype=torch.uint8), "Q8_0", Path("w"))
    _load_gguf(model, "lin.weight", param, torch.zeros(4, 2 * per_block, dtype=torch.uint8), "Q8_0", Path("w"))
    assert param.gguf_type == "Q8_0" and param.shape == (4, 68)
