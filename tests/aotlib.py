"""The ahead-of-time kernel check's compile, started in the background as soon as the check is collected.

tests/engine/test_aot_compile.py compiles ~290 GPU kernels: about two minutes of CPU when its cache is
cold. The suite keeps about one of the machine's two cores busy, so the compile runs beside it on one
worker (``KILN_AOT_WORKERS=1``) from collection on, and the check waits for it (``reports``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

AOT_TESTS = "tests/engine/test_aot_compile.py"
BACKGROUND = pytest.StashKey[tuple]()


def child_env() -> dict[str, str]:
    """Without ``TRITON_INTERPRET`` (kernel tests set it; interpreted kernels cannot be compiled)."""
    return {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")}


def start_if_collected(config, items) -> None:
    if not any(item.nodeid.startswith(AOT_TESTS) for item in items):
        return
    out = Path(config.rootpath) / ".kiln-work" / f"aot-reports-{os.getpid()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as stdout:
        proc = subprocess.Popen([sys.executable, "-P", "-m", "kiln.builder.kernels_aot", "--json"], stdout=stdout,
                                stderr=subprocess.PIPE, text=True, env={**child_env(), "KILN_AOT_WORKERS": "1"})
    config.stash[BACKGROUND] = (proc, out)


def reports(config) -> list[dict]:
    """Every kernel's report, as ``python -m kiln.builder.kernels_aot --json`` prints them."""
    proc, out = config.stash.get(BACKGROUND, (None, None))
    if proc is None:  # the check was not collected at the start (run by hand): compile here
        done = subprocess.run([sys.executable, "-P", "-m", "kiln.builder.kernels_aot", "--json"], env=child_env(),
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout)
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.read_text())


def stop(config) -> None:
    proc, out = config.stash.get(BACKGROUND, (None, None))
    if proc is not None:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
        out.unlink(missing_ok=True)
