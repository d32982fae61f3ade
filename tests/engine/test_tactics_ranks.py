"""TP ranks run the kernels rank 0 chose (issue 38, low): each rank timing its own table could pick different
kernels (and, under load, did). Two separately started ranks whose own tables differ (rank 0's every linear on
``kiln-fma``, rank 1's on ``aten``, as two timings on a busy host might) end up packed alike: rank 1 takes rank
0's table over the rank channel."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
from pathlib import Path

import pytest
from engine_testlib import random_prompts
from kiln.engine import LLM, SamplingParams, workers
from kiln.engine.kernels import native
from kiln.engine.tactics import bind
from netutil import free_port

TOKEN = "0123456789abcdef-tactics-ranks"


def _runs(table) -> dict[str, list[str]]:
    return {key: sorted({b["runs"] for b in choice.buckets}) for key, choice in table.linear.items()}


def _rank1(kwargs: dict, out: str) -> None:
    """Rank 1 started on its own (a pod), recording the table it packs its linears by."""
    from kiln.engine.config import EngineConfig

    real = bind.bind

    def recording(model, modules, table, *args, **kw):
        Path(out).write_text(json.dumps(_runs(table)))
        return real(model, modules, table, *args, **kw)

    bind.bind = recording
    os.environ["KILN_GROUP_TOKEN"] = TOKEN
    sys.exit(workers.run_worker_node(EngineConfig(**kwargs)))


def test_rank1_packs_by_rank0s_table(toy_model, tmp_path, monkeypatch):
    if native.kernels() is None:
        pytest.skip("kiln's CPU kernels do not load here (kiln-fma is one of the two tables)")
    base = dict(model=str(toy_model("llama-tiny")), tensor_parallel_size=2, device="cpu", num_kv_blocks=32,
                block_size=8, max_num_tokens=16, max_batch_size=4, distributed_address=f"127.0.0.1:{free_port()}",
                distributed_timeout_s=60, join_timeout_s=120)
    out = tmp_path / "rank1.json"
    rank1 = mp.get_context("spawn").Process(target=_rank1, args=({**base, "rank_offset": 1, "tactics": "aten"},
                                                                 str(out)), daemon=True)
    rank1.start()
    seen = {}
    real = bind.bind

    def recording(model, modules, table, *args, **kw):
        seen.update(_runs(table))
        return real(model, modules, table, *args, **kw)

    monkeypatch.setattr(bind, "bind", recording)
    monkeypatch.setenv("KILN_GROUP_TOKEN", TOKEN)
    llm = None
    try:
        llm = LLM(**base, tactics="kiln-fma")
        assert llm.generate(random_prompts([9], seed=2), SamplingParams(temperature=0, max_tokens=3))[0].token_ids
        llm.shutdown()
        rank1.join(60)
        assert rank1.exitcode == 0
    finally:
        if llm is not None:
            llm.shutdown()
        if rank1.is_alive():
            rank1.kill()
    theirs = json.loads(out.read_text())
    assert seen and all(v == ["kiln-fma"] for v in seen.values())
    assert theirs == seen  # rank 1's own forced aten table was replaced by rank 0's


def test_a_rank_takes_rank0s_model_choices_whole(monkeypatch):
    """A model-level key only this rank has (an ``mlp_rows`` from its own cache) would give it another MLP
    slice, and so another count of all-reduces per step, than rank 0: it is dropped, not kept."""
    from kiln.engine import parallel
    from kiln.engine.tactics.table import TacticTable

    rank0 = TacticTable(host={"cpu": "x"}, model={"decoder_stack": {"winner": "native"}})
    mine = TacticTable(host={"cpu": "x"}, model={"decoder_stack": {"winner": "torch"}, "mlp_rows": {"winner": 64}})
    monkeypatch.setattr(parallel, "wait_for_ranks", lambda *a: None)
    monkeypatch.setattr(parallel, "rank", lambda: 1)
    monkeypatch.setattr(parallel, "broadcast_json", lambda doc: rank0.to_json())
    assert bind.take_rank0s(mine, 1.0).model == {"decoder_stack": {"winner": "native"}}
