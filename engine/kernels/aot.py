"""kiln's Triton kernels compiled ahead of time for a CUDA capability, on any machine (no GPU), with ptxas's
resource report: registers, spills, shared memory, and whether the launch fits the capability.

The interpreter (``TRITON_INTERPRET=1``) checks a kernel's arithmetic; it cannot tell whether the kernel
compiles for a real GPU, fits its shared memory, or spills. So the kernels' own launch wrappers run here on
small CPU tensors under a stand-in Triton driver whose current target is the capability asked for; Triton's
``jit_cache_hook`` hands each launch's signature, constexprs, options and attributes to ``triton.compile``,
which builds the PTX and cubin with the ptxas the triton wheel ships, and the launch itself is skipped. An
autotuned kernel compiles every one of its configurations. ptxas ``-v`` on the PTX gives registers and spill
bytes (the log of the very ptxas run that built the cubin), the compiled kernel's metadata its shared memory.

``kernels/aot_variants.py`` lists what is compiled (the envelopes' head sizes, GQA groups, block sizes and
dtypes); ``tests/engine/test_aot_compile.py`` holds every variant's ``KernelReport.problems`` to none on
every compute capability of the SKU table; ``python -m kiln.builder.kernels_aot`` prints the table
docs/gpu.md carries (the SKU table is kiln's core, which the engine does not import).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# Shared memory one block may use, opt-in maximum, by compute capability (CUDA C Programming Guide, "Technical
# Specifications per Compute Capability"): A100 163 KB; sm_86/89 (A10, L4, L40S) 99 KB; H100/H200 227 KB. Each is
# the SM's shared memory (164 / 100 / 228 KB) less the 1 KB the system reserves per block, so a block within it
# also fits one SM. A capability missing here is a problem (``KernelReport.problems``), never a pass.
SMEM_PER_BLOCK = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
# Registers (NVIDIA's occupancy calculator, cuda_occupancy.h, the same for every capability above): the SM's
# register file and a block's limit are 64K; registers are allocated per warp in units of 256 (a thread's count
# rounded up to a multiple of 8 for 32-thread warps); the hardware checks a block as though its warps were
# spread evenly over the SM's 4 sub-partitions (warp count rounded up to a multiple of 4).
REGS_PER_SM = 65536
REGS_PER_BLOCK = 65536
REG_ALLOC_UNIT = 256
SUB_PARTITIONS = 4
MAX_REGS_PER_THREAD = 255
MAX_THREADS_PER_BLOCK = 1024
WARP_SIZE = 32
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclass(frozen=True)
class KernelReport:
    """One compiled kernel: which launch (``variant``), for which capability, and what it needs."""

    kernel: str
    variant: str
    capability: int
    num_warps: int
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    shared: int  # bytes of shared memory per block

    def problems(self, spill_baseline: int | None = None) -> list[str]:
        """Why this kernel would fail or slow down on its capability (empty: it fits). ``spill_baseline`` None:
        the reviewed one for this kernel and the installed Triton (:func:`reviewed_spills`)."""
        spill_baseline = reviewed_spills(self.kernel) if spill_baseline is None else spill_baseline
        out = []
        limit = SMEM_PER_BLOCK.get(self.capability)
        if limit is None:
            known = ", ".join(str(c) for c in sorted(SMEM_PER_BLOCK))
            out.append(f"sm_{self.capability} is not in the AOT check's limits (known: {known}); check another "
                       f"capability or add its shared memory per block to kiln.engine.kernels.aot.SMEM_PER_BLOCK")
        elif self.shared > limit:
            out.append(f"needs {self.shared} B of shared memory, sm_{self.capability} allows {limit}")
        threads = WARP_SIZE * self.num_warps
        if threads > MAX_THREADS_PER_BLOCK:
            out.append(f"{threads} threads per block, more than {MAX_THREADS_PER_BLOCK}")
        if self.registers > MAX_REGS_PER_THREAD:
            out.append(f"{self.registers} registers per thread, more than {MAX_REGS_PER_THREAD}")
        elif (allocated := block_registers(self.registers, self.num_warps)) > min(REGS_PER_BLOCK, REGS_PER_SM):
            out.append(f"{self.registers} registers x {threads} threads do not fit one SM: allocated per warp in "
                       f"units of {REG_ALLOC_UNIT}, the block takes {allocated} of {REGS_PER_SM}")
        if self.spill_stores + self.spill_loads > spill_baseline:
            out.append(f"spills {self.spill_stores} B stores / {self.spill_loads} B loads "
                       f"(reviewed baseline {spill_baseline} B)")
        return out


# Reviewed spills per Triton minor version and kernel (bytes of stores + loads, the most any variant shows);
# anything above these, or in another kernel, is a problem. Triton 3.7 (PyPI's torch 2.13.0, the polyglot
# machines): 16 B in the float32 d128 prefill tiles at sm_80/89/90 (40 B at sm_89, chunk512) and 8 B in the
# bf16 int8 GEMM's BLOCK_K=128 config at sm_80, read from ptxas, not timed. Triton 3.6 (the H200 machines'
# torch 2.11, gpu-check 2026-11-30, sm_90): 12 B in the float32 d128 prefill tiles, and up to 1956 B in the
# float32 d128 decode tile of 64 keys, which was timed there against the 32-key tile the rule would otherwise
# pick (32 sequences x 2048 keys, 8 KV heads): 733 against 719 us at GQA group 1, 477 against 806 us at
# group 4 (the 32-key tile spills 80-200 B there too), so 64 stays.
SPILL_BASELINES = {"3.6": {"_prefill_kernel": 12, "_decode_split_kernel": 1956},
                   "3.7": {"_prefill_kernel": 40, "_int8_weight_only_kernel": 8}}


def reviewed_spills(kernel: str) -> int:
    """The spill bytes reviewed for ``kernel`` under the installed Triton (0 where none were)."""
    import triton

    return SPILL_BASELINES.get(".".join(triton.__version__.split(".")[:2]), {}).get(kernel, 0)


def block_registers(registers: int, num_warps: int) -> int:
    """The registers one block of ``num_warps`` warps is charged, the larger of the two checks in
    ``cudaOccMaxBlocksPerSMRegsLimit``: its warps' allocations (each warp's ``registers x 32`` rounded up to
    whole 256-register units) and the hardware's view of them spread over the SM's sub-partitions (the warp
    count rounded up to a multiple of 4)."""
    per_warp = -(-registers * WARP_SIZE // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    return per_warp * max(num_warps, -(-num_warps // SUB_PARTITIONS) * SUB_PARTITIONS)


def _target(capability: int):
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", capability, 32)


def _stand_in_driver(capability: int):
    from triton.backends.driver import DriverBase

    class AOTDriver(DriverBase):
        """Triton's driver interface with nothing behind it but a target: launches compile, never run."""

        target = _target(capability)

        @classmethod
        def is_active(cls):
            return False

        def map_python_to_cpp_type(self, ty):
            return ty

        def get_current_target(self):
            return self.target

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            raise RuntimeError("ahead-of-time compilation times nothing")

        def get_current_device(self):
            return f"kiln-aot-sm{capability}"  # its own JIT caches per target

        def get_current_stream(self, device=None):
            return 0

        def get_device_interface(self):
            return torch.cpu

    return AOTDriver()


@contextlib.contextmanager
def targeting(capability: int) -> Iterator[list]:
    """Inside, every Triton launch compiles for ``capability`` (into Triton's cache, ``TRITON_CACHE_DIR``) and
    returns without running; yields the list that collects (kernel name, autotune configuration or "", compiled
    kernel, ptxas -v log) for each. The log is empty where Triton's cache already held the kernel (no ptxas ran)."""
    import triton
    from triton import knobs
    from triton.compiler import ASTSource
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.driver import driver

    compiled: list = []
    target = _target(capability)
    config_label = [""]  # the autotune configuration being compiled, for the report

    def hook(key, repr, fn, compile, is_manual_warmup, already_compiled):
        options = {k: compile[k] for k in ("num_warps", "num_ctas", "num_stages", "enable_fp_fusion",
                                           "launch_cooperative_grid", "extern_libs")}
        src = ASTSource(fn.jit_function, compile["signature"], compile["constants"], compile["configs"][0])
        log = io.StringIO()
        with contextlib.redirect_stdout(log):  # triton's own ptxas -v run prints here (dump_ptxas_log)
            kernel = triton.compile(src, target=target, options=options)
        compiled.append((fn.name, config_label[0], kernel, log.getvalue()))
        return True  # compiled here: the JIT neither compiles nor launches

    def every_config(self, *args, **kwargs):  # what the autotuner would time, each compiled
        self.nargs = dict(zip(self.arg_names, args, strict=False))
        for config in self.prune_configs(kwargs):
            config_label[0] = " ".join(f"{k}={v}" for k, v in config.kwargs.items()) + \
                f" warps={config.num_warps} stages={config.num_stages}"
            self.fn.run(*args, **{**kwargs, **config.all_kwargs()})
        config_label[0] = ""

    previous = driver._active, knobs.runtime.jit_cache_hook, Autotuner.run, knobs.nvidia.dump_ptxas_log
    driver.set_active(_stand_in_driver(capability))
    knobs.runtime.jit_cache_hook, Autotuner.run, knobs.nvidia.dump_ptxas_log = hook, every_config, True
    try:
        yield compiled
    finally:
        driver._active, knobs.runtime.jit_cache_hook, Autotuner.run, knobs.nvidia.dump_ptxas_log = previous


def ptxas_report(name: str, log: str) -> tuple[int, int, int, int]:
    """(registers, spill store bytes, spill load bytes, stack bytes) from the ptxas -v log of the cubin
    Triton built (its own flags: -lineinfo, --regAllocOptLevel=2, ...)."""
    regs, spills = _PTXAS_REGS.search(log), _PTXAS_SPILLS.search(log)
    if not regs or not spills:
        raise RuntimeError(f"ptxas -v printed no resource line for {name} (a Triton cache hit? compile into "
                           f"an empty TRITON_CACHE_DIR): {log.strip()[-300:]!r}")
    return int(regs.group(1)), int(spills.group(2)), int(spills.group(3)), int(spills.group(1))


_SEEN: dict[str, tuple[int, int, int, int]] = {}  # Triton cache key -> ptxas_report, in this process


def compile_variant(capability: int, variant: str, launch: Callable[[], None]) -> list[KernelReport]:
    """Every kernel ``launch`` starts, compiled for ``capability``, with its resources. A kernel another variant
    of this process compiled already (the same constexprs: the decode combine at another GQA group, a long
    chunk whose tile is the short one's) comes from Triton's cache without a ptxas run and is reported with
    that compile's figures, so the reports do not depend on how variants are shared among workers."""
    with targeting(capability) as compiled:
        launch()
    reports = []
    for name, config, kernel, log in compiled:
        if log:
            _SEEN[kernel.hash] = ptxas_report(name, log)
        elif kernel.hash not in _SEEN:  # from a Triton cache this process did not fill: no ptxas log to read
            raise RuntimeError(f"{name} came from Triton's cache ({os.environ.get('TRITON_CACHE_DIR')}) without a "
                               "ptxas log: compile into an empty TRITON_CACHE_DIR")
        regs, stores, loads, stack = _SEEN[kernel.hash]  # another variant with the same constexprs compiled it
        reports.append(KernelReport(name, f"{variant} [{config}]" if config else variant, capability,
                                    kernel.metadata.num_warps, regs, stores, loads, stack, kernel.metadata.shared))
    return reports


def source_key() -> str:
    """What the reports depend on: the kernels' sources, the variants, triton's version."""
    import triton

    here = Path(__file__).parent
    h = hashlib.sha256(triton.__version__.encode())
    for path in sorted(here.glob("*.py")):
        if path.name not in ("native.py", "packed.py", "isa.py", "cpu_library.py", "candidates.py",
                             "quant_linear.py", "__init__.py"):
            h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:16]


def _compile_share(capability: int, share: int, shares: int, quick: bool = False) -> list[KernelReport]:
    """Every ``shares``-th variant of ``capability``, from the ``share``-th: one worker's part."""
    from kiln.engine.kernels.aot_variants import variants

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the JIT's default; set so triton says nothing
    with tempfile.TemporaryDirectory(prefix="kiln-aot-") as cache:  # empty: ptxas runs for every kernel
        os.environ["TRITON_CACHE_DIR"] = cache
        return [r for variant, launch in variants(capability, quick)[share::shares]
                for r in compile_variant(capability, variant, launch)]


def compile_all(capabilities: list[int], cache_dir: Path | None = None, quick: bool = False) -> list[KernelReport]:
    """Every variant on every capability (``quick``: the make-test set, ``aot_variants``), compiled by one
    worker process per CPU (triton's front end holds the GIL; ``KILN_AOT_WORKERS`` sets another count);
    cached on disk by ``source_key``, so a cache hit compiles nothing."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    cache_dir = Path(cache_dir or os.environ.get("KILN_AOT_CACHE") or Path.home() / ".cache" / "kiln" / "aot")
    path = cache_dir / f"reports-{source_key()}-{'-'.join(map(str, sorted(capabilities)))}{'-quick' * quick}.json"
    if path.is_file():
        return [KernelReport(**r) for r in json.loads(path.read_text())]
    workers = int(os.environ.get("KILN_AOT_WORKERS") or 0) or max(1, min(len(os.sched_getaffinity(0)), 8))
    jobs = [(cap, share, workers, quick) for cap in capabilities for share in range(workers)]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        parts = list(pool.map(_compile_share, *zip(*jobs, strict=True)))
    reports = [r for part in parts for r in part]
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([asdict(r) for r in reports], indent=0))
    os.replace(tmp, path)
    return reports


CAPABILITY_COLUMNS = "sm_{cap}: regs / smem KiB / spill B"


def table(reports: list[KernelReport]) -> str:
    """The markdown table docs/gpu.md carries: per kernel and variant family, per capability, the most
    registers and shared memory any of its variants needs and the spill bytes they add up to."""
    caps = sorted({r.capability for r in reports})
    rows: dict[str, dict[int, list[KernelReport]]] = {}
    for r in reports:
        family = re.sub(r" g\d+| \[.*\]", "", r.variant)  # one row for GQA groups 1, 4, 8 and for the configs
        rows.setdefault(f"{r.kernel.strip('_')} | {family}", {}).setdefault(r.capability, []).append(r)
    head = "| kernel | variant | " + " | ".join(CAPABILITY_COLUMNS.format(cap=c) for c in caps) + " |"
    lines = [head, "|" + "---|" * (2 + len(caps))]
    for name, by_cap in sorted(rows.items()):
        cells = []
        for cap in caps:
            rs = by_cap.get(cap, [])
            cells.append("-" if not rs else f"{max(r.registers for r in rs)} / {max(r.shared for r in rs) / 1024:.1f}"
                         f" / {sum(r.spill_stores + r.spill_loads for r in rs)}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
