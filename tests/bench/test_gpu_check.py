"""``make gpu-check`` on a host without a GPU, and the parts of it that can be checked here: what it installs,
which tests it runs, the report it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kiln_bench import gpu_check

ROOT = Path(__file__).resolve().parents[2]


def test_without_a_cuda_device_it_says_so_in_one_line_and_exits_0():
    proc = subprocess.run([sys.executable, "-P", str(ROOT / "bench" / "gpu_check.py")], capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("gpu-check: no CUDA device (") and proc.stdout.count("\n") == 1


def test_it_runs_every_test_file_that_has_gpu_tests():
    mark = "pytest.mark." + "gpu"  # not spelled out: this file would match
    marked = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py") if mark in p.read_text()}
    assert marked and marked <= set(gpu_check.GPU_TESTS)
    assert all((ROOT / f).is_file() for f in gpu_check.GPU_TESTS)


def test_it_installs_kilns_needs_but_never_torch_or_triton():
    reqs = gpu_check.requirements()
    names = {r.split(">")[0].split("=")[0].split("<")[0] for r in reqs}
    assert {"transformers", "safetensors", "tokenizers", "llguidance", "fastapi", "pytest", "setuptools"} <= names
    assert not names & {"torch", "triton", "numpy", "kiln"}


def test_the_report_is_markdown_and_json(tmp_path):
    doc = {"date": "2026-11-25", "device": {"name": "NVIDIA H100 80GB HBM3", "capability": "9.0", "memory_gib": 79.1,
                                             "torch": "2.11.0", "cuda": "13.0", "triton": "3.6.0"},
           "steps": {"tests": {"rc": 0, "seconds": 12.5, "output": "3 passed", "figures": {"counts": {"passed": 3}}}}}
    path = gpu_check.report(tmp_path, doc)
    assert json.loads((tmp_path / "report.json").read_text()) == doc
    text = path.read_text()
    assert "NVIDIA H100 80GB HBM3 (sm_90, 79.1 GiB)" in text and "| tests | 0 | 12.5 |" in text
    assert gpu_check._pytest_counts("1 failed, 3 passed, 2 skipped\nFAILED tests/x.py::t - boom") == {
        "counts": {"failed": 1, "passed": 3, "skipped": 2}, "failed": ["tests/x.py::t"]}


def test_the_report_keeps_each_steps_whole_output_beside_it(tmp_path):
    long = "\n".join(f"line {i}: paged decode 64x1k 2500 GB/s" if i == 10 else f"line {i}" for i in range(4000))
    doc = {"date": "2026-11-30", "device": {"name": "H200", "capability": "9.0"},
           "steps": {"tests": {"rc": 1, "seconds": 1.0, "output": long, "figures": {}}}}
    gpu_check.report(tmp_path, doc)
    assert (tmp_path / "tests.log").read_text() == long  # the figures early in a long output survive
    assert json.loads((tmp_path / "report.json").read_text())["steps"]["tests"]["output"] == long[-12000:]


def test_its_venv_sees_the_packages_of_a_machine_python_that_is_itself_a_venv(tmp_path, monkeypatch):
    """The H200 machines' torch lives in /opt/torch/.venv: ``--system-site-packages`` from there reaches only
    the base interpreter's site-packages, so kiln's venv lists that venv's own in a .pth."""
    machine = tmp_path / "machine"
    subprocess.run([sys.executable, "-P", "-m", "venv", "--without-pip", str(machine)], check=True, timeout=120)
    machine_py = str(machine / "bin" / "python")
    site = subprocess.run([machine_py, "-P", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "machine_only_pkg.py").write_text("WHERE = 'machine'\n")
    monkeypatch.setattr(gpu_check, "VENV", tmp_path / "kiln-venv")
    subprocess.run([machine_py, "-P", "-m", "venv", "--without-pip", "--system-site-packages",
                    str(gpu_check.VENV)], check=True, timeout=120)
    seen = [str(gpu_check.VENV / "bin" / "python"), "-P", "-c", "import machine_only_pkg as m; print(m.WHERE)"]
    assert subprocess.run(seen, capture_output=True, text=True).returncode != 0  # the gap the .pth closes
    gpu_check._see_machine_packages(machine_py)
    assert subprocess.run(seen, capture_output=True, text=True, check=True).stdout.strip() == "machine"
