"""The build's speculative stage: it times speculation per batch bucket, ships the table in engine.json and the
report, and the engine loaded from the artifact follows it (no drafts above the cut-off) with greedy output
unchanged.

The build runs on a clock that makes the toy model's cost a known shape (speculation 10x dearer above batch
2, 10x cheaper at or below it), so the table it must measure is known; the timing itself, the rounds, the
decision and the packaging are the real ones. (At 3x, a clean run beside two busy loops measured batch 1 off:
each setting keeps its best of two rounds or more, and a host that busy stretched every speculative round
of batch 1 past 3x.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from kiln.builder.report import summary_lines
from kiln.builder.stages import speculative as speculative_stage
from kiln.engine import LLM, SamplingParams

K = 4
SHAPE = 10.0  # how much dearer the clock makes the slower side of each bucket


@pytest.fixture(scope="module")
def built(tmp_path_factory, toy_model) -> Path:
    import yaml
    from builder_helpers import manifest_dict
    from click.testing import CliRunner
    from kiln.builder.cli import build

    real_run = speculative_stage._run

    def shaped_run(llm, prompts, setting, new_tokens):
        seconds, tokens, stats = real_run(llm, prompts, setting, new_tokens)
        slower = (setting is None) == (len(prompts) <= 2)  # off at small batches, on at larger ones
        return seconds * (SHAPE if slower else 1.0), tokens, stats

    tmp = tmp_path_factory.mktemp("speculative-build")
    manifest = tmp / "m.yaml"
    manifest.write_text(yaml.safe_dump(manifest_dict(
        f"file://{toy_model('llama-tiny')}", maxBatchSize=8, maxNumTokens=256,
        speculative={"method": "ngram", "numSpeculativeTokens": K})))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(speculative_stage, "_run", shaped_run)
        mp.setenv("KILN_SPECULATIVE_BUDGET_S", "8")
        mp.setenv("KILN_TACTICS_BUDGET_S", "2")
        result = CliRunner().invoke(build, ["-f", str(manifest), "--store", f"file://{tmp / 'store'}",
                                            "--work-dir", str(tmp / "work")], catch_exceptions=False,
                                    env={"KILN_TERMINATION_LOG": str(tmp / "term")})
    assert result.exit_code == 0, result.output
    (artifact,) = (tmp / "store" / "engines").iterdir()
    return artifact


def test_the_build_measures_and_ships_the_table(built):
    doc = json.loads((built / "engine.json").read_text())
    config = doc["engine_config"]["speculative_config"]
    assert config["by_batch"] == {"1": config["by_batch"]["1"], "2": config["by_batch"]["2"], "4": 0, "8": 0}
    assert config["by_batch"]["1"] in (2, K) and config["by_batch"]["2"] in (2, K)
    assert (config["method"], config["num_speculative_tokens"]) == ("ngram", K)
    record = doc["tuning"]["speculative"]
    assert record == doc["build_report"]["speculative"] and record["greedy_equal"]
    assert record["k_candidates"] == [2, K]
    for b, row in record["batches"].items():
        if row["measured"]:  # every setting timed, the fastest k kept where it gains MIN_GAIN
            assert set(row["tok_s"]) == {"off", "k2", f"k{K}"} and row["rounds"] >= speculative_stage.ROUNDS
            best = row["tok_s"][f"k{row['best_k']}"]
            assert best == max(row["tok_s"][f"k{k}"] for k in record["k_candidates"])
            gains = best >= row["tok_s"]["off"] * (1 + speculative_stage.MIN_GAIN)
            assert config["by_batch"][b] == (row["best_k"] if gains else 0)
        else:
            assert config["by_batch"][b] == 0
    assert record["batches"]["1"]["measured"]
    # Batch 4 is timed unless the stage's documented rules skip it: STOP_AFTER_OFF buckets in a row below it did
    # not pay (measured speedups: under load they may not), or its estimated rounds outrun the budget left.
    four = record["batches"]["4"]
    offs_below = sum(config["by_batch"][b] == 0 for b in ("1", "2"))
    if not four["measured"]:
        assert four["why"] == ("no gain below" if offs_below >= speculative_stage.STOP_AFTER_OFF else "budget"), four
    assert "speculative" in doc["build_report"]["stage_seconds"]
    lines = summary_lines(doc["build_report"])
    start = next(i for i, line in enumerate(lines) if line.startswith("  speculative (ngram"))
    assert "4: off, 8: off" in lines[start]
    assert lines[start + 1].split()[:2] == ["batch", "off"] and len(lines[start + 2:start + 6]) == 4


def _load(built: Path, tmp_path: Path, **overrides) -> LLM:
    dest = tmp_path / f"engine-{len(list(tmp_path.iterdir()))}"
    shutil.copytree(built, dest)
    return LLM.from_artifact(dest, num_kv_blocks=256, **overrides)


def _prompts(n: int, length: int = 20) -> list[list[int]]:
    """Repeated phrases (drafts exist), all admitted in one step (n x length <= maxNumTokens)."""
    return [[1, *([5 + i, 40 + i, 77, 9 + 2 * i, 300] * length)[:length - 1]] for i in range(n)]


def test_the_engine_follows_the_table_above_and_below_the_cut_off(built, tmp_path):
    llm = _load(built, tmp_path)
    table = llm.engine.config.speculative_config.by_batch
    assert table == {1: table[1], 2: table[2], 4: 0, 8: 0} and table[1] > 0
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm.generate(_prompts(4), params)  # batch 4 from the first decode to the last: bucket 4, off
    stats = llm.stats()
    assert stats.spec_num_draft_tokens == 0 and stats.spec_steps_off_by_batch >= 15, stats
    llm.generate(_prompts(1), params)  # batch 1: drafts
    stats = llm.stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0, stats


def test_greedy_output_is_unchanged_by_the_table(built, tmp_path):
    """A batch that shrinks through the buckets (8 -> 1) as requests finish: drafts switch on on the
    way, and every token equals the same artifact's without speculation."""
    prompts = _prompts(8, length=24)
    params = [SamplingParams(temperature=0, max_tokens=4 + 5 * i) for i in range(8)]
    plain = _load(built, tmp_path, speculative_config=None).generate(prompts, params)
    llm = _load(built, tmp_path)
    tabled = llm.generate(prompts, params)
    assert [o.token_ids for o in tabled] == [o.token_ids for o in plain]
    stats = llm.stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_steps_off_by_batch > 0, stats


def test_bucket_helpers():
    assert speculative_stage.batch_sizes(64) == [1, 2, 4, 8, 16, 32]
    assert speculative_stage.batch_sizes(6) == [1, 2, 4, 6]
    assert speculative_stage.batch_sizes(1) == [1]
    assert speculative_stage.k_candidates(8) == [2, 4, 8]
    assert speculative_stage.k_candidates(1) == [1]
    assert speculative_stage.k_candidates(3) == [2, 3]
    assert speculative_stage.cycle([[1, 2], [3]], 3) == [[1, 2], [3], [1, 2]]
    assert speculative_stage._next_round_cost([1.0], 2.0) == 2.0
    assert speculative_stage._next_round_cost([1.0, 1.5], 2.0) == 2.25  # grown as it grew, at most 2x


def test_rewrite_workload(toy_model):
    from builder_helpers import manifest_dict
    from transformers import AutoTokenizer

    from kiln.manifest import load_manifest

    tokenizer = AutoTokenizer.from_pretrained(str(toy_model("llama-tiny")))
    spec = load_manifest(manifest_dict("file:///m", maxInputLen=128, maxSeqLen=256)).spec
    text = "The quick brown fox jumps over the lazy dog."
    (chat, long) = speculative_stage.rewrite_workload(tokenizer, [text, text * 40], spec)
    assert tokenizer.chat_template and "word for word" in tokenizer.decode(chat) and text in tokenizer.decode(chat)
    assert len(long) <= 128 and long[:len(long) // 2] * 2 == long  # too long for a chat turn: the text twice
    tokenizer.chat_template = None
    (doubled,) = speculative_stage.rewrite_workload(tokenizer, [text], spec)
    assert doubled[:len(doubled) // 2] * 2 == doubled and len(doubled) < len(chat)
