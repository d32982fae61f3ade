"""`kiln serve` processes started separately (like LeaderWorkerSet pods) serve as one engine.

Workers start before the leader (pods come up in any order), one rank per process, over
gloo on 127.0.0.1, every one with the same $KILN_GROUP_TOKEN. The leader's completions equal
the single-process offline engine's; a killed worker turns the leader's /health to 503 within
seconds and the leader exits 1; a worker whose leader never comes exits 1 after its join
timeout; a worker with another token, or none, exits 1 with one line naming KILN_GROUP_TOKEN.
Never a hang.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import click
import httpx
import pytest
from conftest import MODEL_NAME, Server
from kiln.engine import SamplingParams
from kiln.serving.ranks import PlacementError, resolve_placement
from netutil import free_port

PROMPTS = ["The kiln", "Once upon a time the", "fire and clay", "a b c d e f g h i j k l m n o p"]
# One pinned kernel in every rank and in the offline engine: a served engine on 'auto' starts on the untimed
# default and swaps in a table timed in the background, the offline one times at load, and under load the two
# can pick different kernels (tokens then differ on a random-weight model's near-ties).
FLAGS = ["--max-seq-len", "256", "--max-input-len", "128", "--num-kv-blocks", "256", "--tactics", "aten"]
GROUP = {"KILN_GROUP_TOKEN": "multiprocess-test-group-token", "KILN_INSECURE_GROUP": None}


def start_worker(model_dir: Path, log_path: Path, *args: str, env: dict[str, str | None] | None = None):
    cmd = [sys.executable, "-m", "kiln", "serve", "--model", str(model_dir), *FLAGS, *args]
    merged = {**{k: v for k, v in os.environ.items() if not k.startswith("LWS_")}, "OMP_NUM_THREADS": "1",
              **GROUP, **(env or {})}
    full_env = {k: v for k, v in merged.items() if v is not None}
    log = open(log_path, "wb")  # noqa: SIM115 - the process owns it until it exits
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def complete_all(url: str) -> list[dict]:
    def one(prompt: str) -> dict:
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # one engine batch, micro-batched
        return list(pool.map(one, PROMPTS))


@pytest.fixture(scope="module")
def offline(model_dir: Path):
    """The offline reference on the served flags' limits and their pinned kernel (FLAGS)."""
    from kiln.engine import LLM

    llm = LLM(model_dir, max_seq_len=256, max_input_len=128, num_kv_blocks=256, tactics="aten")
    yield llm
    llm.shutdown()


def expected(offline) -> list[str]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return [o.text for o in offline.generate(PROMPTS, params)]


def test_two_processes_pp2_serve_the_same_tokens_and_stop_together(model_dir, offline, tmp_path):
    port = free_port()
    dist = ["--pipeline-parallel-size", "2", "--world-size", "2", "--leader-address", f"127.0.0.1:{port}"]
    worker = start_worker(model_dir, tmp_path / "worker.log", "--rank", "1", *dist)
    leader = Server(["--model", str(model_dir)], tmp_path / "leader.log", *FLAGS, "--rank", "0", *dist, env=GROUP)
    try:
        leader.wait_ready(timeout=180)
        got = complete_all(leader.url)
        assert [c["text"] for c in got] == expected(offline)
        version = httpx.get(f"{leader.url}/version", timeout=10).json()
        assert version["engine_config"]["pipeline_parallel_size"] == 2
        assert leader.stop() == 0  # SIGTERM: drain, then tell the worker to stop
        assert worker.wait(60) == 0, (tmp_path / "worker.log").read_text()
    finally:
        stop(worker)
        leader.stop()


def test_four_processes_tp2_pp2_from_leaderworkerset_env(model_dir, offline, tmp_path):
    port = str(free_port())
    sizes = ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"]
    lws = {"LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_GROUP_SIZE": "4", "KILN_LEADER_PORT": port}
    workers = [start_worker(model_dir, tmp_path / f"worker{i}.log", *sizes, env={**lws, "LWS_WORKER_INDEX": str(i)})
               for i in (3, 1, 2)]
    leader = Server(["--model", str(model_dir)], tmp_path / "leader.log", *FLAGS, *sizes,
                    env={**GROUP, **lws, "LWS_WORKER_INDEX": "0"})
    try:
        leader.wait_ready(timeout=300)
        assert [c["text"] for c in complete_all(leader.url)] == expected(offline)
        assert leader.stop() == 0
        assert all(w.wait(60) == 0 for w in workers)
    finally:
        for w in workers:
            stop(w)
        leader.stop()


def test_a_killed_worker_fails_the_leaders_health_and_the_leader_exits(model_dir, tmp_path):
    port = free_port()
    dist = ["--pipeline-parallel-size", "2", "--world-size", "2", "--leader-address", f"127.0.0.1:{port}",
            "--distributed-timeout", "20"]
    worker = start_worker(model_dir, tmp_path / "worker.log", "--rank", "1", *dist)
    leader = Server(["--model", str(model_dir)], tmp_path / "leader.log", *FLAGS, "--rank", "0", *dist,
                    env={**GROUP, "KILN_GROUP_FAILURE_EXIT_SECONDS": "3"})
    try:
        leader.wait_ready(timeout=180)
        assert httpx.get(f"{leader.url}/health", timeout=5).status_code == 200
        worker.kill()
        worker.wait(10)
        killed = time.monotonic()
        health = 200
        while time.monotonic() - killed < 30 and health == 200:
            time.sleep(0.2)
            health = httpx.get(f"{leader.url}/health", timeout=5).status_code
        assert health == 503, leader.log()
        assert httpx.get(f"{leader.url}/ready", timeout=5).status_code == 503
        assert leader.proc.wait(30) == 1, leader.log()  # so the LeaderWorkerSet recreates the group
        assert time.monotonic() - killed < 40
    finally:
        stop(worker)
        leader.stop()


def test_a_worker_without_its_leader_exits_1_after_the_join_timeout(model_dir, tmp_path):
    worker = start_worker(model_dir, tmp_path / "worker.log", "--pipeline-parallel-size", "2", "--rank", "1",
                          "--world-size", "2", "--leader-address", f"127.0.0.1:{free_port()}", "--join-timeout", "3")
    try:
        assert worker.wait(90) == 1
        log = (tmp_path / "worker.log").read_text()
        assert "join_timeout_s" in log and "Traceback" not in log
    finally:
        stop(worker)


@pytest.mark.parametrize(("token", "message"), [
    ("another-token-0123456789", "rank 1 of 2 (leader 127.0.0.1:{port}): the leader refused this rank: its "
                                 "$KILN_GROUP_TOKEN differs from the leader's"),
    (None, "need $KILN_GROUP_TOKEN"),
])
def test_a_worker_without_the_groups_token_exits_1_in_one_line(token, message, model_dir, tmp_path):
    from kiln.engine import rendezvous

    port = free_port()
    leader_store = tcp_store(port)
    refused: list[Exception] = []

    def lead() -> None:  # rank 0's side of the rendezvous only: a refused rank never gets further
        try:
            rendezvous.rendezvous(leader_store, 0, 2, GROUP["KILN_GROUP_TOKEN"], time.monotonic() + 60)
        except TimeoutError as exc:
            refused.append(exc)
    threading.Thread(target=lead, daemon=True).start()
    worker = start_worker(model_dir, tmp_path / "worker.log", "--pipeline-parallel-size", "2", "--rank", "1",
                          "--world-size", "2", "--leader-address", f"127.0.0.1:{port}",
                          env={"KILN_GROUP_TOKEN": token})
    try:
        assert worker.wait(90) == 1
        log = (tmp_path / "worker.log").read_text()
        assert message.format(port=port) in log and "Traceback" not in log, log
        assert len([line for line in log.splitlines() if "KILN_GROUP_TOKEN" in line]) == 1, log
    finally:
        stop(worker)


def tcp_store(port: int):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=datetime.timedelta(seconds=60),
                         wait_for_workers=False)


def test_a_world_that_does_not_match_the_sizes_is_a_usage_error(model_dir, tmp_path):
    proc = start_worker(model_dir, tmp_path / "w.log", "--pipeline-parallel-size", "2", "--rank", "1",
                        "--world-size", "3", "--leader-address", "127.0.0.1:1")
    assert proc.wait(60) == 2
    assert "--world-size 3 must equal" in (tmp_path / "w.log").read_text()


# -- placement from flags and from a LeaderWorkerSet's environment ------------------------------
def test_placement_from_flags():
    p = resolve_placement(2, 4, "leader:1234", 29500, {})
    assert not p.is_leader
    assert p.engine_kwargs(2, 2) == {"distributed_address": "leader:1234", "rank_offset": 2, "local_ranks": 1}
    assert resolve_placement(0, 2, "10.0.0.1", 29500, {}).engine_kwargs(1, 2)["distributed_address"] == "10.0.0.1:29500"
    assert resolve_placement(None, None, None, 29500, {}) is None


def test_placement_from_leaderworkerset_env_one_stage_per_pod():
    env = {"LWS_LEADER_ADDRESS": "llm-0.llm.ns", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}
    p = resolve_placement(None, None, None, 29500, env)
    # T=4 GPUs per pod, P=2 pods: pod 1 hosts ranks 4..7 (stage 1).
    assert p.engine_kwargs(4, 2) == {"distributed_address": "llm-0.llm.ns:29500", "rank_offset": 4,
                                     "local_ranks": 4}
    assert resolve_placement(None, None, None, 29500, {**env, "LWS_WORKER_INDEX": "0"}).is_leader
    assert resolve_placement(None, None, None, 29500, {**env, "LWS_GROUP_SIZE": "1", "LWS_WORKER_INDEX": "0"}) is None


@pytest.mark.parametrize(("args", "env", "message"), [
    ((1, None, "h:1"), {}, "--world-size missing"),
    ((2, 2, "h:1"), {}, r"--rank 2 must be in \[0, --world-size 2\)"),
    ((0, 2, "h:x"), {}, "--leader-address must be HOST or HOST:PORT"),
    ((None, None, None), {"LWS_LEADER_ADDRESS": "h", "LWS_GROUP_SIZE": "two", "LWS_WORKER_INDEX": "0"},
     r"\$LWS_GROUP_SIZE must be an integer"),
    ((None, None, None), {"LWS_LEADER_ADDRESS": "h", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "2"},
     r"\$LWS_WORKER_INDEX 2 must be below"),
])
def test_placement_errors_name_the_flag_or_variable(args, env, message):
    with pytest.raises(click.UsageError, match=message):
        resolve_placement(*args, 29500, env)


def test_group_size_that_does_not_divide_the_ranks_names_the_fix():
    p = resolve_placement(None, None, None, 29500, {"LWS_LEADER_ADDRESS": "h", "LWS_GROUP_SIZE": "3",
                                                    "LWS_WORKER_INDEX": "1"})
    with pytest.raises(PlacementError, match="LWS_GROUP_SIZE 3 must divide"):
        p.engine_kwargs(2, 2)
