"""`kiln bench --speculative`: off / on (load rule) / always, rotated, same greedy tokens, side by side."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(300)
def test_speculative_bench_prints_with_and_without(tmp_path):
    out = tmp_path / "speculative.json"
    proc = subprocess.run([sys.executable, "-m", "kiln", "bench", "--speculative", "--quick", "--repeats", "2",
                           "--threads", "1", "--dtype", "float32", "--model-dir", "model", "--json", str(out)],
                          capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "off tok/s" in proc.stdout and "always tok/s" in proc.stdout
    doc = json.loads(out.read_text())
    assert set(doc["batches"]) == {"1", "4"}
    for res in doc["batches"].values():
        assert {len(v) for v in res["runs"].values()} == {2}
        assert all(v > 0 for v in res["median_tok_s"].values())
    # The load rule (off above 4 running) let batch 1 speculate; the random toy model accepts some drafts.
    assert doc["batches"]["1"]["acceptance_rate"]["on"] > 0
    assert doc["batches"]["1"]["acceptance_rate"]["off"] is None
    # Rotated: each engine leads one round.
    firsts = [line.split(": ")[1].split()[-1] for line in proc.stderr.splitlines()
              if line.startswith("speculative: batch 1 repeat")][::3]
    assert firsts == ["on", "always"]


def test_speculative_bench_with_a_draft_model(toy_model, tmp_path):
    """--draft-layers N: the model's first N layers as the draft (written once beside it), same tokens."""
    from kiln.engine.random_checkpoint import make_random_model
    from kiln_bench.speculative import draft_for, run, text

    model_dir = make_random_model(tmp_path / "model", "llama-tiny", num_hidden_layers=3)
    draft = draft_for(model_dir, None, 1)
    assert draft == tmp_path / "model-draft-1" and draft_for(model_dir, None, 1) == draft
    assert draft_for(model_dir, model_dir, None) == model_dir and draft_for(model_dir, None, None) is None
    doc = run(model_dir, "float32", 1, "cpu", batches=(1,), max_tokens=12, repeats=1, log=lambda _: None,
              draft_dir=draft)
    assert doc["draft_dir"] == str(draft)
    res = doc["batches"]["1"]
    assert res["acceptance_rate"]["always"] is not None and all(v > 0 for v in res["median_tok_s"].values())
    assert text(doc).startswith("draft-model (model-draft-1) speculation")
