"""Kernels compiled at build time: the record in ``engine.json``, the shipped cache, the seeded autotuner.

A CUDA build runs every kernel shape the engine meets (:func:`warm_up`, which ``kiln bench`` also runs before
its clock on a GPU) with ``TRITON_CACHE_DIR`` pointed at a fresh directory (``kiln.builder.kernel_cache``), then
ships that directory in the artifact under
:data:`CACHE_DIR` and records under ``engine.json["kernels"]``:

- ``target``: what the compiled code is valid for (:func:`host_target`: Triton and torch versions,
  GPU name and compute capability);
- ``autotuned``: each autotuned kernel's choices, ``{kernel: [{"key": [...], "config": {...}}]}``:
  the Autotuner's own cache (``Autotuner.cache``: tuning key -> ``triton.Config``), per tuning key.

At load on a GPU (:func:`install_shipped`, called by ``artifact_engine_config`` before any kernel
compiles) the shipped cache is copied into a writable per-process directory and
``TRITON_CACHE_DIR`` points at it, so Triton's JIT finds every kernel compiled; each process that
runs kernels (every rank, :func:`seed_from_environment` in the model runner) puts the recorded
configs into the Autotuners' caches, so no key is benchmarked again. A host whose Triton version or
compute capability differs from ``target`` gets one warning naming what differs and compiles and
autotunes at first use, as without a shipped cache. CPU builds pack nothing (``packed: false`` with
the reason).

Triton's cache index files (``__grp__*.json``) name their members by absolute path; the artifact
stores them relative to the cache root (:func:`relocate_groups`) and the install makes them
absolute again under the new directory.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger("kiln.engine.kernels.cache")

RECORD_KEY = "kernels"  # engine.json
CACHE_DIR = "kernels/triton-cache"  # in the artifact
SEED_ENV = "KILN_KERNEL_CONFIGS"  # a JSON file of recorded configs, read by every rank's model runner
_SEED_FILE = "kiln-autotuned.json"
_GROUP_PREFIX = "__grp__"


def autotuned_kernels() -> dict[str, Any]:
    """The engine's autotuned kernels by record name (each a ``triton.runtime.Autotuner``)."""
    from kiln.engine.kernels import int8_gemm  # deferred: imports triton (GPU only)

    return {"int8_weight_only": int8_gemm._tuned_kernel, "int8_weight_only_f32": int8_gemm._tuned_kernel_f32}


def config_to_dict(config) -> dict[str, Any]:
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
            "num_ctas": config.num_ctas, "maxnreg": config.maxnreg}


def config_from_dict(doc: dict[str, Any]):
    import triton  # deferred: an optional dependency (kiln[gpu])

    return triton.Config(**doc)


def record_autotuned(kernels: dict[str, Any] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Every tuning key each Autotuner has settled in this process, with the config it chose."""
    kernels = autotuned_kernels() if kernels is None else kernels
    return {name: [{"key": list(key), "config": config_to_dict(cfg)} for key, cfg in tuner.cache.items()]
            for name, tuner in kernels.items()}


def seed_autotuned(record: dict[str, list[dict[str, Any]]], kernels: dict[str, Any] | None = None) -> int:
    """Put recorded configs into the Autotuners' caches (keys already tuned here are kept); returns how many."""
    kernels = autotuned_kernels() if kernels is None else kernels
    seeded = 0
    for name, entries in record.items():
        tuner = kernels.get(name)
        if tuner is None:
            log.warning("engine.json kernels.autotuned names %r, which this runtime does not have; ignored", name)
            continue
        for entry in entries:
            key = tuple(entry["key"])
            if key not in tuner.cache:
                tuner.cache[key] = config_from_dict(entry["config"])
                seeded += 1
    return seeded


def host_target() -> dict[str, Any]:
    """What compiled Triton code depends on here (versions, GPU); ``None`` fields where absent."""
    import torch  # deferred: keeps this module torch-free (the build pipeline imports it: kernel_cache.py)

    try:
        import triton  # deferred: an optional dependency (kiln[gpu])
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = torch.cuda.is_available()
    major, minor = torch.cuda.get_device_capability() if cuda else (None, None)
    return {"triton_version": triton_version, "torch_version": torch.__version__,
            "gpu_name": torch.cuda.get_device_name() if cuda else None,
            "compute_capability": f"{major}.{minor}" if cuda else None}


def target_differences(recorded: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """What makes a shipped cache unusable here: Triton version or compute capability (GPU name is
    informative only: same-capability parts run the same code)."""
    return [f"{field} {recorded.get(field)} at build, {here.get(field)} here"
            for field in ("triton_version", "compute_capability") if recorded.get(field) != here.get(field)]


def relocate_groups(cache_root: Path, to_absolute: bool) -> int:
    """Rewrite every ``__grp__*.json`` under ``cache_root`` to name its members relative to the root
    (``to_absolute=False``, for the artifact) or absolutely under it (for Triton); returns files rewritten.

    Triton writes a group and its members through one cache manager, so they share one ``<key>/``
    directory: a member's place is that directory and its file name, wherever the cache was written.
    """
    root = cache_root.resolve()
    count = 0
    for group in root.glob(f"*/{_GROUP_PREFIX}*.json"):
        doc = json.loads(group.read_text())
        paths = {}
        for child, path in (doc.get("child_paths") or {}).items():
            rel = Path(group.parent.name) / Path(path).name
            if not (root / rel).is_file():
                raise ValueError(f"{group}: member {path} is not in the cache's {group.parent.name}/")
            paths[child] = str(root / rel) if to_absolute else rel.as_posix()
        group.write_text(json.dumps({**doc, "child_paths": paths}))
        count += 1
    return count


# Host code a Triton cache holds beside the GPU kernels (the launcher and driver-utility modules it builds
# with the host's C compiler): never shipped and never installed from an artifact; each host builds its own.
HOST_CODE_SUFFIXES = (".so", ".dylib", ".dll", ".pyd")


def copy_cache(src: Path, dest: Path) -> tuple[int, int]:
    """Copy the regular files of a Triton cache (no locks, temp dirs, links or host code: the launchers are
    rebuilt on the host that runs them); returns (files, bytes)."""
    files = size = 0
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src)
        if p.is_symlink() or not p.is_file() or p.name == "lock" or any(s.startswith("tmp.") for s in rel.parts):
            continue
        if p.suffix in HOST_CODE_SUFFIXES:
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, dest / rel)
        files, size = files + 1, size + p.stat().st_size
    return files, size


def install_shipped(artifact_dir: str | Path, doc: dict[str, Any], here: dict[str, Any] | None = None,
                    trusted: bool = False) -> Path | None:
    """Point ``TRITON_CACHE_DIR`` at a private copy of the artifact's kernel cache when it fits this host
    and the artifact is ``trusted`` (its signature was verified: compiled kernels are code).

    Returns that directory, or ``None`` (nothing shipped, not trusted, or built for another target: logged).
    """
    record = doc.get(RECORD_KEY) or {}
    if not record.get("packed") or record.get("device") == "cpu":  # a CPU build's C kernels: native.py
        log.debug("no kernels shipped in %s: %s", artifact_dir, record.get("reason", "not recorded"))
        return None
    if not trusted:
        log.warning("shipped kernel cache not used: the artifact's signature was not verified (serve it with "
                    "--verify-key); Triton compiles and autotunes at first use")
        return None
    differs = target_differences(record.get("target") or {}, here or host_target())
    if differs:
        log.warning("shipped kernel cache not used (%s): Triton compiles and autotunes at first use",
                    "; ".join(differs))
        return None
    src = Path(artifact_dir) / record.get("path", CACHE_DIR)
    if not src.is_dir():
        log.warning("engine.json records a kernel cache at %s but the artifact lacks it: Triton compiles at "
                    "first use", src)
        return None
    dest = Path(tempfile.mkdtemp(prefix="kiln-triton-cache-"))
    atexit.register(shutil.rmtree, dest, True)
    copy_cache(src, dest)
    try:
        relocate_groups(dest, to_absolute=True)
    except ValueError as exc:  # a group names a file the artifact lacks: compile as if nothing shipped
        log.warning("shipped kernel cache not used (%s): Triton compiles and autotunes at first use", exc)
        shutil.rmtree(dest, ignore_errors=True)
        return None
    (dest / _SEED_FILE).write_text(json.dumps(record.get("autotuned") or {}))
    os.environ["TRITON_CACHE_DIR"] = str(dest)
    os.environ[SEED_ENV] = str(dest / _SEED_FILE)
    log.info("kernel cache from the build installed at %s (%s)", dest, record["target"].get("gpu_name"))
    return dest


def seed_from_environment() -> int:
    """Seed this process's Autotuners from :data:`SEED_ENV` (set by :func:`install_shipped`); 0 without it."""
    path = os.environ.get(SEED_ENV)
    if not path or not Path(path).is_file():
        return 0
    try:
        seeded = seed_autotuned(json.loads(Path(path).read_text()))
    except ImportError:  # no triton here: nothing autotunes either
        return 0
    log.info("autotuner seeded with %d recorded configs", seeded)
    return seeded


# -- the shapes a build compiles into the cache (kiln.builder.kernel_cache), and kiln bench warms on a GPU --------
def m_buckets() -> list[int]:
    """Every value of the int8 GEMM's M bucket (its autotuning key); imports triton."""
    from kiln.engine.kernels.int8_gemm import m_bucket

    return sorted({m_bucket(2**i) for i in range(16)})


def prompt_lengths(max_prompt: int) -> list[int]:
    """Prefill lengths that meet every int8-GEMM M bucket, specialized and not, up to ``max_prompt``."""
    lengths = {1}
    for b in m_buckets():
        lengths |= {n for n in (b - 1, b) if 1 <= n <= max_prompt}
    lengths.add(max_prompt)
    return sorted(lengths)


def decode_batches(config) -> list[int]:
    """Eager decode batch sizes to run (graphs capture their buckets at load): one per M bucket."""
    if not config.enforce_eager:
        return []
    return sorted({min(b, config.max_batch_size) for b in (1, *m_buckets())})


def warm_up(llm) -> dict[str, Any]:
    """Run through ``llm`` every shape its Triton kernels meet, so each is compiled (and autotuned) once: single
    prompts of 1 token and of each int8-GEMM M bucket and one token below it (Triton specializes integer arguments
    on ``== 1`` and divisibility by 16) up to ``max_num_tokens``, each twice (the second a prefix-cache hit: the
    prefill kernel over cached blocks), and with eager decode a batch at each bucket (graphs capture theirs at
    load). Returns what ran."""
    from kiln.engine import SamplingParams

    config = llm.engine_config
    max_prompt = max(1, min(config.max_num_tokens, config.max_input_len, config.max_seq_len - 2))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    lengths = prompt_lengths(max_prompt)
    for n in lengths:
        prompt = [3 + (i % 97) for i in range(n)]
        llm.generate([prompt], params)
        llm.generate([prompt], params)  # a prefix hit where caching is on
    batches = decode_batches(config)
    for b in batches:
        llm.generate([[5 + i, 7, 11] for i in range(b)], SamplingParams(temperature=0.0, max_tokens=4,
                                                                          ignore_eos=True))
    return {"prompt_lengths": lengths, "eager_decode_batches": batches}
