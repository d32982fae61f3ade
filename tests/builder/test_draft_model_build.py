"""A build with ``spec.speculative.method: draft_model``: the draft is fetched, checked, converted into the
artifact's ``draft/`` folder and planned into the KV pool; the stage's table is measured with it; the engine
loaded from the artifact runs it with greedy output unchanged. A draft of another tokenizer fails the build
with the field named and publishes nothing.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from builder_helpers import manifest_dict
from click.testing import CliRunner
from kiln.builder.cli import build
from kiln.engine import LLM, SamplingParams
from kiln.engine.random_checkpoint import make_random_model, make_truncated_draft


def _build(tmp: Path, target: Path, draft: Path) -> tuple[int, str, Path]:
    manifest = tmp / "m.yaml"
    manifest.write_text(yaml.safe_dump(manifest_dict(
        f"file://{target}", maxBatchSize=2, maxNumTokens=128,
        speculative={"method": "draft_model", "numSpeculativeTokens": 3, "draftModel": {"source": f"file://{draft}"}})))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_SPECULATIVE_BUDGET_S", "4")
        mp.setenv("KILN_TACTICS_BUDGET_S", "2")
        result = CliRunner().invoke(build, ["-f", str(manifest), "--store", f"file://{tmp / 'store'}",
                                            "--work-dir", str(tmp / "work")], catch_exceptions=False,
                                    env={"KILN_TERMINATION_LOG": str(tmp / "term")})
    term = tmp / "term"
    return result.exit_code, result.output + (term.read_text() if term.exists() else ""), tmp / "store"


@pytest.fixture(scope="module")
def built(tmp_path_factory, toy_model) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("draft-build")
    target = toy_model("llama-tiny")
    code, output, store = _build(tmp, target, make_truncated_draft(target, tmp / "draft", 1))
    assert code == 0, output
    (artifact,) = (store / "engines").iterdir()
    return artifact, target


def test_the_artifact_carries_the_draft_and_its_table(built):
    artifact, _ = built
    doc = json.loads((artifact / "engine.json").read_text())
    config = doc["engine_config"]["speculative_config"]
    assert (config["method"], config["model"], config["num_speculative_tokens"]) == ("draft_model", "draft", 3)
    assert (artifact / "draft" / "weights" / "rank-0-of-1.safetensors").is_file()
    assert json.loads((artifact / "draft" / "config.json").read_text())["num_hidden_layers"] == 1
    record = doc["tuning"]["speculative"]
    assert record["greedy_equal"] and record["batches"]["1"]["measured"], record
    assert record["batches"]["1"]["acceptance_rate"], record  # the draft's drafts were verified
    # The pool is planned for both models: the target's 2 layers and the draft's 1 per token.
    target_only = 2 * 2 * 2 * 16 * 4  # K and V x layers x KV heads x head dim x float32
    assert doc["kv_plan"]["kv_bytes_per_token"] == target_only * 3 // 2


def test_the_engine_runs_the_shipped_draft_with_output_unchanged(built, tmp_path):
    artifact, _ = built
    dest = tmp_path / "engine"
    shutil.copytree(artifact, dest)
    prompts = [[1, *([5 + i, 40, 77, 9 + 2 * i, 300] * 6)] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM.from_artifact(dest, num_kv_blocks=64, speculative_config=None).generate(prompts, params)
    llm = LLM.from_artifact(dest, num_kv_blocks=64, speculative_config={
        "method": "draft_model", "model": "draft", "num_speculative_tokens": 3})
    assert Path(llm.engine.draft.model_dir) == dest / "draft"
    assert llm.engine.draft.config.weights_dir == str(dest / "draft" / "weights")
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
    assert llm.stats().spec_num_draft_tokens > 0


def test_a_draft_of_another_tokenizer_fails_the_build(tmp_path, toy_model):
    other = make_random_model(tmp_path / "other", "llama-tiny", seed=7)
    code, output, store = _build(tmp_path, toy_model("llama-tiny"), other)
    assert code != 0
    assert "spec.speculative.draftModel" in output and "tokenizer" in output, output
    assert not (store / "engines").exists() or not any((store / "engines").iterdir())


def test_fetch_only_records_the_draft_for_the_prefetched_half(tmp_path, toy_model):
    from kiln.builder.errors import InvalidSpec
    from kiln.builder.prefetch import DRAFT_RECORD, fetch_only, load_fetched, load_fetched_draft

    from kiln.manifest import load_manifest

    target = toy_model("llama-tiny")
    draft = make_truncated_draft(target, tmp_path / "draft-src", 1)
    spec = {"method": "draft_model", "draftModel": {"source": f"file://{draft}", "revision": "v1"}}
    engine = load_manifest(manifest_dict(f"file://{target}", speculative=spec))
    fetch_only(engine, tmp_path / "work")
    assert load_fetched(engine, tmp_path / "work").path == target.resolve()
    assert load_fetched_draft(engine, tmp_path / "work").path == draft.resolve()
    assert json.loads((tmp_path / "work" / DRAFT_RECORD).read_text())["revision"] == "v1"
    bumped = load_manifest(manifest_dict(f"file://{target}", speculative={
        **spec, "draftModel": {**spec["draftModel"], "revision": "v2"}}))
    with pytest.raises(InvalidSpec, match="spec.speculative.draftModel is .*@v2"):
        load_fetched_draft(bumped, tmp_path / "work")
    assert load_fetched_draft(load_manifest(manifest_dict(f"file://{target}")), tmp_path / "work") is None
