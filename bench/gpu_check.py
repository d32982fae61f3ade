"""``make gpu-check``: everything kiln can only learn on a GPU, in one command, into one report.

A GPU is lent to this project now and then, for at most 30 minutes, on a machine with its own torch and
triton and no network. So this runs with the standard library until it knows there is a CUDA device, then:

1. installs kiln into ``.kiln-work/gpu-venv``, a venv over the machine's own site-packages (its torch and
   triton are used as they are, never replaced), from the wheels ``make gpu-wheels`` put in
   ``.kiln-work/gpu-wheels`` (carried with the checkout), or from the index where there is a network;
2. runs the steps below, each bounded, each recorded whatever the others do;
3. writes ``report.md`` and ``report.json`` into ``--out`` and prints the path.

On a host without a CUDA device it prints one line saying so and exits 0. ``--only`` runs some steps (split
the work across two device calls of under 10 minutes if one does not fit).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".kiln-work" / "gpu-venv"
WHEELS = ROOT / ".kiln-work" / "gpu-wheels"
# What the steps import beyond kiln's own extras (the test runner and what the GPU tests use).
TEST_PACKAGES = ["pytest>=8", "pytest-asyncio>=0.23", "pytest-timeout>=2.3", "psutil>=5.9", "jsonschema>=4",
                 "hypothesis>=6.100", "httpx>=0.27"]
# Left to the machine (a CUDA torch brings them, and they are the largest wheels: the carried set must stay
# under the device tool's 64 MiB): torch and triton always; numpy; boto3 (s3:// stores only, imported lazily).
MACHINE_OWN = re.compile(r"^(torch|triton|kiln|numpy|boto3)\b")
GPU_TESTS = ["tests/engine/test_gpu.py", "tests/engine/test_gpu_equality.py", "tests/engine/test_paged_kernels.py",
             "tests/engine/test_quant_kernels.py", "tests/engine/test_kernel_cache.py", "tests/builder/test_tune.py"]
PROBE = """
import json, torch
info = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(), "cuda": torch.version.cuda}
if info["cuda_available"]:
    p = torch.cuda.get_device_properties(0)
    info.update(name=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                devices=torch.cuda.device_count())
try:
    import triton
    info["triton"] = triton.__version__
except ImportError:
    info["triton"] = None
print(json.dumps(info))
"""


def requirements() -> list[str]:
    """What the steps need installed besides kiln (``make gpu-wheels`` downloads them): kiln's requirements
    less ``MACHINE_OWN``, the test runner, and the build backend an offline editable install needs."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    reqs = [*project["dependencies"], *(r for extra in ("engine", "serve", "build") for r in extras[extra]),
            *TEST_PACKAGES, *tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]]
    return sorted({r for r in reqs if not MACHINE_OWN.match(r)})


def probe(python: str) -> dict:
    """What torch in ``python`` sees; ``{"error": ...}`` where torch does not import."""
    try:
        out = subprocess.run([python, "-P", "-c", PROBE], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": str(exc)}
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["torch does not import"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(argv: list[str], timeout: int, env: dict | None = None) -> dict:
    """One bounded command: exit code, seconds, the tail of its output."""
    t0 = time.monotonic()
    try:
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = 124, f"{exc.stdout or ''}{exc.stderr or ''}\n(timed out after {timeout}s)"
        out = out if isinstance(out, str) else out.decode(errors="replace")
    return {"rc": rc, "seconds": round(time.monotonic() - t0, 1), "output": out}


SITE = "import json, site, sysconfig; print(json.dumps([*site.getsitepackages(), sysconfig.get_path('purelib')]))"


def _see_machine_packages(python: str) -> None:
    """``--system-site-packages`` reaches the base interpreter's site-packages only; where the machine's
    torch lives in a venv of its own (``/opt/torch/.venv``), a ``.pth`` in ours lists that venv's too."""
    theirs = json.loads(subprocess.run([python, "-P", "-c", SITE], capture_output=True, text=True,
                                       check=True).stdout.strip().splitlines()[-1])
    ours = subprocess.run([str(VENV / "bin" / "python"), "-P", "-c", "import sysconfig; print(sysconfig.get_path("
                           "'purelib'))"], capture_output=True, text=True, check=True).stdout.strip()
    Path(ours, "zz_machine_site.pth").write_text("\n".join(dict.fromkeys(theirs)) + "\n")


def install(python: str) -> dict:
    """kiln into a venv that sees the machine's torch and triton; nothing of theirs is replaced."""
    if not (VENV / "bin" / "python").exists():
        made = run([python, "-P", "-m", "venv", "--system-site-packages", str(VENV)], 300)
        if made["rc"]:
            return made
        _see_machine_packages(python)
    pip = [str(VENV / "bin" / "python"), "-P", "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    offline = ["--no-index", "--find-links", str(WHEELS)] if WHEELS.is_dir() else []
    result = {"rc": 0, "seconds": 0.0, "output": ""}
    for what in (["--no-deps", "-e", ".", "-e", "./bench"], requirements()):  # kiln itself, then its needs
        done = run(pip + offline + what, 600)
        if done["rc"] and offline:  # a wheel missing from the carried set: the index, where there is one
            done = {**run(pip + what, 600), "output": done["output"]}
        result = {"rc": done["rc"], "seconds": result["seconds"] + done["seconds"],
                  "output": result["output"] + done["output"]}
        if done["rc"]:
            break
    return result


def _pytest_counts(output: str) -> dict:
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", output)}
    return {"counts": counts, "failed": re.findall(r"^FAILED (\S+)", output, re.M)}


def steps(py: str, out: Path, cap: str) -> dict[str, tuple[list[str], int, dict, Callable[[str], dict]]]:
    """name -> (argv, timeout s, env, figures from the output)."""
    def bandwidth(o: str) -> dict:
        return {**_pytest_counts(o), "decode": re.findall(r"paged decode .*GB/s", o),
                "cold_start": re.findall(r"cold start .*", o), "linears": re.findall(r"^(?:int8|fp8) M=.*", o, re.M)}

    def aot(o: str) -> dict:
        return {"problems": re.findall(r"^PROBLEM .*", o, re.M)}

    def gpu_profile(o: str) -> dict:
        path = out / "profile.json"
        return {"gpu_busy": json.loads(path.read_text()).get("gpu_busy")} if path.is_file() else {}

    def bench(o: str) -> dict:
        path = out / "bench.json"
        if not path.is_file():
            return {}
        doc = json.loads(path.read_text())
        return {k: doc.get(k) for k in ("systems", "ratios", "equality", "ceiling", "failed")}

    return {
        "tests": ([py, "-P", "-m", "pytest", "-q", "-rfEs", "-s", "-p", "no:cacheprovider", "-m", "gpu or kernels",
                   "--timeout", "300", *GPU_TESTS], 420, {}, bandwidth),
        "aot": ([py, "-P", "-m", "kiln.builder.kernels_aot", "--capabilities", cap.replace(".", ""), "--check"],
                300, {"KILN_AOT_CACHE": str(out / "aot-cache")}, aot),
        "profile": ([str(VENV / "bin" / "kiln"), "bench", "--profile", "--device", "cuda", "--dtype", "bfloat16",
                     "--json", str(out / "profile.json")], 300, {}, gpu_profile),
        "bench": ([str(VENV / "bin" / "kiln"), "bench", "--device", "cuda", "--dtype", "bfloat16", "--repeats", "1",
                   "--num-requests", "32", "--json", str(out / "bench.json")], 300, {}, bench),
    }


def report(out: Path, doc: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for name, r in doc["steps"].items():  # each step's whole output; the report keeps the tails
        (out / f"{name}.log").write_text(r["output"])
    tails = {**doc, "steps": {n: {**r, "output": r["output"][-12000:]} for n, r in doc["steps"].items()}}
    (out / "report.json").write_text(json.dumps(tails, indent=1))
    dev = doc["device"]
    lines = [f"# kiln gpu-check, {doc['date']}", "",
             f"{dev.get('name')} (sm_{dev.get('capability', '?').replace('.', '')}, {dev.get('memory_gib')} GiB), "
             f"torch {dev.get('torch')}, CUDA {dev.get('cuda')}, triton {dev.get('triton')}", "",
             "| step | exit | seconds | figures |", "|---|---|---|---|"]
    for name, r in doc["steps"].items():
        figures = json.dumps(r.get("figures", {}))[:400].replace("|", "/")
        lines.append(f"| {name} | {r['rc']} | {r['seconds']} | {figures} |")
    for name, r in doc["steps"].items():
        lines += ["", f"## {name} (exit {r['rc']})", "", "```", r["output"][-4000:].strip(), "```"]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return out / "report.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / ".kiln-work" / "gpu-check"), help="where the report goes")
    parser.add_argument("--only", default="", help="comma-separated steps (tests, aot, profile, bench); default: all")
    parser.add_argument("--requirements", action="store_true", help="print what make gpu-wheels downloads")
    args = parser.parse_args(argv)
    if args.requirements:
        print("\n".join(requirements()))
        return 0
    device = probe(sys.executable)
    if not device.get("cuda_available"):
        why = device.get("error") or f"torch {device.get('torch')} sees no GPU"
        print(f"gpu-check: no CUDA device ({why}); nothing to check here. On a machine with a GPU, "
              f"`make gpu-check` runs the GPU tests, kernels and bench and writes a report.")
        return 0
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    doc = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "device": device, "steps": {}}
    print(f"gpu-check: {device['name']} (compute capability {device['capability']}), torch {device['torch']}, "
          f"triton {device['triton']}; installing kiln over them", flush=True)
    doc["steps"]["install"] = {**install(sys.executable), "figures": {"wheels": WHEELS.is_dir()}}
    if doc["steps"]["install"]["rc"] == 0:
        py = str(VENV / "bin" / "python")
        chosen = {s for s in args.only.split(",") if s}
        for name, (cmd, timeout, env, figures) in steps(py, out, device["capability"]).items():
            if chosen and name not in chosen:
                continue
            print(f"gpu-check: {name} ...", flush=True)
            result = run(cmd, timeout, env)
            doc["steps"][name] = {**result, "figures": figures(result["output"])}
            print(f"gpu-check: {name} exit {result['rc']} in {result['seconds']}s", flush=True)
            report(out, doc)  # after every step: a call cut off at the device's limit keeps what it ran
    path = report(out, doc)
    print(f"gpu-check: report {path} (and report.json beside it)")
    return 0 if all(r["rc"] == 0 for r in doc["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
