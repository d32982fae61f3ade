"""The x86-64-v3 library's AVX-VNNI paths (issue 41): W8A8's ymm tiles (``csrc/gemm_w8a8_ymm.c``) and GGUF's ymm
groups (``csrc/gemm_gguf_ymm.c``), which run on Intel's client parts from Alder Lake on and on Sierra Forest.

Most hosts that run these tests have no AVX-VNNI, so the library is also compiled with ``-DKILN_AVX_VNNI_EVEX``: the
same tiles, their ``vpdpbusd ymm`` in its EVEX encoding (AVX512VL + AVX512-VNNI), which an AVX512-VNNI host runs.
They must give the AVX512-VNNI library's zmm results bit for bit (the same integer sums, the same float epilogue in
the same order): W8A8 in every form, GGUF for Q4_0, Q4_1 and Q8_0 (whose AVX2 group, by the sign trick, rounds
differently: that difference is how the test knows the VNNI group ran). On a host with AVX-VNNI itself the library
as shipped runs the same comparison on the real instruction."""

from __future__ import annotations

import ctypes
import platform
import shutil

import pytest
import torch
from kiln.engine.cpu_target import cpu_flags
from kiln.engine.kernels import cpu_library, gguf_blocks, isa, native
from kiln.engine.kernels.packed import ROW_BUCKETS
from kiln.engine.layers.quant import quantize_weight

V3, V4 = "x86-64-v3", "x86-64-v4"
pytestmark = pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("cc") is None,
                                reason="the AVX-VNNI tiles are in kiln's x86-64 library, compiled here")
GGUF_SHAPES = [(37, 64), (70, 96), (129, 256), (16, 32)]  # partial column groups, one and several blocks
ROWS = [1, 2, 3, 5, 17, 40]


def _library(level: str, extra: tuple[str, ...] = ()) -> tuple[native.Kernels, ctypes.CDLL]:
    path = cpu_library.compile_library(level, cpu_library.default_dir(), extra=extra)
    return native.Kernels(path, level), ctypes.CDLL(str(path))  # the same loaded library


@pytest.fixture(scope="module")
def zmm() -> native.Kernels:
    """The x86-64-v4 library, its W8A8 tiles and GGUF tiles on AVX512-VNNI (the reference)."""
    flags = cpu_flags()
    if V4 not in isa.host_levels() or not {"avx512_vnni", "avx512vl"} <= flags:
        pytest.skip("needs a host that runs the x86-64-v4 library with AVX512-VNNI")
    kernels, lib = _library(V4)
    assert kernels.w8a8_isa == "avx512_vnni" and lib.kiln_gguf_vnni_running() == 1
    return kernels


@pytest.fixture(scope="module")
def ymm(zmm) -> tuple[native.Kernels, ctypes.CDLL]:
    """The x86-64-v3 library with its AVX-VNNI tiles allowed: as shipped where the CPU has AVX-VNNI, else built
    with their EVEX encoding (this host has AVX512-VNNI: ``zmm``)."""
    if V3 not in isa.host_levels():
        pytest.skip(f"$KILN_CPU_ISA caps off the {V3} library")
    kernels, lib = _library(V3, () if "avx_vnni" in cpu_flags() else ("-DKILN_AVX_VNNI_EVEX",))
    lib.kiln_w8a8_allow_vnni(1)  # the host's flags (no avx_vnni) said no; the EVEX build runs here
    lib.kiln_gguf_set_vnni(1)
    assert lib.kiln_w8a8_vnni_running() == 1 and lib.kiln_gguf_vnni_running() == 1
    return kernels, lib


def _gguf_cases(kind: str):
    gen = torch.Generator().manual_seed(len(kind))
    for n, k in GGUF_SHAPES:
        blocks = gguf_blocks.quantize(torch.randn(n, k, generator=gen) * 0.05, kind)
        bias = torch.randn(n, generator=gen)
        for rows in ROWS:
            for dtype in (torch.float32, torch.bfloat16):
                yield blocks, (torch.randn(rows, k, generator=gen) * 3).to(dtype), bias if rows % 2 else None


def _gguf(kernels: native.Kernels, blocks, x, bias, kind: str) -> torch.Tensor:
    return kernels.pack_linear(blocks, ["gguf"] * ROW_BUCKETS, dtype=x.dtype, gguf_type=kind)(x, bias)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_avx_vnni_gguf_groups_give_the_avx512_vnni_tiles_bits(zmm, ymm, kind):
    kernels, lib = ymm
    differs = 0
    for blocks, x, bias in _gguf_cases(kind):
        want = _gguf(zmm, blocks, x, bias, kind)
        assert torch.equal(_gguf(kernels, blocks, x, bias, kind), want), (kind, tuple(blocks.shape), x.shape)
        lib.kiln_gguf_set_vnni(0)  # the AVX2 group, as on a host without AVX-VNNI
        try:
            avx2 = _gguf(kernels, blocks, x, bias, kind)
        finally:
            lib.kiln_gguf_set_vnni(1)
        differs += not torch.equal(avx2, want)
        torch.testing.assert_close(avx2.float(), want.float(), rtol=1e-5 if x.dtype == torch.float32 else 1e-2,
                                   atol=1e-4 * want.abs().max().item())
    # Q4's integers and epilogue are AVX2's too; Q8_0's AVX2 group has no offset, so it rounds elsewhere
    assert differs == 0 if kind != "Q8_0" else differs > 0


def test_the_avx_vnni_w8a8_tiles_give_the_avx512_vnni_tiles_bits(zmm, ymm):
    kernels, lib = ymm
    gen = torch.Generator().manual_seed(11)
    for n, k, rows in ((72, 200, 5), (257, 130, 1), (960, 576, 13), (64, 64, 4), (130, 37, 2)):
        q, s = quantize_weight(torch.randn(n, k, generator=gen) * 0.05, "int8")
        bias = torch.randn(n, generator=gen)
        for dtype in (torch.float32, torch.bfloat16):
            if zmm.gemm_kernels[dtype]["w8a8"] or kernels.gemm_kernels[dtype]["w8a8"]:
                continue  # bf16 activations need the x86-64-v4 library's vdpbf16ps for its float kernels
            x = (torch.randn(rows, k, generator=gen) * 3).to(dtype)
            want = zmm.pack_linear(q, ["w8a8"] * ROW_BUCKETS, s, dtype)(x, bias)
            assert torch.equal(kernels.pack_linear(q, ["w8a8"] * ROW_BUCKETS, s, dtype)(x, bias), want), (n, k, rows)
    assert lib.kiln_w8a8_vnni_running() == 1  # still on vpdpbusd, not AVX2's tiles


def test_a_caller_that_does_not_allow_it_gets_avx2_and_the_shipped_library_asks_the_cpu(ymm):
    """Without the caller's leave the library runs AVX2's forms; the library kiln ships asks CPUID for AVX-VNNI
    itself, so on this host (where isa.py says no) it runs AVX2 even when told yes."""
    _, lib = ymm
    lib.kiln_w8a8_allow_vnni(0)
    lib.kiln_gguf_set_vnni(0)
    try:
        assert lib.kiln_w8a8_vnni_running() == 0 and lib.kiln_gguf_vnni_running() == 0
    finally:
        lib.kiln_w8a8_allow_vnni(1)
        lib.kiln_gguf_set_vnni(1)
    shipped, plain = _library(V3)
    has = "avx_vnni" in cpu_flags()
    assert shipped.w8a8_isa == ("avx_vnni" if has and isa.feature_missing("avx_vnni", V3) is None else "avx2")
    plain.kiln_w8a8_allow_vnni(1)
    plain.kiln_gguf_set_vnni(1)
    try:
        assert plain.kiln_w8a8_vnni_running() == plain.kiln_gguf_vnni_running() == int(has)
    finally:  # this process's kiln may run the same library: as isa.py left it
        plain.kiln_w8a8_allow_vnni(int(shipped.w8a8_isa == "avx_vnni"))
        plain.kiln_gguf_set_vnni(int(isa.feature_missing("avx_vnni", V3) is None))
