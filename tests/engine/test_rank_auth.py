"""The rank channel: a rank joins only with the group's token, and nothing a rank receives is unpickled.

Joining is checked on a real TCPStore on 127.0.0.1: a rank holding another token is refused (and the
leader still admits the real one), a stray ``add("kiln/joined", 1)`` or a forged proof never completes
a group. A TP=2 run whose second rank cannot unpickle anything (a separately started process, like a
pod) gives the same tokens as TP=1; steps and control messages travel as typed tensors.
"""

from __future__ import annotations

import ast
import datetime
import json
import multiprocessing as mp
import os
import re
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from engine_testlib import random_prompts
from kiln.engine import LLM, ConfigError, SamplingParams, parallel, rendezvous, workers
from kiln.engine.step_inputs import decode_steps, encode_steps, pack_rows
from netutil import free_port

TOKEN = "0123456789abcdef-right-token"
ENGINE = Path(parallel.__file__).parent


def store(port: int, leader: bool) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, 2, is_master=leader, timeout=datetime.timedelta(seconds=10),
                         wait_for_workers=False)


def run_leader(port: int, world: int, seconds: float) -> tuple[threading.Thread, dict]:
    """Rank 0's side of the rendezvous in a thread; ``result['error']`` holds what it raised."""
    result: dict = {}
    master = store(port, True)

    def main() -> None:
        try:
            rendezvous.rendezvous(master, 0, world, TOKEN, time.monotonic() + seconds)
        except Exception as exc:
            result["error"] = exc
    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    result["store"] = master
    return thread, result


def test_a_rank_with_another_token_is_refused_and_the_real_rank_still_joins(caplog):
    port = free_port()
    leader, result = run_leader(port, 2, seconds=20)
    config = SimpleNamespace(world_size=2, join_timeout_s=10, distributed_timeout_s=10, tensor_parallel_size=2,
                             pipeline_parallel_size=1, device="cpu")
    with caplog.at_level("WARNING", logger="kiln.engine"), \
            pytest.raises(rendezvous.JoinRefusedError, match=r"rank 1 of 2 .*KILN_GROUP_TOKEN differs") as refused:
        workers._join(config, 1, f"127.0.0.1:{port}", "another-token-0123456789")
    assert "\n" not in str(refused.value)
    assert any("KILN_GROUP_TOKEN" in r.getMessage() and "rank 1" in r.getMessage() for r in caplog.records)
    rendezvous.rendezvous(store(port, False), 1, 2, TOKEN, time.monotonic() + 10)  # the real rank 1
    leader.join(10)
    assert not leader.is_alive() and "error" not in result


def test_a_stray_add_or_a_forged_proof_never_completes_the_group(monkeypatch):
    """The old rendezvous counted ``add("kiln/joined", 1)``: any process could stand in for a rank."""
    started: list[int] = []
    monkeypatch.setattr(parallel, "init_distributed", lambda rank, *a, **k: started.append(rank))
    port = free_port()
    config = SimpleNamespace(world_size=2, join_timeout_s=3, distributed_timeout_s=3, tensor_parallel_size=2,
                             pipeline_parallel_size=1, device="cpu")
    errors: list[Exception] = []

    def lead() -> None:
        try:
            workers._join(config, 0, f"127.0.0.1:{port}", TOKEN)
        except Exception as exc:
            errors.append(exc)
    leader = threading.Thread(target=lead, daemon=True)
    leader.start()
    stranger = store(port, False)  # connects (retrying) once the leader serves the store
    stranger.add("kiln/joined", 1)
    stranger.add("kiln/joined", 1)
    nonce = stranger.get("kiln/auth/nonce").decode()
    stranger.set("kiln/auth/proof/1", f'{{"nonce": "x", "proof": "{rendezvous._mac("guess", "join", nonce, 2, 1, "x")}"}}')
    stranger.set("kiln/auth/proof/2", "junk")  # a rank that does not exist: never read
    leader.join(20)
    assert not leader.is_alive()
    assert started == []  # the leader never went on to form the process groups
    assert len(errors) == 1 and "1 of 2 ranks joined (missing: ranks [1])" in str(errors[0])
    assert "refused 1 join" in str(errors[0])


def test_group_token_needs_kiln_group_token_for_separately_started_ranks(monkeypatch):
    monkeypatch.delenv("KILN_GROUP_TOKEN", raising=False)
    monkeypatch.delenv("KILN_INSECURE_GROUP", raising=False)
    local = workers.group_token(SimpleNamespace(distributed_address=None))
    assert re.fullmatch("[0-9a-f]{64}", local) and local != workers.group_token(SimpleNamespace(distributed_address=None))
    remote = SimpleNamespace(distributed_address="leader:29500")
    with pytest.raises(ConfigError, match=r"need \$KILN_GROUP_TOKEN.*KILN_INSECURE_GROUP=1"):
        workers.group_token(remote)
    monkeypatch.setenv("KILN_GROUP_TOKEN", "short")
    with pytest.raises(ConfigError, match="KILN_GROUP_TOKEN is 5 characters"):
        workers.group_token(remote)
    monkeypatch.setenv("KILN_GROUP_TOKEN", f" {TOKEN}\n")  # a Secret's trailing newline is not part of it
    assert workers.group_token(remote) == TOKEN
    monkeypatch.delenv("KILN_GROUP_TOKEN")
    monkeypatch.setenv("KILN_INSECURE_GROUP", "1")
    assert workers.group_token(remote) == ""


# -- the messages: typed tensors, never a pickle ---------------------------------------------------
def test_steps_round_trip_exactly_and_malformed_ones_are_refused():
    batches = [pack_rows([([5], 9, [1, 2, 3]), ([7], 3, [4]), ([1, 2, 3, 4, 5], 0, [6, 7]), ([9, 9], 7, [8, 10, 11])],
                         4, [0, 1, 6, 8]),
               pack_rows([([1, 2, 3], 0, [0])], 4, [2])]
    words = encode_steps(batches)
    assert words.dtype == torch.int64 and words.dim() == 1
    for a, b in zip(batches, decode_steps(words), strict=True):
        for field in ("input_ids", "positions", "slot_mapping", "decode_block_tables", "decode_ctx_lens",
                      "logits_indices"):
            x, y = getattr(a, field), getattr(b, field)
            assert x.dtype == y.dtype and torch.equal(x, y), field
        assert a.num_decodes == b.num_decodes
        assert [(*p[:3], p[3].tolist()) for p in a.prefills] == [(*p[:3], p[3].tolist()) for p in b.prefills]
    assert decode_steps(encode_steps([])) == []
    for bad in (words[:-1], torch.cat([words, words[:1]]), torch.tensor([1, -1, 0, 0, 0, 0]), torch.tensor([3])):
        with pytest.raises(ValueError, match="malformed step message"):
            decode_steps(bad)
    assert parallel.decode_json(parallel.encode_json({"winner": 64, "how": "é"})) == {"winner": 64, "how": "é"}


def _names(path: Path) -> set[str]:
    """The names, attributes and modules a file's code uses (its docstrings do not count)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.update([node.module or "", *(a.name for a in node.names)])
    return names


def test_nothing_in_the_engine_sends_python_objects_between_ranks():
    object_collectives = {"broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                          "send_object_list", "recv_object_list", "broadcast_object"}
    users = sorted(str(p.relative_to(ENGINE)) for p in ENGINE.rglob("*.py") if _names(p) & object_collectives)
    assert users == []
    for name in ("parallel.py", "rendezvous.py", "workers.py", "step_inputs.py", "model_runner.py"):
        assert not _names(ENGINE / name) & {"pickle", "_pickle", "Unpickler", "ForkingPickler"}, name


def _rank1_that_cannot_unpickle(kwargs: dict, token: str) -> None:
    """Rank 1 started on its own (a pod): unpickling anything after start-up is an error."""
    import pickle

    import torch.distributed.distributed_c10d as c10d
    from kiln.engine.config import EngineConfig

    def refuse(*args, **kwargs):
        raise AssertionError("a rank unpickled a message")
    pickle.loads = pickle.load = pickle.Unpickler = c10d._unpickler = c10d._tensor_to_object = refuse
    os.environ["KILN_GROUP_TOKEN"] = token
    sys.exit(workers.run_worker_node(EngineConfig(**kwargs)))


def test_tp2_on_separately_started_ranks_never_unpickles_and_equals_tp1(toy_model, make_llm, monkeypatch):
    import torch.distributed.distributed_c10d as c10d

    model_dir = toy_model("llama-tiny")
    prompts = random_prompts([5, 23, 40], seed=11)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (8, 5, 6)]
    kwargs = dict(num_kv_blocks=32, block_size=8, max_num_tokens=16, max_batch_size=4,
                  tactics="aten")  # one pinned kernel in both engines and every rank: compared token for token
    tp1 = [o.token_ids for o in make_llm(model_dir, **kwargs).generate(prompts, params)]
    group = dict(model=str(model_dir), tensor_parallel_size=2, distributed_address=f"127.0.0.1:{free_port()}",
                 distributed_timeout_s=60, join_timeout_s=120, **kwargs)
    rank1 = mp.get_context("spawn").Process(target=_rank1_that_cannot_unpickle,
                                            args=({**group, "rank_offset": 1}, TOKEN), daemon=True)
    rank1.start()
    llm = None
    try:
        def refuse(*args, **kwargs):
            raise AssertionError("rank 0 pickled a message")
        for name in ("_object_to_tensor", "_tensor_to_object", "broadcast_object_list"):
            monkeypatch.setattr(c10d, name, refuse)
        monkeypatch.setattr(dist, "broadcast_object_list", refuse)
        monkeypatch.setenv("KILN_GROUP_TOKEN", TOKEN)
        llm = LLM(**group)
        assert [o.token_ids for o in llm.generate(prompts, params)] == tp1
        assert [o.token_ids for o in llm.generate(prompts[:1], params[:1])] == tp1[:1]
        llm.shutdown()
        rank1.join(60)
        assert rank1.exitcode == 0
    finally:
        if llm is not None:
            llm.shutdown()
        if rank1.is_alive():
            rank1.kill()


def test_a_forged_refusal_or_nonce_never_turns_a_real_rank_away():
    """Anyone reaching the store's port could once write a rank's refusal (its nonce is in its proof, readable by
    all) or replace the leader's nonce, and every real rank exited on "token differs" (issue 38, Med 8). A
    verdict or nonce now counts only with the token's MAC: a forged one is ignored, a replaced nonce restored."""
    port = free_port()
    leader, result = run_leader(port, 3, seconds=20)
    stranger = store(port, False)
    joined: dict[int, Exception | None] = {}

    def join(rank: int) -> None:
        try:
            rendezvous.rendezvous(store(port, False), rank, 3, TOKEN, time.monotonic() + 15)
            joined[rank] = None
        except Exception as exc:
            joined[rank] = exc

    first = threading.Thread(target=join, args=(1,), daemon=True)
    first.start()
    for _ in range(200):  # rank 1's proof is up; rank 2 has not come, so the leader has not answered
        if stranger.check(["kiln/auth/proof/1"]):
            break
        time.sleep(0.02)
    theirs = json.loads(stranger.get("kiln/auth/proof/1"))["nonce"]
    stranger.set("kiln/auth/verdict/1", json.dumps({"nonce": theirs, "refused": "1", "mac": "0" * 64}))
    stranger.set("kiln/auth/nonce", json.dumps({"nonce": "f" * 32, "mac": "0" * 64}))
    time.sleep(0.3)  # rank 1 sees the forged refusal, and waits on
    assert 1 not in joined
    second = threading.Thread(target=join, args=(2,), daemon=True)
    second.start()
    for thread in (first, second, leader):
        thread.join(20)
    assert joined == {1: None, 2: None} and "error" not in result
