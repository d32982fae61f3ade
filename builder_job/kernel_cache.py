"""Compile and autotune the engine's Triton kernels on the build GPU, and pack the cache into the artifact.

On CUDA, after tuning fixed the serving config, a fresh process (so nothing compiled earlier in the
build is served from memory instead of being written) loads the staged artifact as a serving pod
would, with ``TRITON_CACHE_DIR`` pointed at an empty build-local directory, and runs every shape the
engine meets: loading captures the CUDA graphs (every decode batch bucket), then single prompts of
1 token and of each int8-GEMM M bucket and one token below it (Triton specializes integer arguments
on ``== 1`` and divisibility by 16) up to ``max_num_tokens``, each twice (the second a prefix-cache
hit: the prefill kernel over cached blocks), and with eager decode a batch at each bucket. It
reports the Autotuners' choices and the host target (:mod:`kiln.engine.kernels.cache`); the builder
copies the cache's files into the artifact under ``CACHE_DIR`` (group index files made relative) and
returns the ``engine.json["kernels"]`` record. A CPU build compiles kiln's C kernels instead
(:func:`kiln.engine.kernels.cpu_library.build_for_artifact`): one library per ISA level, under ``kernels/cpu/``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kiln.builder.errors import BuildError
from kiln.engine.kernels.cache import CACHE_DIR, copy_cache, relocate_groups, warm_up

log = logging.getLogger("kiln.build.kernels")

WARM_UP_TIMEOUT_S = 3600


def pack(cache_dir: Path, artifact_dir: Path) -> dict[str, int]:
    """Copy a Triton cache into ``artifact_dir/CACHE_DIR`` (regular files only, groups made relative)."""
    dest = artifact_dir / CACHE_DIR
    if dest.exists():
        shutil.rmtree(dest)
    files, size = copy_cache(cache_dir, dest)
    groups = relocate_groups(dest, to_absolute=False)
    return {"num_files": files, "bytes": size, "num_kernels": groups}


def build_kernel_cache(artifact_dir: Path, device: str, work_dir: Path, load_kwargs: dict[str, Any]
                       ) -> dict[str, Any]:
    """The ``engine.json["kernels"]`` record; on CUDA compiles, autotunes and packs (see module doc)."""
    if device != "cuda":  # kiln's C kernels, compiled for every ISA level of this architecture
        from kiln.engine.kernels.cpu_library import build_for_artifact

        record = build_for_artifact(artifact_dir)
        log.info("kernels: %s", f"CPU kernels for {', '.join(record['libraries'])}" if record["packed"]
                 else record["reason"])
        return record
    try:
        import triton  # noqa: F401
    except ImportError:
        return {"packed": False, "reason": "triton is not installed in the build image: kernels compile at "
                                           "first use on the serving GPU"}
    cache_dir = work_dir / "triton-cache"
    shutil.rmtree(cache_dir, ignore_errors=True)
    cache_dir.mkdir(parents=True)
    result_path = work_dir / "kernel-warm-up.json"
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache_dir)}
    cmd = [sys.executable, "-P", "-m", "kiln.builder.kernel_cache", str(artifact_dir), str(result_path),
           json.dumps(load_kwargs)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=WARM_UP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise BuildError(f"compiling the engine's kernels on this GPU took over {WARM_UP_TIMEOUT_S}s "
                         f"(the kernels stage's warm-up): a bug or a stuck GPU, not the spec") from None
    if proc.returncode != 0:  # the serving pod would fail the same way: not a spec problem
        raise BuildError(f"compiling the engine's kernels on this GPU failed (exit {proc.returncode}): "
                         f"{proc.stderr.strip()[-1500:]}")
    result = json.loads(result_path.read_text())
    packed = pack(cache_dir, artifact_dir)
    log.info("kernels: %d compiled (%d files, %.1f MiB) in %.0fs, %d autotuned keys", packed["num_kernels"],
             packed["num_files"], packed["bytes"] / 2**20, time.perf_counter() - t0,
             sum(len(v) for v in result["autotuned"].values()))
    return {"packed": True, "path": CACHE_DIR, "target": result["target"], "autotuned": result["autotuned"],
            **packed, "warm_up": result["warm_up"], "warm_up_seconds": result["seconds"]}


def _main(artifact_dir: str, result_path: str, load_kwargs: str) -> None:
    from kiln.engine import LLM
    from kiln.engine.kernels.cache import host_target, record_autotuned

    t0 = time.perf_counter()
    # The build's own staged output, warmed up to fill the cache it ships.
    llm = LLM.from_artifact(artifact_dir, device="cuda", trust_shipped_code=True, **json.loads(load_kwargs))
    try:
        ran = warm_up(llm)
    finally:
        llm.shutdown()
    Path(result_path).write_text(json.dumps({"autotuned": record_autotuned(), "target": host_target(),
                                             "warm_up": ran, "seconds": round(time.perf_counter() - t0, 2)}))


if __name__ == "__main__":
    _main(*sys.argv[1:4])
