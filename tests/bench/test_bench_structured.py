"""`kiln bench --structured`: one interleaved run of the same batch free and half JSON-schema constrained."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(300)
def test_structured_bench_prints_both_throughputs(tmp_path):
    out = tmp_path / "structured.json"
    proc = subprocess.run([sys.executable, "-m", "kiln", "bench", "--structured", "--quick", "--repeats", "2",
                           "--threads", "1", "--model-dir", "model", "--json", str(out)],
                          capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "all free" in proc.stdout and "half JSON-schema" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["batch"] == 32 and {len(v) for v in doc["runs"].values()} == {2}
    assert all(v > 0 for v in doc["median_tok_s"].values())
    # Interleaved: the log shows the two batches alternating, ABBA.
    order = [line.split(": ")[1].split(" ", 2)[2] for line in proc.stderr.splitlines()
             if line.startswith("structured: repeat")]
    assert order == ["free", "half constrained", "half constrained", "free"]
