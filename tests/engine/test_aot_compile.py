"""Every Triton kernel kiln ships, compiled ahead of time for every compute capability of the SKU table, on
this CPU-only machine (``kiln.engine.kernels.aot``): it compiles, fits the capability's shared memory and
registers, and ptxas reports no spills. The Triton interpreter cannot see any of that.

The compile runs in a child process: other test modules set ``TRITON_INTERPRET=1``, under which ``triton.jit``
hands out interpreted functions that cannot be compiled. Reports are cached by the kernels' source hash
(``KILN_AOT_CACHE``, default ``~/.cache/kiln/aot``). ``make test`` compiles the quick set (every kernel on every
capability, fewer attention variants: ``aot_variants``; ~1.5 minutes uncached on 2 cores); the ``slow`` tests
compile all of it (~2.5 minutes) and check the table in docs/gpu.md against it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # this process's kernels, like the other kernel tests' (the child unsets it)
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install 'kiln[test]')")

from kiln.builder.kernels_aot import DOC_BEGIN, DOC_END, sku_capabilities, with_table  # noqa: E402
from kiln.engine.kernels.aot import SMEM_PER_BLOCK, KernelReport, table  # noqa: E402

DOCS = Path(__file__).resolve().parents[2] / "docs" / "gpu.md"
SHIPPED = {"_decode_split_kernel", "_decode_reduce_kernel", "_prefill_kernel", "_int8_weight_only_kernel"}


def _child_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")}


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", *args], env=_child_env(), capture_output=True, text=True,
                          timeout=timeout)


def _compile(*flags: str) -> list[KernelReport]:
    proc = _run("-m", "kiln.builder.kernels_aot", "--json", *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [KernelReport(**r) for r in json.loads(proc.stdout)]


@pytest.fixture(scope="module")
def reports() -> list[KernelReport]:
    return _compile()


def check_fits(reports: list[KernelReport], dtypes: tuple[str, ...], groups: tuple[int, ...]) -> None:
    caps = sku_capabilities()
    assert set(caps) >= {80, 89, 90}
    for cap in caps:
        assert {r.kernel for r in reports if r.capability == cap} == SHIPPED, cap
        assert all(r.shared <= SMEM_PER_BLOCK[cap] for r in reports if r.capability == cap)
    variants = {r.variant.split(" [")[0] for r in reports}
    for dtype in ("bfloat16", "float16", "float32"):
        assert f"int8 gemm {dtype} (every config)" in variants
    for dtype in dtypes:  # every head size, GQA group and chunk tile asked for
        for d in (64, 128):
            for g in groups:
                assert f"decode d{d} g{g} {dtype}" in variants
                assert {f"prefill d{d} g{g} {dtype} chunk{n}" for n in (16, 512)} <= variants
    problems = [f"{r.kernel} ({r.variant}) sm_{r.capability}: {p}" for r in reports
                for p in r.problems()]
    assert not problems, "\n".join(problems)


def test_every_shipped_kernel_compiles_for_every_sku_capability_and_fits():
    check_fits(_compile("--quick"), ("bfloat16", "float32"), (1, 8))


@pytest.mark.slow
def test_every_variant_compiles_for_every_sku_capability_and_fits(reports):
    check_fits(reports, ("bfloat16", "float16", "float32"), (1, 4, 8))


@pytest.mark.slow
def test_the_resource_table_in_docs_is_the_one_the_check_generates(reports):
    doc = DOCS.read_text()
    assert DOC_BEGIN in doc and DOC_END in doc
    assert with_table(doc, table(reports)) == doc, (
        "docs/gpu.md's kernel resource table is stale: run `python -m kiln.builder.kernels_aot --write-docs "
        "docs/gpu.md`")


def test_the_check_catches_a_tile_that_overflows_shared_memory(tmp_path):
    """float32 prefill at 64 x 64 tiles, head size 128, the tile kiln used before this check: 115,200 B of
    shared memory on sm_89, whose blocks get 101,376."""
    script = """
import json, sys, torch
from kiln.engine.kernels import aot, paged_attention_prefill as pp
pp.tile_sizes = lambda *a, **k: (64, 64)
def launch():
    q = torch.empty(64, 2, 128)
    cache = torch.empty(2, 8, 16, 128)
    pp.paged_prefill(q, cache, cache, torch.zeros(1, 8, dtype=torch.int32), torch.tensor([0, 64], dtype=torch.int32),
                     torch.tensor([64], dtype=torch.int32), 64, 0.1, torch.empty_like(q), capability=89)
with aot.tempfile.TemporaryDirectory() as d:
    aot.os.environ["TRITON_CACHE_DIR"] = d
    print(json.dumps([r.problems() for r in aot.compile_variant(89, "old fp32 prefill", launch)]))
"""
    proc = _run("-c", script, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (problems,) = json.loads(proc.stdout.strip().splitlines()[-1])
    assert any("shared memory, sm_89 allows 101376" in p for p in problems), problems


def test_a_report_names_each_limit_it_breaks():
    fits = KernelReport("k", "v", 89, 4, 128, 0, 0, 0, 48 * 1024)
    assert fits.problems() == []
    smem = KernelReport("k", "v", 89, 4, 128, 0, 0, 0, 115200)
    assert smem.problems() == ["needs 115200 B of shared memory, sm_89 allows 101376"]
    regs = KernelReport("k", "v", 90, 16, 255, 0, 0, 0, 0)  # 255 x 512 threads > 64K registers
    assert "registers" in regs.problems()[0]
    spill = KernelReport("k", "v", 80, 4, 255, 36, 48, 88, 0)
    assert spill.problems() == ["spills 36 B stores / 48 B loads (reviewed baseline 0 B)"]
    assert spill.problems(spill_baseline=84) == []


def test_a_cross_compiled_kernel_lands_where_the_gpus_jit_looks_for_it():
    """Whether the ahead-of-time path could ship kernels in Triton's cache format: the same launch compiled
    through the cache hook and through the JIT's own compile (which then fails to launch: no GPU) writes the
    same cache entry, i.e. the key a GPU's JIT computes for that launch (same Triton, same ptxas)."""
    script = """
import os, sys, tempfile, torch
from kiln.engine.kernels import aot, aot_variants
from triton import knobs
entries = []
for jit in (False, True):
    os.environ["TRITON_CACHE_DIR"] = d = tempfile.mkdtemp()
    name, launch = aot_variants._attention(90, 128, 4, torch.bfloat16)[2]  # prefill, long chunk: one kernel
    with aot.targeting(90):
        knobs.nvidia.dump_ptxas_log = False
        if jit:
            knobs.runtime.jit_cache_hook = None
        try:
            launch()
        except AttributeError as exc:  # the stand-in driver has no launcher
            assert jit and "launcher" in str(exc), exc
    entries.append(sorted((k, sorted(os.listdir(os.path.join(d, k)))) for k in os.listdir(d)))
print(entries[0] == entries[1] and len(entries[0]) > 0, entries[0])
"""
    proc = _run("-c", script, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("True"), proc.stdout[-2000:]


def test_an_unknown_capability_is_a_problem_not_a_pass():
    """sm_75 is not in the table: no limit to hold the kernel to, so the report cannot say it fits."""
    report = KernelReport("k", "v", 75, 4, 32, 0, 0, 0, 1 << 20)
    (problem,) = report.problems()
    assert "sm_75" in problem and "80, 86, 87, 89, 90, 100, 120" in problem and "SMEM_PER_BLOCK" in problem


def test_registers_are_counted_the_way_the_hardware_allocates_them():
    # 102 registers x 20 warps is 65,280 as written, but each warp is given 104 x 32 (whole 256-register units):
    # 66,560 > the 65,536 of the register file.
    rounded = KernelReport("k", "v", 90, 20, 102, 0, 0, 0, 0)
    assert any("registers" in p and "66560" in p for p in rounded.problems()), rounded.problems()
    # 176 x 10 warps is 56,320 (whole units already), but the hardware's check spreads a block's warps over
    # the SM's 4 sub-partitions alike: 12 warps x 5,632 = 67,584.
    partitions = KernelReport("k", "v", 90, 10, 176, 0, 0, 0, 0)
    assert any("registers" in p for p in partitions.problems()), partitions.problems()
    assert KernelReport("k", "v", 90, 16, 121, 0, 0, 0, 0).problems() == []  # 128 per thread: exactly 65,536
    assert KernelReport("k", "v", 90, 16, 129, 0, 0, 0, 0).problems() != []
    assert any("255" in p for p in KernelReport("k", "v", 90, 1, 256, 0, 0, 0, 0).problems())
    assert any("more than 1024" in p for p in KernelReport("k", "v", 90, 64, 16, 0, 0, 0, 0).problems())
