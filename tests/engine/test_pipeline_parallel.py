"""Pipeline parallelism over gloo on local processes: the same greedy tokens as one process.

P=2 (with and without micro-batches in flight) and T=2 x P=2 run the hardest mix the
engine knows (shared prefixes, chunked prefill, a pool small enough to preempt, two
waves of requests) and must equal P=1, T=1 token for token. Plus the parts: the layer
split, the micro-batch split, per-(stage, TP rank) artifact files, config errors, and
what happens when a rank dies or sits idle.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from engine_testlib import random_prompts
from kiln.engine import LLM, ConfigError, SamplingParams
from kiln.engine.artifact import save_rank_weights, shard_checkpoint
from kiln.engine.parallel import stage_layers
from kiln.engine.step_inputs import split_batch
from safetensors import safe_open

# tactics pinned: each stage is a process that would time its own kernels, and the single-process reference
# its own; engines compared token for token must run the same kernels (issue 38).
KWARGS = dict(num_kv_blocks=24, block_size=4, max_num_tokens=12, max_batch_size=6, tactics="aten")


def workload():
    shared = random_prompts([21], seed=9)[0][1:]
    prompts = random_prompts([30, 26, 41, 23, 35, 28], seed=10, prefix=shared) + random_prompts([7, 15], seed=11)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, prompt_logprobs=2 if i in (1, 6) else None)
              for i, n in enumerate((11, 3, 8, 14, 6, 9, 12, 5))]  # two ask for their prompts' logprobs
    return prompts, params


def run_mix(llm):
    """Two waves: the first three prompts, then all eight (prefix hits on the second); the tokens, and the
    prompt logprobs of the second wave's requests that ask for them."""
    prompts, params = workload()
    first = [o.token_ids for o in llm.generate(prompts[:3], params[:3])]
    outs = llm.generate(prompts, params)
    return first, [o.token_ids for o in outs], [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]


def assert_same(got, expected) -> None:
    """Tokens equal; prompt logprobs the same tokens, their values within float32 noise (a TP rank sums its part)."""
    assert got[:2] == expected[:2]
    assert len(got[2]) == len(expected[2]) == 2
    for seq, ref in zip(got[2], expected[2], strict=True):
        assert len(seq) == len(ref) and seq[0] is ref[0] is None
        for entry, want in zip(seq[1:], ref[1:], strict=True):
            assert entry.keys() == want.keys() and all(abs(entry[t] - want[t]) < 1e-4 for t in want)


_REFERENCE: dict[str, tuple] = {}


def reference(model_dir: Path, make_llm):
    if str(model_dir) not in _REFERENCE:
        llm = make_llm(model_dir, **KWARGS)
        _REFERENCE[str(model_dir)] = run_mix(llm)
        stats = llm.stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0  # the mix really exercises both
    return _REFERENCE[str(model_dir)]


@pytest.mark.parametrize(("preset", "overrides", "micro"), [
    ("llama-tiny", {"num_hidden_layers": 3}, None),  # uneven split (2 + 1 layers), 2 micro-batches in flight
    ("llama-tiny", {"num_hidden_layers": 3}, 1),     # no micro-batching
    ("qwen2-tiny", {}, 3),                           # tied LM head on the last stage, qkv bias
])
def test_pp2_equals_single_process(preset, overrides, micro, toy_model, make_llm):
    model_dir = toy_model(preset, **overrides)
    expected = reference(model_dir, make_llm)
    llm = make_llm(model_dir, pipeline_parallel_size=2, num_micro_batches=micro, micro_batch_min_tokens=1, **KWARGS)
    assert_same(run_mix(llm), expected)
    stats = llm.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_tp2_pp2_equals_single_process(toy_model, make_llm):
    model_dir = toy_model("llama-tiny")
    expected = reference(model_dir, make_llm)
    llm = make_llm(model_dir, tensor_parallel_size=2, pipeline_parallel_size=2, micro_batch_min_tokens=1, **KWARGS)
    assert llm.engine.group is not None and len(llm.engine.group.procs) == 3
    assert_same(run_mix(llm), expected)


def test_micro_batches_without_pipeline_equal_one_batch(toy_model, make_llm):
    """Splitting a step into micro-batches is itself exact (P=1, 3 micro-batches, no processes)."""
    model_dir = toy_model("llama-tiny", num_hidden_layers=3)
    expected = reference(model_dir, make_llm)
    assert_same(run_mix(make_llm(model_dir, num_micro_batches=3, micro_batch_min_tokens=1, **KWARGS)), expected)


def test_stage_layers_split_evenly_earlier_stages_take_the_rest():
    assert [stage_layers(3, s, 2) for s in range(2)] == [(0, 2), (2, 3)]
    assert [stage_layers(10, s, 4) for s in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [stage_layers(8, s, 8) for s in range(8)] == [(i, i + 1) for i in range(8)]


def test_split_batch_balances_tokens_and_keeps_every_row_once():
    rows = [(f"r{i}", n) for i, n in enumerate([1, 1, 1, 1, 12, 4])]
    parts = split_batch(rows, 2)
    assert [r for part in parts for r in part] == rows
    assert len(parts) == 2 and all(parts)
    assert split_batch(rows[:1], 4) == [rows[:1]]
    assert len(split_batch(rows, 6)) == 6
    assert split_batch(rows, 1) == [rows]
    assert split_batch(rows, 2, min_tokens=16) == [rows]  # 20 tokens: two parts of 16 do not fit
    assert len(split_batch(rows, 2, min_tokens=10)) == 2


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(pipeline_parallel_size=3), "pipeline_parallel_size"),
    (dict(pipeline_parallel_size=4), "pipeline_parallel_size"),  # 2 layers: a stage would have none
    (dict(num_micro_batches=0), "num_micro_batches"),
    (dict(distributed_address="leader"), "distributed_address"),
    (dict(rank_offset=1), "rank_offset"),
    (dict(pipeline_parallel_size=2, distributed_address="h:29500", rank_offset=2), "rank_offset"),
    (dict(distributed_timeout_s=0), "distributed_timeout_s"),
])
def test_config_errors_name_the_field(kwargs, field, toy_model):
    from kiln.engine.config import EngineConfig

    with pytest.raises(ConfigError, match=field):
        EngineConfig(model=str(toy_model("llama-tiny")), **kwargs)


def make_pp_artifact(model_dir: Path, out: Path, tp: int, pp: int) -> Path:
    out.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    save_rank_weights(shard_checkpoint(model_dir, tp, "float32", None, pp_size=pp), out / "weights", pp_size=pp)
    (out / "engine.json").write_text(json.dumps({
        "format_version": 1, "gpu": {"sku": "cpu", "arch": "cpu"},
        "engine_config": {"dtype": "float32", "tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                          **{k: v for k, v in KWARGS.items() if k != "tactics"}},  # a runtime choice, not the build's
    }))
    return out


def test_artifact_is_sharded_per_stage_and_loads_per_rank(toy_model, make_llm, tmp_path):
    model_dir = toy_model("qwen2-tiny")  # tied: the last stage stores its own LM head
    art = make_pp_artifact(model_dir, tmp_path / "art", tp=1, pp=2)
    files = sorted(p.name for p in (art / "weights").iterdir())
    assert files == ["rank-0-of-2.safetensors", "rank-1-of-2.safetensors"]
    with safe_open(str(art / "weights" / files[0]), "pt") as f:
        first = set(f.keys())
        assert f.metadata()["kiln_pp_stage"] == "0"
    with safe_open(str(art / "weights" / files[1]), "pt") as f:
        last = set(f.keys())
    assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first and "model.norm.weight" not in first
    assert {n for n in first if n.startswith("model.layers.")} == {n for n in first if ".layers.0." in n}
    assert "lm_head.weight" in last and "model.norm.weight" in last and "model.embed_tokens.weight" not in last
    assert {n for n in last if n.startswith("model.layers.")} == {n for n in last if ".layers.1." in n}

    expected = reference(model_dir, make_llm)  # first: a one-process engine beside a live group would join it
    llm = LLM.from_artifact(art, tactics=KWARGS["tactics"])
    try:
        assert llm.engine_config.pipeline_parallel_size == 2
        assert_same(run_mix(llm), expected)
    finally:
        llm.shutdown()
    with pytest.raises(ConfigError, match="pipeline_parallel_size=1"):
        LLM.from_artifact(art, pipeline_parallel_size=1)


def test_a_dead_rank_fails_the_step_never_hangs(toy_model):
    llm = LLM(toy_model("llama-tiny"), pipeline_parallel_size=2, distributed_timeout_s=20, **KWARGS)
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert len(llm.generate([[1, 5, 6, 7]], params)[0].token_ids) == 4
        proc = llm.engine.group.procs[0]
        proc.kill()
        proc.join(10)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="rank"):
            llm.generate([[1, 5, 6, 7]], params)
        assert time.monotonic() - started < 20
    finally:
        llm.shutdown()


def test_idle_ranks_are_kept_alive_by_the_heartbeat(toy_model):
    """Ranks wait at most distributed_timeout_s for work; the driver's heartbeat keeps an idle group up."""
    llm = LLM(toy_model("llama-tiny"), pipeline_parallel_size=2, distributed_timeout_s=2.0, **KWARGS)
    try:
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        first = llm.generate([[1, 5, 6, 7]], params)[0].token_ids
        time.sleep(5)  # 2.5x the timeout, idle
        assert llm.generate([[1, 5, 6, 7]], params)[0].token_ids == first
        assert all(p.is_alive() for p in llm.engine.group.procs)
    finally:
        llm.shutdown()


def _posted(rank: int, num_batches: int, monkeypatch) -> list[tuple[str, int]]:
    """The point-to-point ops ``rank`` of a PP=2 group posts in one ``run_stage`` call, in order."""
    from types import SimpleNamespace

    import torch
    from kiln.engine import parallel
    from kiln.engine.model_runner import ModelRunner

    ops: list[tuple[str, int]] = []
    done = SimpleNamespace(wait=lambda timeout=None: True)
    monkeypatch.setattr(parallel, "isend", lambda x, dst, tag: ops.append(("send", dst)) or done)
    monkeypatch.setattr(parallel, "irecv", lambda buf, src, tag: ops.append(("recv", src)) or done)
    cfg = SimpleNamespace(torch_dtype=torch.float32, hf_config={"hidden_size": 4, "vocab_size": 8},
                          distributed_timeout_s=5)

    def execute(b, intermediate=None):
        n = b.input_ids.shape[0]
        return torch.zeros(n, 8) if rank == 1 else (torch.zeros(n, 4), torch.zeros(n, 4))

    runner = SimpleNamespace(device="cpu", config=cfg, execute=execute)
    batches = [SimpleNamespace(input_ids=torch.zeros(3, dtype=torch.long), logits_indices=torch.arange(3)) for _ in range(num_batches)]
    with parallel.shard_context(rank, 1, 2):
        ModelRunner.run_stage(runner, batches)
    return ops


def _deadlocks(a: list[tuple[str, int]], b: list[tuple[str, int]]) -> bool:
    """NCCL's rule for one pair of ranks: each runs its sends and receives to the other in the order it
    posted them, and a send completes only with the other's receive at the head of its queue."""
    a, b = list(a), list(b)
    while a and b and {a[0][0], b[0][0]} == {"send", "recv"}:
        a.pop(0), b.pop(0)
    return bool(a or b)


@pytest.mark.parametrize("micro", [1, 3])
def test_stage_ops_are_posted_in_an_order_nccl_cannot_deadlock_on(micro, monkeypatch):
    """PP=2: rank 0 sends activations to rank 1 and receives the logits from it. Rank 0 used to post the
    logits' receive first; gloo matches by tag and ran, NCCL pairs the two ranks' ops in order and hangs."""
    rank0, rank1 = _posted(0, micro, monkeypatch), _posted(1, micro, monkeypatch)
    assert rank0 == [("send", 1)] * micro + [("recv", 1)] * micro
    assert rank1 == [("recv", 0)] * micro + [("send", 0)] * micro
    assert not _deadlocks(rank0, rank1)
    old_rank0 = [("recv", 1)] * micro + [("send", 1)] * micro  # the order before the fix
    assert _deadlocks(old_rank0, rank1)
