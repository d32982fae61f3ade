"""`kiln serve` usage errors (exit 2) and load failures (exit 1, one clear line, no traceback)."""

from __future__ import annotations

import subprocess
import sys

from click.testing import CliRunner
from kiln.serving.cli import serve


def test_needs_exactly_one_source(tmp_path):
    runner = CliRunner()
    for args in ([], ["--model", str(tmp_path), "--artifact", "file:///x/engines/tiny-0123456789ab"]):
        result = runner.invoke(serve, args)
        assert result.exit_code == 2
        assert "exactly one of --model DIR or --artifact URI" in result.output


def test_missing_model_dir_and_empty_key_file_are_usage_errors(tmp_path):
    runner = CliRunner()
    result = runner.invoke(serve, ["--model", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "does not exist" in result.output
    key = tmp_path / "key"
    key.write_text("\n")
    result = runner.invoke(serve, ["--model", str(tmp_path), "--api-key-file", str(key)])
    assert result.exit_code == 2 and "--api-key-file" in result.output and "empty" in result.output


def test_missing_artifact_exits_1_with_a_clear_message(tmp_path):
    uri = f"file://{tmp_path}/store/engines/tiny-0123456789ab"
    proc = subprocess.run([sys.executable, "-m", "kiln", "serve", "--artifact", uri, "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "could not load the model" in proc.stderr and "tiny-0123456789ab" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_engine_setting_exits_1_naming_it(model_dir):
    proc = subprocess.run([sys.executable, "-m", "kiln", "serve", "--model", str(model_dir), "--port", "0",
                           "--max-seq-len", "99999"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1, proc.stderr
    assert "max_seq_len" in proc.stderr and "Traceback" not in proc.stderr
