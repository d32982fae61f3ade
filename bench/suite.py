"""One bench: every system on one workload, round-robin repeats, equality check, ceiling.

Systems run one at a time, each in a fresh subprocess (``child.py``), in a
rotating round-robin order so that a slow patch of a shared machine spreads
over all systems instead of landing on one; figures are per-figure medians
over the repeats.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from math import ceil
from pathlib import Path

from kiln.engine.kernels.isa import ISA_CAPS as ENGINE_ISA_CAPS
from kiln_bench import ceiling as ceiling_mod
from kiln_bench import peers
from kiln_bench.peers import PEERS
from kiln_bench.records import RunRecord, common_prefix_len, figures, median_figures
from kiln_bench.workload import Request, Workload

SYSTEMS = ("kiln", "hf-static-b8", "hf-static-b32", "hf-generate-batch")
# kiln with two pipeline stages (two rank processes over gloo/NCCL, --threads each), with two
# micro-batches in flight per step and without; and kiln with batch_invariant (one kernel per linear at every
# row count: what determinism costs): opt-in (--systems), not in the default run.
PIPELINE_SYSTEMS: dict[str, dict] = {
    "kiln-pp2": {"pipeline_parallel_size": 2, "num_micro_batches": 2},
    "kiln-pp2-nomb": {"pipeline_parallel_size": 2, "num_micro_batches": 1},
    "kiln-batch-invariant": {"batch_invariant": True},
}
ALL_SYSTEMS = SYSTEMS + tuple(PIPELINE_SYSTEMS)
# --max-isa: the environment that keeps each system's libraries at or below an ISA, so that one host runs
# what another kind would: oneDNN (torch's, vLLM's, OpenVINO's CPU plugin's), ATen's vectorized kernels,
# MKL and kiln's own kernels (kiln.engine.kernels.isa.ISA_CAPS). OpenVINO's release wheels read
# OV_CPU_MAX_ISA (its own kernels: paged attention, RMSNorm, rotary) only in debug builds, so there the
# cap reaches its oneDNN matmuls alone.
_OV_ISA = {"avx2": "AVX2", "avx512": "AVX512_CORE_VNNI", "avx512_bf16": "AVX512_CORE_BF16"}
ISA_CAPS: dict[str, dict[str, str]] = {name: {**env, "OV_CPU_MAX_ISA": _OV_ISA[name]}
                                       for name, env in ENGINE_ISA_CAPS.items()}


@dataclass
class SuiteConfig:
    model_dir: Path
    dtype: str
    threads: int
    systems: list[str]
    device: str = "cpu"
    repeats: int = 1
    max_batch_size: int = 64
    max_num_tokens: int = 2048
    check_requests: int = 8
    check_max_tokens: int = 32
    child_timeout_s: float = 3600.0
    ceiling_buffer_mib: int = 512
    partial_json: Path | None = None  # rewritten after every system run, so a killed bench keeps its runs
    peer_models: dict[str, str] = field(default_factory=dict)  # peer baseline -> its converted model (peers.py)
    log: object = field(default=None, repr=False)

    def say(self, msg: str) -> None:
        if self.log is not None:
            self.log(msg)


def kv_blocks_for(workload: Workload, block_size: int = 16) -> int:
    """Blocks that hold every request at once: kiln and transformers both get this capacity."""
    return sum(ceil((len(r.prompt_token_ids) + r.output_len) / block_size) for r in workload.requests) + 8


def _job(cfg: SuiteConfig, system: str, workload_path: Path, workload: Workload, dtype: str) -> dict:
    return {
        "system": system, "model_dir": str(cfg.model_dir), "workload": str(workload_path), "dtype": dtype,
        "threads": cfg.threads, "max_batch_size": cfg.max_batch_size, "max_num_tokens": cfg.max_num_tokens,
        "max_seq_len": None, "num_kv_blocks": kv_blocks_for(workload), "pad_id": 0, "device": cfg.device,
        "engine_extra": PIPELINE_SYSTEMS.get(system, {}),
        "peer_model_dir": cfg.peer_models.get(system),
    }


def snapshot_sources(dest: Path) -> Path:
    """Copy the ``kiln`` core and ``kiln.engine`` sources as they are now into ``dest``.

    Children import from this copy (PYTHONPATH comes before the editable install's
    finder), so every run of one bench measures the same code even while the
    working tree changes under it.
    """
    import kiln.engine

    import kiln

    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(Path(kiln.__file__).parent, dest / "kiln", ignore=ignore)
    shutil.rmtree(dest / "kiln" / "engine", ignore_errors=True)
    shutil.copytree(Path(kiln.engine.__file__).parent, dest / "kiln" / "engine", ignore=ignore)
    return dest


def run_child(job: dict, workdir: Path, timeout: float) -> RunRecord:
    job_path = workdir / f"job-{job['system']}.json"
    out_path = workdir / f"out-{job['system']}.json"
    out_path.unlink(missing_ok=True)
    job_path.write_text(json.dumps(job))
    # The thread count also goes in the environment: threads a system starts itself (transformers'
    # continuous-batching loop) then get the same OpenMP pool size as the main thread.
    env = {**os.environ, "OMP_NUM_THREADS": str(job["threads"]), "MKL_NUM_THREADS": str(job["threads"]),
           "TOKENIZERS_PARALLELISM": "false"}
    if job["system"] in PEERS:  # its own environment and runner script, nothing of kiln
        cmd = [str(peers.python_of(job["system"])), str(peers.script_of(job["system"])), str(job_path), str(out_path)]
    else:
        if (workdir / "src").is_dir():
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(workdir / "src"), env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", "kiln_bench.child", str(job_path), str(out_path)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env,
        cwd=workdir,  # not the repo root: `-m` puts the cwd first on sys.path, ahead of the snapshot
    )
    if proc.returncode != 0 or not out_path.is_file():
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"system {job['system']} failed (exit {proc.returncode}):\n{tail}")
    return RunRecord.from_json(json.loads(out_path.read_text()))


def check_subset(workload: Workload, n: int, max_tokens: int) -> Workload:
    reqs = [Request(i, r.prompt_token_ids, min(r.output_len, max_tokens), 0.0)
            for i, r in enumerate(workload.requests[:n])]
    return Workload(workload.spec, reqs)


def run_suite(cfg: SuiteConfig, workload: Workload, facts: dict) -> dict:
    prompt_lens = {r.index: len(r.prompt_token_ids) for r in workload.requests}
    output_lens = {r.index: r.output_len for r in workload.requests}
    per_system: dict[str, dict] = {s: {"runs": [], "notes": [], "extra": [], "failures": []} for s in cfg.systems}
    outputs: dict[str, dict[int, list[int]]] = {}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
        workdir = Path(tmp)
        snapshot_sources(workdir / "src")
        wl_path = workdir / "workload.json"
        workload.save(wl_path)
        for rep in range(cfg.repeats):
            shift = rep % len(cfg.systems)
            for system in cfg.systems[shift:] + cfg.systems[:shift]:
                cfg.say(f"[repeat {rep + 1}/{cfg.repeats}] {system} ...")
                t = time.perf_counter()
                try:
                    run = run_child(_job(cfg, system, wl_path, workload, cfg.dtype), workdir, cfg.child_timeout_s)
                except RuntimeError as exc:  # a peer that crashes here is a finding, not the end of the run
                    if system not in PEERS:
                        raise
                    per_system[system]["failures"].append(str(exc))
                    cfg.say(f"  {system}: {str(exc).splitlines()[0]}")
                    continue
                fig = figures(run, prompt_lens, output_lens)
                entry = per_system[system]
                entry["runs"].append(fig)
                entry["notes"] = run.notes
                entry["extra"].append({**run.extra, "load_s": run.load_s})
                outputs[system] = {r.index: r.output_token_ids for r in run.requests}
                cfg.say(f"  {system}: {fig['output_tok_s']:.1f} output tok/s, {fig['duration_s']:.1f}s "
                        f"(wall {time.perf_counter() - t:.0f}s incl. load)")
                if cfg.partial_json is not None:
                    cfg.partial_json.write_text(json.dumps({"partial": True, "systems": per_system}, indent=1))
        systems = {}
        failed = {name: entry["failures"] for name, entry in per_system.items() if not entry["runs"]}
        for name, entry in per_system.items():
            if entry["runs"]:
                systems[name] = {"median": median_figures(entry["runs"]), **entry}
        equality = _equality(cfg, workload, workdir) if "kiln" in cfg.systems and cfg.check_requests else None
    kiln = systems.get("kiln")
    ratios = {}
    if kiln:
        for name, entry in systems.items():
            if name != "kiln":
                ratios[name] = kiln["median"]["output_tok_s"] / entry["median"]["output_tok_s"]
    cfg.say("measuring the hardware ceiling ...")
    ceiling = _ceiling(cfg, workload, facts, systems)
    return {
        "systems": systems, "ratios": ratios, "equality": equality, "ceiling": ceiling,
        "agreement": _agreement(outputs), "failed": failed,
    }


def _equality(cfg: SuiteConfig, workload: Workload, workdir: Path) -> dict:
    """kiln's greedy tokens vs transformers ``generate`` one request at a time, both in float32.

    float32 because greedy equality across different kernels is only meaningful
    where rounding cannot flip a near-tie: in bf16 two correct implementations
    legitimately diverge after a few tokens on a random-weight model.
    """
    subset = check_subset(workload, cfg.check_requests, cfg.check_max_tokens)
    path = workdir / "check-workload.json"
    subset.save(path)
    cfg.say(f"equality check: kiln vs transformers generate, float32, {len(subset.requests)} requests ...")
    ref = run_child(_job(cfg, "hf-reference", path, subset, "float32"), workdir, cfg.child_timeout_s)
    got = run_child(_job(cfg, "kiln-reference", path, subset, "float32"), workdir, cfg.child_timeout_s)
    ref_ids = {r.index: r.output_token_ids for r in ref.requests}
    mismatches = []
    for r in got.requests:
        want = ref_ids[r.index]
        if r.output_token_ids != want:
            mismatches.append({"request": r.index, "first_diff_at": common_prefix_len(r.output_token_ids, want)})
    return {
        "dtype": "float32", "num_requests": len(subset.requests), "max_tokens": cfg.check_max_tokens,
        "passed": not mismatches, "mismatches": mismatches,
    }


def _agreement(outputs: dict[str, dict[int, list[int]]]) -> dict:
    """In the bench dtype: the share of each request's tokens, up to the first difference, that kiln
    has in common with each baseline. Informational (see ``_equality`` on why not pass/fail)."""
    kiln = outputs.get("kiln")
    if not kiln:
        return {}
    result = {}
    for name, other in outputs.items():
        if name == "kiln":
            continue
        same, total, identical = 0, 0, 0
        for idx, toks in kiln.items():
            ref = other.get(idx, [])
            same += common_prefix_len(toks, ref)
            total += len(ref)
            identical += toks == ref
        result[name] = {"prefix_token_share": same / total if total else 0.0, "identical_requests": identical,
                        "num_requests": len(kiln)}
    return result


def _ceiling(cfg: SuiteConfig, workload: Workload, facts: dict, systems: dict) -> dict:
    import torch

    torch.set_num_threads(cfg.threads)
    batches = [s["median"]["avg_batch"] for s in systems.values() if s["median"]["avg_batch"] > 0]
    hw = ceiling_mod.measure(facts, cfg.dtype, batches or [1], buffer_bytes=cfg.ceiling_buffer_mib * 2**20,
                             device=cfg.device)
    itemsize = torch.empty(0, dtype=getattr(torch, cfg.dtype)).element_size()
    # Mean context length seen by a decode token: prompt + tokens generated so far.
    ctx_sum = sum(len(r.prompt_token_ids) * r.output_len + r.output_len * (r.output_len - 1) / 2
                  for r in workload.requests)
    avg_context = ctx_sum / workload.num_output_tokens
    per_system = {}
    for name, s in systems.items():
        batch = s["median"]["avg_batch"]
        if not batch > 0:  # NaN: not observable
            continue
        c = ceiling_mod.workload_ceiling(hw, facts, itemsize, workload.num_prompt_tokens,
                                         workload.num_output_tokens, avg_context, batch)
        c["fraction"] = s["median"]["output_tok_s"] / c["output_tok_s"]
        per_system[name] = c
    return {"hardware": hw, "avg_decode_context": avg_context, "per_system": per_system}
