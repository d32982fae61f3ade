"""The build's tactics stage: the table is measured on the build host, shipped in the artifact and in the
report, used as is where the host matches, re-timed (and cached, and said) where it does not, refused
where it is corrupt."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from kiln.builder.report import summary_lines
from kiln.engine import LLM, ConfigError, SamplingParams
from kiln.engine.tactics import host_signature
from kiln.engine.tactics.bind import STACK_MARGIN


@pytest.fixture(scope="module")
def built(tmp_path_factory, toy_model) -> Path:
    """One CPU build of the tiny model (bf16 where kiln's bf16 GEMM runs, else float32), unpacked."""
    import torch
    import yaml
    from builder_helpers import manifest_dict
    from click.testing import CliRunner
    from kiln.builder.cli import build
    from kiln.engine.kernels import native
    from kiln.engine.kernels.candidates import why_not

    tmp = tmp_path_factory.mktemp("tactics-build")
    dtype = "bfloat16" if why_not("kiln-fma", torch.bfloat16, native.kernels()) is None else "float32"
    manifest = tmp / "m.yaml"
    manifest.write_text(yaml.safe_dump(manifest_dict(f"file://{toy_model('llama-tiny')}", dtype=dtype)))
    store = tmp / "store"
    result = CliRunner().invoke(build, ["-f", str(manifest), "--store", f"file://{store}", "--work-dir",
                                        str(tmp / "work")], catch_exceptions=False,
                                env={"KILN_TERMINATION_LOG": str(tmp / "term")})
    assert result.exit_code == 0, result.output
    (artifact,) = (store / "engines").iterdir()
    return artifact


def _copy(artifact: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(artifact, dest)
    return dest


def test_the_build_ships_the_table_and_reports_it(built):
    doc = json.loads((built / "engine.json").read_text())
    record = doc["build_report"]["tactics"]
    table = json.loads((built / "tactics.json").read_text())
    assert record["timed"] and record["host"] == table["host"] == host_signature.cpu_signature()
    assert {r["shape"] for r in record["rows"] if r["op"] == "linear"} == {e["key"] for e in table["linear"]}
    assert "attention" in table["model"] and all("us" in v for v in table["model"].values())
    # The stack against the modules is timed where the stack was bound: every layer's linears in kiln's layout
    # within STACK_MARGIN of the best (on an AVX2 host ATen may win them all, and there is nothing to time).
    assert "decoder_stack" in table["model"] or any(
        "kiln" not in e["scores"] or e["scores"]["kiln"] > STACK_MARGIN * min(e["scores"].values())
        for e in table["linear"])
    assert "tactics" in doc["build_report"]["stage_seconds"]
    lines = summary_lines(doc["build_report"])
    start = next(i for i, line in enumerate(lines) if line.startswith("  tactics ("))
    assert any("rows 1" in line for line in lines[start + 1:])  # one line per shape, which kernel runs what
    manifest = json.loads((built / "manifest.json").read_text())
    assert "tactics.json" in json.dumps(manifest)  # published with the checksums like every file


def test_a_matching_host_uses_the_table_without_timing(built, tmp_path, monkeypatch):
    from kiln.engine.tactics import resolve

    monkeypatch.setattr(resolve, "measure", lambda *a, **k: pytest.fail("timed on a matching host"))
    llm = LLM.from_artifact(_copy(built, tmp_path / "engine"), num_kv_blocks=32)
    assert llm.engine.config.tactics_info["source"] == "artifact"
    assert llm.generate([[3, 7, 9]], SamplingParams(temperature=0, max_tokens=3))[0].token_ids


def test_another_host_kind_retimes_caches_and_says_so(built, tmp_path, monkeypatch, caplog):
    from kiln.engine.tactics import resolve

    real = host_signature.cpu_signature
    monkeypatch.setattr(host_signature, "cpu_signature", lambda threads=None, **k: {**real(threads, **k), "model": "Another CPU 9000"})
    timed = []
    measure = resolve.measure
    monkeypatch.setattr(resolve, "measure", lambda *a, **k: timed.append(1) or measure(*a, **k))
    copy = _copy(built, tmp_path / "engine")
    with caplog.at_level(logging.WARNING, logger="kiln.engine.tactics"):
        llm = LLM.from_artifact(copy, num_kv_blocks=32)
    info = llm.engine.config.tactics_info
    assert info["source"] == "re-timed" and timed == [1]
    assert any("model: " in d and "Another CPU 9000" in d for d in info["differs"])
    assert "re-timing its linears here" in caplog.text and "re-timed" in caplog.text
    cached = Path(info["table"])
    assert cached.parent == tmp_path / "engine.tactics" and cached.is_file()
    llm.shutdown()
    again = LLM.from_artifact(copy, num_kv_blocks=32)
    assert again.engine.config.tactics_info["source"] == "re-timed (cached)" and timed == [1]


def test_a_corrupt_table_is_refused_naming_it(built, tmp_path):
    copy = _copy(built, tmp_path / "engine")
    doc = json.loads((copy / "tactics.json").read_text())
    bucket = doc["linear"][0]["buckets"][0]
    bucket["runs"] = "onednn" if bucket["runs"] == "aten" else "aten"  # edited without its checksum
    (copy / "tactics.json").write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=r"tactic table .*tactics.json is refused: its sha256 does not match"):
        LLM.from_artifact(copy, num_kv_blocks=32)


def test_the_mlp_slice_is_timed_and_a_table_sets_it(toy_model, tmp_path):
    """A build times the MLP's prefill slice (each choice below maxNumTokens and the one holding it whole) end to
    end; an engine run by a table with that choice slices its MLP (module path and decoder stack alike) by it."""
    from types import SimpleNamespace

    from kiln.builder.stages.tactics import _mlp_rows
    from kiln.engine.models.llama import MLP_ROWS_CHOICES
    from kiln.engine.tactics.table import TacticTable

    model_dir = toy_model("llama-tiny")
    kwargs = dict(device="cpu", attention_backend="native", num_kv_blocks=160, max_num_tokens=1000, max_seq_len=1024)
    llm = LLM(str(model_dir), **kwargs)
    spec = SimpleNamespace(max_num_tokens=1000, max_input_len=1000)
    got = _mlp_rows(llm, spec, 1024)
    assert set(got["us"]) == {"256", "512", "1024"} and got["winner"] in MLP_ROWS_CHOICES  # 1024: unsliced
    table = TacticTable.from_json(json.loads(json.dumps(llm.engine.runner.tactics.to_json())))
    table.model.update(mlp_rows={"winner": 512, "us": {}}, decoder_stack={"winner": "fused"})
    path = table.save(tmp_path / "tactics.json")
    llm.shutdown()
    run = LLM(str(model_dir), tactics=str(path), **kwargs)
    model = run.engine.runner.model.model
    assert {layer.mlp.mlp_rows for layer in model.layers} == {512} and model.native_stack.shape.mlp_rows == 512
