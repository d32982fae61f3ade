"""W8A8 on AMX-INT8 tiles (issue 41; ``csrc/gemm_w8a8_amx.c``, the ``kiln-w8a8-amx`` candidate).

Most hosts have no AMX, so the kernel is also compiled against a software AMX (``amx_emulate.h``: the tile
instructions in C, faulting on every shape the hardware faults on) and run on any AVX-512 host: it must give the
vector tiles' results bit for bit (the same integer sums, the same float epilogue in the same order), over partial
panels, K not a multiple of 32, every row count a tile or a chunk splits, float32 and bf16, one and two threads.
On an AMX host the real library runs the same comparison on the real tiles; elsewhere the candidate says why it
cannot run, and a weight forced onto it still gets the vector tiles' answer (no fault)."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from kiln.engine.kernels import candidates, cpu_library, isa, native
from kiln.engine.kernels.packed import GEMM_KERNELS, ROW_BUCKETS
from kiln.engine.layers.quant import quantize_weight

EMULATOR = Path(__file__).with_name("amx_emulate.h")
LEVEL = "x86-64-v4"  # the library AMX-INT8 is compiled into
pytestmark = pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("cc") is None,
                                reason="W8A8 runs in kiln's x86-64 library, compiled here")
SHAPES = [(72, 200), (130, 37), (64, 64), (257, 130), (5, 3)]  # partial panels; K past whole 32-blocks
ROWS = [1, 2, 3, 4, 15, 16, 17, 33, 200]  # one tile, split tiles, a second 192-row chunk


def _needs_v4() -> None:
    if LEVEL not in isa.host_levels():
        pytest.skip(f"the AMX-INT8 kernel is in the {LEVEL} library, which this host cannot run")


@pytest.fixture(scope="module")
def emulated() -> tuple[native.Kernels, ctypes.CDLL]:
    """kiln's x86-64-v4 library with the AMX tile instructions emulated, and the W8A8 tiles allowed onto them."""
    _needs_v4()
    out = _emulated_library()
    kernels = native.Kernels(out, LEVEL)
    lib = ctypes.CDLL(str(out))  # the same loaded library
    if kernels.gemm_kernels[torch.float32]["w8a8"]:
        pytest.skip(f"W8A8 does not run here: {kernels.gemm_kernels[torch.float32]['w8a8']}")
    lib.kiln_w8a8_allow_amx(1)  # the host's flags said no; the emulator runs anywhere
    return kernels, lib


def _emulated_library() -> Path:
    """The emulated library, compiled once per sources, flags and emulator into the compile cache beside kiln's own
    libraries (a compile of the whole library is 5-25 s)."""
    return cpu_library.compile_library(LEVEL, cpu_library.default_dir(),
                                       extra=("-DKILN_AMX_EMULATE", "-include", str(EMULATOR)))


def _emulated_ops(lib: ctypes.CDLL) -> int:
    return ctypes.c_uint64.in_dll(lib, "amx_emu_dpbusd_ops").value


def _force(packed, kernel: str) -> None:
    """Every row bucket on ``kernel``, past ``set_tactics``' check (which refuses AMX-INT8 on a host without it)."""
    packed.weight.kernel[:] = [GEMM_KERNELS[kernel]] * ROW_BUCKETS


def _dtypes(kernels: native.Kernels) -> list[torch.dtype]:
    return [dt for dt in (torch.float32, torch.bfloat16) if kernels.gemm_kernels[dt]["w8a8"] is None]


def _both(kernels: native.Kernels, n: int, k: int, rows: int, dtype: torch.dtype, bias: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, s = quantize_weight(torch.randn(n, k, generator=gen) * 0.05, "int8")
    x = (torch.randn(rows, k, generator=gen) * 3).to(dtype)
    b = torch.randn(n, generator=gen) if bias else None
    packed = kernels.pack_linear(q, ["w8a8"] * ROW_BUCKETS, s, dtype)
    vector = packed(x, b)
    _force(packed, "w8a8_amx")
    return vector, packed(x, b)


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_the_amx_int8_tiles_give_the_vector_tiles_bits(emulated, n, k, threads):
    kernels, lib = emulated
    before, old = _emulated_ops(lib), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype in _dtypes(kernels):
            for rows in ROWS:
                vector, amx = _both(kernels, n, k, rows, dtype, bias=rows % 2 == 1, seed=rows * 31 + n)
                assert torch.equal(vector, amx), (dtype, rows)
    finally:
        torch.set_num_threads(old)
    assert _emulated_ops(lib) > before  # the tiles ran, not the fallback


def test_the_tile_state_carries_nothing_between_calls(emulated):
    """Calls of other row counts in between (each configures its thread's tiles anew and releases them) change
    no answer."""
    kernels, lib = emulated
    for dtype in _dtypes(kernels):
        first = [_both(kernels, 96, 160, rows, dtype, True, 7)[1] for rows in (1, 16, 40)]
        again = [_both(kernels, 96, 160, rows, dtype, True, 7)[1] for rows in (1, 16, 40)]
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


@pytest.mark.parametrize("source", [
    "char t[64] = {1}; t[16] = 64; t[48] = 17; amx_emu_config(t);",  # 17 rows
    "char t[64] = {1}; amx_emu_load(0, t, 64);",  # an unconfigured tile
    # A 16 x 64 bytes against B of 8 rows (K 32): A's bytes a row must be 4 x B's rows
    "char t[64] = {1}; t[16] = 64; t[18] = 64; t[20] = 64; t[48] = 16; t[49] = 16; t[50] = 8; amx_emu_config(t);"
    " amx_emu_dpbusd(0, 1, 2);",
])
def test_the_emulator_faults_where_the_hardware_does(tmp_path, source):
    """The emulator is only worth what it checks: each shape the hardware refuses aborts it, naming why."""
    prog = tmp_path / "bad.c"
    prog.write_text(f'#include "{EMULATOR}"\nint main(void) {{ {source} return 0; }}\n')
    exe = tmp_path / "bad"
    subprocess.run(["cc", "-o", str(exe), str(prog)], check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode != 0 and "the hardware would fault" in run.stderr


def test_the_candidate_says_why_not_and_a_forced_weight_still_answers(w8a8_fresh):
    """The real library: on an AMX host the tiles themselves against the vector ones; elsewhere the candidate names
    what is missing, ``set_tactics`` refuses it, and a weight forced onto it gets the vector tiles' answer."""
    kernels = native.kernels()
    if kernels is None or kernels.gemm_kernels[torch.float32]["w8a8"]:
        pytest.skip("W8A8 does not run here")
    why = candidates.why_not("kiln-w8a8-amx", torch.float32, kernels, "int8")
    has = {"amx_tile", "amx_int8"} <= set(isa.cpu_target.cpu_flags()) and kernels.level == LEVEL
    assert has or why is not None
    if why is not None:
        assert "amx" in why.lower() or "library" in why or "caps it off" in why
        q, s = quantize_weight(torch.randn(64, 64), "int8")
        with pytest.raises(ValueError, match="w8a8_amx"):
            kernels.pack_linear(q, ["w8a8_amx"] * ROW_BUCKETS, s, torch.float32)
    for n, k in SHAPES[:3]:
        for rows in (1, 16, 33):
            vector, forced = _both(kernels, n, k, rows, torch.float32, True, rows)
            assert torch.equal(vector, forced)
    assert "kiln-w8a8-amx" in candidates.expand(["w8a8"])  # the quality gate's switch takes it out too


def test_the_isa_cap_takes_amx_int8_with_amx(monkeypatch):
    flags = frozenset({*isa.LEVEL_FLAGS[LEVEL], "amx_tile", "amx_int8", "amx_bf16"})
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.delenv(isa.ISA_ENV, raising=False)
    assert isa.feature_missing("amx_int8", LEVEL, flags) is None
    monkeypatch.setenv(isa.ISA_ENV, "amx")
    assert isa.feature_missing("amx_int8", LEVEL, flags) is None
    monkeypatch.setenv(isa.ISA_ENV, "avx512_bf16")
    assert "caps it off" in isa.feature_missing("amx_int8", LEVEL, flags)
    assert "lacks amx_int8" in isa.feature_missing("amx_int8", LEVEL, flags - {"amx_int8"})
