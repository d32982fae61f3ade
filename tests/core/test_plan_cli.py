"""`kiln plan` and `kiln crd` through click's runner, plus one real `kiln plan` process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml
from click.testing import CliRunner

from kiln.cli import cli
from kiln.crd import render_crd
from kiln.envelope import build_envelope, engine_version
from kiln.manifest import load_manifest

ROOT = Path(__file__).resolve().parents[2]
CPU = ROOT / "examples/cpu-small.yaml"
KILN = Path(sys.executable).with_name("kiln")


def run(*args: str, stdin: str | None = None):
    return CliRunner().invoke(cli, list(args), input=stdin, catch_exceptions=False)


def test_plan_prints_version_and_envelope():
    result = run("plan", "-f", str(CPU))
    assert result.exit_code == 0, result.output
    version = engine_version(load_manifest(CPU))
    assert f"engine version: {version}" in result.stdout
    listed = yaml.safe_load(result.stdout.split("change the engine version):\n", 1)[1])
    assert listed == build_envelope(load_manifest(CPU).spec)
    assert "warning" not in result.stderr  # file:// sources are labelled, not moving


def test_plan_json():
    result = run("plan", "-f", str(CPU), "--json")
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["engineVersion"] == engine_version(load_manifest(CPU))
    assert doc["envelope"] == build_envelope(load_manifest(CPU).spec)
    assert doc["engineVersion"].endswith("-" + doc["digest"])


def test_plan_reads_stdin():
    result = run("plan", "-f", "-", "--json", stdin=CPU.read_text())
    assert result.exit_code == 0 and json.loads(result.stdout)["engineVersion"] == engine_version(load_manifest(CPU))


def test_plan_warns_about_an_unpinned_hf_revision(tmp_path: Path):
    data = yaml.safe_load((ROOT / "examples/llama-3.1-8b-h100-fp8.yaml").read_text())
    data["spec"]["model"]["revision"] = "main"
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    result = run("plan", "-f", str(path))
    assert result.exit_code == 0 and "warning: spec.model.revision main can move" in result.stderr


def test_plan_rejects_an_invalid_manifest_with_exit_2(tmp_path: Path):
    data = yaml.safe_load(CPU.read_text())
    data["spec"].update(tensorParallel=3, maxInputLen=1024)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    result = run("plan", "-f", str(path))
    assert result.exit_code == 2
    assert result.stdout == ""
    assert f"invalid LLMEngine manifest {path}" in result.stderr
    assert "spec.tensorParallel: must be one of 1, 2, 4, 8 (got 3)" in result.stderr
    assert "Traceback" not in result.stderr


def test_plan_missing_file_and_bad_yaml(tmp_path: Path):
    missing = run("plan", "-f", str(tmp_path / "nope.yaml"))
    assert missing.exit_code == 2 and "check the path" in missing.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: LLMEngine\nspec:\n  model: source: x\n")
    result = run("plan", "-f", str(bad))
    assert result.exit_code == 2 and "line 3, column" in result.stderr


def test_plan_without_a_file_is_a_usage_error():
    assert CliRunner().invoke(cli, ["plan"]).exit_code == 2


def test_crd_to_stdout_and_file(tmp_path: Path):
    result = run("crd")
    assert result.exit_code == 0 and result.stdout == render_crd()
    out = tmp_path / "sub/crd.yaml"
    assert run("crd", "--out", str(out)).exit_code == 0
    assert out.read_text() == render_crd()


def test_real_kiln_plan_process(tmp_path: Path):
    ok = subprocess.run([str(KILN), "plan", "-f", str(CPU), "--json"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["engineVersion"] == engine_version(load_manifest(CPU))
    bad = tmp_path / "bad.yaml"
    bad.write_text(CPU.read_text().replace("maxSeqLen: 1024", "maxSeqLen: 512"))
    proc = subprocess.run([str(KILN), "plan", "-f", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "spec.maxInputLen: must be less than maxSeqLen (512 >= 512)" in proc.stderr
    assert "Traceback" not in proc.stderr
