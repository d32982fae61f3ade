"""Peer baselines in `kiln bench` run in their own interpreter with a runner that imports no kiln."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

from click.testing import CliRunner
from kiln.engine.bench import peers, suite
from kiln.engine.bench.records import RunRecord


def test_peer_runners_import_nothing_of_kiln():
    for name in peers.PEERS:
        tree = ast.parse(peers.script_of(name).read_text())
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not any(m and m.split(".")[0] == "kiln" for m in modules), (name, modules)


def test_a_peer_system_runs_its_own_interpreter_and_script(tmp_path, monkeypatch):
    fake = tmp_path / "peer_fake.py"
    fake.write_text(
        "import json, sys\n"
        "job = json.load(open(sys.argv[1]))\n"
        "json.dump({'system': 'openvino', 'duration_s': 1.0, 'num_steps': 1, 'requests': [{'index': 0,"
        " 'arrival': 0.0, 'first_token': 0.5, 'finished': 1.0, 'output_token_ids': [7]}],"
        " 'notes': [job['peer_model_dir']]}, open(sys.argv[2], 'w'))\n")
    monkeypatch.setattr(peers, "python_of", lambda name, root=None: Path(sys.executable))
    monkeypatch.setattr(peers, "script_of", lambda name: fake)
    job = {"system": "openvino", "threads": 1, "peer_model_dir": "/models/x-ov"}
    run = suite.run_child(job, tmp_path, timeout=60)
    assert isinstance(run, RunRecord) and run.requests[0].output_token_ids == [7]
    assert run.notes == ["/models/x-ov"]
    assert json.loads((tmp_path / "job-openvino.json").read_text())["peer_model_dir"] == "/models/x-ov"


def test_unknown_baseline_is_a_usage_error():
    from kiln.engine.bench.cli import bench

    result = CliRunner().invoke(bench, ["--baselines", "tgi", "--quick"])
    assert result.exit_code == 2 and "--baselines: unknown tgi" in result.output
