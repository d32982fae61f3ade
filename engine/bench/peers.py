"""Peer engines as ``kiln bench`` baselines, each in its own virtual environment.

A peer's pins clash with kiln's (and with each other's), so each lives in
``<work>/baselines/<name>`` with its own interpreter, and its runner script imports
nothing of kiln (``peer_<name>.py`` next to this file: workload JSON in, a
``RunRecord``-shaped JSON out). ``ensure(name)`` creates the environment and converts
the model on first use; later benches reuse both.

- ``openvino``: OpenVINO GenAI's ``ContinuousBatchingPipeline``. The environment gets the
  CPU torch 2.13.0 first (``optimum-intel[openvino]`` would otherwise resolve a CUDA
  torch), then ``optimum-intel[openvino]`` and ``openvino-genai``; torchvision is removed
  (its wheel does not match the CPU torch and breaks transformers' imports). The model
  is exported with ``optimum-cli export openvino --weight-format fp32``.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

TORCH_PIN = "torch==2.13.0"


@dataclass(frozen=True)
class Peer:
    name: str
    packages: tuple[str, ...]
    remove: tuple[str, ...] = ()


PEERS = {
    "openvino": Peer("openvino", ("optimum-intel[openvino]", "openvino-genai"), remove=("torchvision",)),
}


def work_root() -> Path:
    """``.kiln-work/baselines`` of the repository (or of the current directory outside one)."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "pyproject.toml").is_file() and (parent / "engine").is_dir():
            return parent / ".kiln-work" / "baselines"
    return Path.cwd() / ".kiln-work" / "baselines"


def python_of(name: str, root: Path | None = None) -> Path:
    return (root or work_root()) / name / "bin" / "python"


def script_of(name: str) -> Path:
    return Path(__file__).with_name(f"peer_{name}.py")


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-10:])
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{tail}")


def ensure_env(name: str, say: Callable[[str], None] = print, root: Path | None = None) -> Path:
    """The peer's interpreter, after creating and installing its environment if needed."""
    peer = PEERS[name]
    root = root or work_root()
    python = python_of(name, root)
    stamp = root / name / ".kiln-peer-installed"
    if stamp.is_file():
        return python
    say(f"setting up the {name} baseline in {root / name} (first use; several minutes) ...")
    shutil.rmtree(root / name, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "venv", str(root / name)], f"creating the {name} environment")
    pip = [str(python), "-m", "pip", "install", "-q"]
    _run([*pip, "--upgrade", "pip"], "upgrading pip")
    _run([*pip, TORCH_PIN], f"installing {TORCH_PIN} (CPU) into the {name} environment")
    _run([*pip, *peer.packages, TORCH_PIN], f"installing {', '.join(peer.packages)}")
    if peer.remove:
        _run([str(python), "-m", "pip", "uninstall", "-y", "-q", *peer.remove], f"removing {', '.join(peer.remove)}")
    stamp.write_text("ok\n")
    return python


def _model_key(model_dir: Path) -> str:
    """Same checkpoint, same export: the directory's path, file names, sizes and mtimes."""
    h = hashlib.sha256(str(model_dir.resolve()).encode())
    for f in sorted(model_dir.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def ensure_model(name: str, model_dir: Path, dtype: str, say: Callable[[str], None] = print,
                 root: Path | None = None) -> Path:
    """The peer's converted copy of ``model_dir`` (exported once, then reused)."""
    root = root or work_root()
    out = root / "models" / f"{model_dir.name}-{_model_key(model_dir)}-{name}-{dtype}"
    if (out / ".kiln-exported").is_file():
        return out
    python = ensure_env(name, say, root)
    say(f"exporting {model_dir} for {name} into {out} ...")
    shutil.rmtree(out, ignore_errors=True)
    if name == "openvino":
        weight_format = {"float32": "fp32", "bfloat16": "fp16", "float16": "fp16"}[dtype]
        cli = python.with_name("optimum-cli")
        _run([str(cli), "export", "openvino", "--model", str(model_dir), "--task", "text-generation-with-past",
              "--weight-format", weight_format, str(out)], f"optimum-cli export openvino of {model_dir}")
    (out / ".kiln-exported").write_text("ok\n")
    return out
