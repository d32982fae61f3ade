"""``batch_invariant``: one kernel per linear at every row count, so a request's greedy output does not depend on
its batch, its prefill chunks or a prefix-cache hit (engine/tactics/bind.py, resolve.one_for_all_rows)."""

from __future__ import annotations

import json

import pytest
import torch
from kiln.engine import SamplingParams
from kiln.engine.errors import ConfigError
from kiln.engine.kernels import native
from kiln.engine.tactics.resolve import one_for_all_rows
from kiln.engine.tactics.table import TacticTable

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="kiln's CPU kernels do not build on this host")
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def bucket(rows: int, runs: str, us: dict[str, float]) -> dict:
    return {"rows": rows, "runs": runs, "winner": runs, "runner_up": None, "us": us, "pruned": [],
            "inferred_from": None}


def test_one_kernel_for_all_rows_is_the_least_summed_time_else_the_one_running_most_buckets():
    # a GGUF linear whose table ran the quantized-activation kernel at 1 row and the float32 one from 4 rows
    buckets = [bucket(1, "kiln-gguf", {"kiln-gguf": 50, "kiln-gguf-f32": 800}),
               bucket(4, "kiln-gguf-f32", {"kiln-gguf": 1800, "kiln-gguf-f32": 550}),
               bucket(64, "kiln-gguf-f32", {"kiln-gguf": 9000, "kiln-gguf-f32": 4000})]
    runs = [b["runs"] for b in buckets]
    assert one_for_all_rows(runs, buckets) == "kiln-gguf-f32"  # 5350 us in all against 10850
    buckets[2]["us"] = {"kiln-gguf-f32": 4000}  # not timed at every bucket: the one running most buckets
    assert one_for_all_rows(runs, buckets) == "kiln-gguf-f32"
    untimed = [bucket(1, "kiln-gguf", {}), bucket(4, "kiln-gguf-f32", {})]
    assert one_for_all_rows(["kiln-gguf", "kiln-gguf-f32"], untimed) == "kiln-gguf-f32"  # a tie: the most rows'
    assert one_for_all_rows(["kiln-fma"] * 3, [bucket(r, "kiln-fma", {}) for r in (1, 2, 4)]) == "kiln-fma"


def aten_everywhere(toy_model, make_llm, tmp_path, us: dict[str, float]) -> tuple:
    """(model dir, a tactics.json of this host running every linear on ATen at every row count, ``us`` timed)."""
    model_dir = toy_model("llama-tiny")
    llm = make_llm(model_dir, device="cpu", attention_backend="native", num_kv_blocks=64, tactics="kiln-fma")
    table = TacticTable.from_json(json.loads(json.dumps(llm.engine.runner.tactics.to_json())))
    llm.shutdown()
    for choice in table.linear.values():
        choice.layout = "plain"
        choice.buckets = [bucket(b["rows"], "aten", us) for b in choice.buckets]
    return model_dir, str(table.save(tmp_path / "tactics.json"))


@pytest.fixture
def aten_table(toy_model, make_llm, tmp_path):
    """A table running every linear on ATen with kiln-fma timed beside it: ATen's float32 GEMM picks its own kernel
    by shape, so a row's sum can differ with the row count (seen: 3e-6 on SmolLM2's 576x576 at 1 row against 37)."""
    return aten_everywhere(toy_model, make_llm, tmp_path, {"aten": 1.0, "kiln-fma": 2.0})


def linears(llm) -> list:
    return [m for m in llm.engine.runner.model.modules() if hasattr(m, "packed_weight") and hasattr(m, "input_size")]


def test_batch_invariant_runs_every_linear_on_one_of_kilns_kernels_whose_rows_do_not_depend_on_the_row_count(
        aten_table, make_llm):
    model_dir, table = aten_table
    as_timed = make_llm(model_dir, device="cpu", attention_backend="native", num_kv_blocks=64, tactics=table)
    assert set(as_timed.engine.config.tactics_info["layouts"]) == {"plain"}
    assert "batch_invariant" not in as_timed.engine.config.tactics_info
    as_timed.shutdown()
    llm = make_llm(model_dir, device="cpu", attention_backend="native", num_kv_blocks=64, tactics=table,
                   batch_invariant=True)
    info = llm.engine.config.tactics_info
    assert set(info["layouts"]) == {"kiln"}
    assert info["batch_invariant"] == f"every linear ({info['layouts']['kiln']}) on one kiln kernel at every row count"
    torch.manual_seed(0)
    with torch.no_grad():
        for m in linears(llm):
            x = torch.randn(37, m.input_size)
            out = m(x)
            out = out[0] if isinstance(out, tuple) else out
            for rows in (1, 5, 16):
                alone = m(x[-rows:].contiguous())
                alone = alone[0] if isinstance(alone, tuple) else alone
                assert torch.equal(out[-rows:], alone), (m, rows)


def test_with_batch_invariant_a_greedy_answer_is_the_same_alone_in_a_batch_and_from_the_prefix_cache(
        aten_table, make_llm):
    model_dir, table = aten_table
    llm = make_llm(model_dir, device="cpu", attention_backend="native", num_kv_blocks=128, tactics=table,
                   batch_invariant=True, max_num_tokens=64, block_size=4)
    prompts = [[(7 * i + j) % 200 + 3 for j in range(5 + 3 * i)] for i in range(8)]
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]  # the second pass of each hits the cache
    again = [llm.generate([p], GREEDY)[0] for p in prompts]
    assert all(o.num_cached_tokens > 0 for o in again[1:])
    assert [o.token_ids for o in again] == alone
    batched = [o.token_ids for o in llm.generate(prompts, GREEDY)]  # one batch, prefill chunked by 64 tokens
    assert batched == alone


def test_linears_with_no_kiln_kernel_timed_keep_their_layout_and_the_engine_says_how_many_may_still_vary(
        toy_model, make_llm, tmp_path):
    # as bfloat16 on a host without AVX512-BF16: the table timed ATen alone, so there is no kiln kernel to move to
    model_dir, path = aten_everywhere(toy_model, make_llm, tmp_path, {"aten": 1.0})
    llm = make_llm(model_dir, device="cpu", attention_backend="native", num_kv_blocks=64, tactics=path,
                   batch_invariant=True)
    info = llm.engine.config.tactics_info
    n = info["layouts"]["plain"]
    assert set(info["layouts"]) == {"plain"} and n > 0
    assert info["batch_invariant"].startswith(f"partial: {n} of {n} linear(s) have no kiln kernel timed here and "
                                              f"run {n} ATen")


def test_batch_invariant_is_refused_on_a_cuda_engine_naming_the_setting(toy_model, monkeypatch):
    from kiln.engine.config import EngineConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match=r"batch_invariant is for CPU engines .* set batch_invariant false"):
        EngineConfig(model=str(toy_model("llama-tiny")), device="cuda", batch_invariant=True)
