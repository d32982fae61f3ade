"""Compile the model's dense part with Inductor for this CPU, and ship the result in the artifact.

``EngineConfig.compile="inductor"`` (CPU, one rank) runs each step's forward pass (embedding,
projections, MLP, norms, rotary, LM head) as one ``torch.compile``'d graph with dynamic token
counts: frozen weights (``freezing``: Inductor prepacks every linear for oneDNN, the same kernels
``layers/linear.pack_model`` uses eagerly) and C++/OpenMP code for the pointwise work between the
GEMMs. The paged attention stays one opaque custom op per layer (``kiln::paged_attention``,
``layers/attention.py``; piecewise, as vLLM compiles), fed by the step's attention metadata as
eagerly. The weights are not in the graph's code; the compiled kernels are.

A build compiles on the target host into :data:`CACHE_DIR` of the artifact (Inductor's cache
directory: its FX graph cache and the compiled C++ kernels, a few MB); ``engine.json`` records it
under ``tuning.compile`` with the vector ISA the kernels were built for, the CPU flags that ISA
needs, the torch version and the thread count. At load (:func:`shipped_compile`,
:func:`use_shipped_cache`) a copy of it becomes the process's Inductor cache, so compiling is
dynamo's trace, freezing and cache hits, no C++ compiler run. A host that lacks one of those flags
(the kernels would die on an illegal instruction), or runs another torch or thread count (a cache
miss: minutes of compiling at load), runs eager, with one warning. Measured figures: docs/cpu-compile.md.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from kiln.engine.layers.attention import Attention, bind_layers

log = logging.getLogger("kiln.engine.compile")

COMPILE_MODES = ("off", "inductor")
CACHE_DIR = "compile/inductor-cache"  # in the artifact
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"  # Inductor reads it on every cache access
# CPU flags (``/proc/cpuinfo``) each Inductor vector ISA's kernels execute; see torch/_inductor/cpu_vec_isa.py.
_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma")
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "avx2": ("avx2", "fma"),
    "avx512": _AVX512,
    "amx": (*_AVX512, "amx_tile", "amx_bf16", "amx_int8"),
    "asimd": ("asimd",),
    "sve256": ("sve",),
}


def check_compile(mode: str, device: str, world_size: int) -> str | None:
    """Why ``compile=mode`` cannot run here (one line naming the field), or None."""
    if mode not in COMPILE_MODES:
        return f"compile must be one of {', '.join(COMPILE_MODES)}, got {mode!r}"
    if mode != "off" and device != "cpu":
        return f"compile {mode!r} is for the CPU target (GPUs replay CUDA graphs): use compile='off' on {device}"
    if mode != "off" and world_size != 1:
        return (f"compile {mode!r} compiles one whole model: tensor_parallel_size x pipeline_parallel_size must be 1, "
                f"got {world_size}; use compile='off'")
    return None


def vec_isa() -> str:
    """The vector ISA Inductor generates C++ for on this host ("" when none)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return str(pick_vec_isa())


def compile_record(cache_file: str = CACHE_DIR) -> dict[str, Any]:
    """``engine.json``'s ``tuning.compile`` for a cache compiled on this host. Inductor's C++ kernels are
    specialized on the torch thread count too (a cache made at another count misses)."""
    isa = vec_isa()
    return {"backend": "inductor", "cache": cache_file, "vec_isa": isa, "cpu_flags": sorted(ISA_FLAGS.get(isa, ())),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def missing_requirements(record: dict[str, Any], threads: int | None = None) -> list[str]:
    """What this host lacks to run a shipped compile: CPU flags, the torch version it was made with,
    or (when ``threads`` is known) the thread count its kernels were compiled for."""
    from kiln.engine import cpu_target

    host = cpu_target.cpu_flags()
    missing = [f"CPU flag {f}" for f in record.get("cpu_flags") or [] if f not in host]
    if record.get("torch") != torch.__version__:
        missing.append(f"torch {record.get('torch')} (this host runs {torch.__version__})")
    if threads is not None and record.get("threads") not in (None, threads):
        missing.append(f"{record['threads']} torch threads (this host runs {threads})")
    return missing


def shipped_compile(root: Path, doc: dict[str, Any], kwargs: dict[str, Any], trusted: bool = False) -> None:
    """Point an artifact's engine kwargs at its shipped compile (``tuning.compile``), or turn compiling
    off with one warning when this host cannot use it: compiling here instead would take minutes
    (``artifact_engine_config`` calls this). The cache holds pickled graphs and compiled ``.so`` kernels,
    so it is used only from a ``trusted`` artifact (its signature verified); the path is always the
    artifact's :data:`CACHE_DIR`, never one ``engine.json`` names."""
    record = (doc.get("tuning") or {}).get("compile")
    if kwargs.get("compile", "off") == "off" or not record or kwargs.get("compile_cache"):
        return
    if not trusted:
        log.warning("artifact %s ships a compiled model but its signature was not verified (serve it with "
                    "--verify-key): its Inductor cache is code, not loaded; running eager (compile='off')", root)
        kwargs["compile"] = "off"
        return
    missing = missing_requirements(record, (kwargs.get("cpu_target") or {}).get("threads"))
    if missing:
        log.warning("artifact %s was compiled for %s; this host lacks %s: running eager (compile='off')",
                    root, record.get("vec_isa") or "another CPU", ", ".join(missing))
        kwargs["compile"] = "off"
        return
    cache = root / CACHE_DIR
    if cache.is_dir() and not cache.is_symlink():
        kwargs["compile_cache"] = str(cache)


def compile_into(cache_dir: str | Path) -> None:
    """Make ``cache_dir`` this process's Inductor cache (what a build ships: graphs and C++ kernels)."""
    os.environ[CACHE_ENV] = str(Path(cache_dir).resolve())


def use_shipped_cache(shipped: str | Path) -> Path:
    """Seed a private, writable Inductor cache with an artifact's shipped one (the artifact may be
    read-only; Inductor writes locks there) and make it this process's; returns its path."""
    private = Path(tempfile.mkdtemp(prefix="kiln-inductor-"))
    shutil.copytree(shipped, private, dirs_exist_ok=True, ignore=shutil.ignore_patterns("locks"))
    atexit.register(shutil.rmtree, private, True)
    compile_into(private)
    log.info("Inductor cache seeded from %s", shipped)
    return private


class CompiledModel:
    """``model``'s forward pass and LM head as one compiled graph: (input ids, positions, logits rows) -> logits."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.fn = torch.compile(self._forward, dynamic=True, fullgraph=True)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor):
        return self.model.compute_logits(self.model(input_ids, positions)[logits_indices])

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor):
        bind_layers(self.layers)
        # Freezing set around the call, where Inductor compiles: passed as torch.compile(options=...) it
        # never reaches the weight-packing passes (measured: no linear packed, 0.6x eager at 4 rows).
        with torch._inductor.config.patch(freezing=True):
            if logits_indices.shape[0] == 0:  # a step of mid-prompt chunks only: one throwaway row, not a 4th graph
                return self.fn(input_ids, positions, logits_indices.new_zeros(1))[:0]
            return self.fn(input_ids, positions, logits_indices)


def warm_up(runner: Any) -> float:
    """Compile every graph a step can need by running synthetic steps that write only the pool's spare
    block; returns the seconds taken. Dynamo gives sizes 1 graphs of their own, so three: decodes with
    a prefill chunk (distinct token and logits counts, so no guard ties them), a prefill sampling one
    row, one decode. Freezing packs each graph's weights for the token count of its first call, so
    the first two run ``max_batch_size`` rows (the count eager packing uses, ``pack_model``)."""
    from kiln.engine.step_inputs import StepInputs

    spare, bs = runner.num_blocks, runner.block_size  # the block the block manager never hands out
    rows = max(2, runner.config.max_batch_size)
    prompt = max(2, min(rows, runner.config.max_seq_len))  # positions stay inside the rotary table
    start = time.perf_counter()
    for num_decodes, prefill_len, logits in ((rows, 2, list(range(rows))), (0, prompt, [prompt - 1]), (1, 0, [0])):
        positions = torch.tensor([0] * num_decodes + list(range(prefill_len)))
        table = torch.full((max(num_decodes, 1), 1), spare, dtype=torch.long)
        inputs = StepInputs(
            input_ids=torch.zeros(len(positions), dtype=torch.long), positions=positions,
            slot_mapping=spare * bs + positions % bs, num_decodes=num_decodes, decode_block_tables=table[:num_decodes],
            decode_ctx_lens=torch.ones(num_decodes, dtype=torch.long),
            prefills=[(num_decodes, prefill_len, prefill_len, table[0])] if prefill_len else [],
            logits_indices=torch.tensor(logits))
        runner.execute(inputs)
    return time.perf_counter() - start
