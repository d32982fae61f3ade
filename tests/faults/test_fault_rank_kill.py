"""A worker rank SIGKILLed while requests are in flight, in a 2-process CPU engine started as separate processes
(leader `kiln serve --rank 0`, worker `--rank 1`, as LeaderWorkerSet pods are).

The leader's /health and /ready answer 503 within seconds, every in-flight request ends (a streamed one with
an error event, a plain one with an error status) within a bound instead of hanging, no request is answered
as if it had finished, new requests get 503, and the leader exits 1 so that a LeaderWorkerSet recreates the
group. A new group then serves (the time to recover is from the fault's removal, starting the group again,
to its first completion).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import REPO, measured
from netutil import free_port

FLAGS = ["--max-seq-len", "256", "--max-input-len", "128", "--num-kv-blocks", "256", "--served-model-name", "tiny"]
GROUP = {"KILN_GROUP_TOKEN": "fault-suite-group-token-0123", "KILN_INSECURE_GROUP": None}
MAX_TOKENS = 220  # long enough to be mid-generation when the worker dies
BOUND_S = 30.0  # every in-flight request must have ended by then


def start(model_dir: Path, log: Path, *args: str, env: dict[str, str | None] | None = None) -> subprocess.Popen:
    merged = {**{k: v for k, v in os.environ.items() if not k.startswith(("LWS_", "KILN_"))},
              "OMP_NUM_THREADS": "1", **GROUP, **(env or {})}
    out = open(log, "wb")  # noqa: SIM115 - the process owns it
    return subprocess.Popen([sys.executable, "-P", "-m", "kiln", "serve", "--model", str(model_dir), *FLAGS, *args],
                            stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                            env={k: v for k, v in merged.items() if v is not None})


def status(url: str, path: str) -> int:
    try:
        return httpx.get(f"{url}{path}", timeout=5).status_code
    except httpx.TransportError:
        return -1


def wait_ready(url: str, leader: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while status(url, "/ready") != 200:
        assert leader.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)


def body(prompt: str, stream: bool) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def plain(url: str, prompt: str) -> dict:
    started = time.monotonic()
    try:
        r = httpx.post(f"{url}/v1/completions", json=body(prompt, False), timeout=BOUND_S)
    except httpx.TransportError as exc:
        return {"kind": "plain", "outcome": f"transport error {type(exc).__name__}", "s": time.monotonic() - started}
    finished = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length" and \
        r.json()["usage"]["completion_tokens"] == MAX_TOKENS
    return {"kind": "plain", "status": r.status_code, "complete": finished, "outcome": r.text[:300],
            "s": time.monotonic() - started}


def streamed(url: str, prompt: str, first_token) -> dict:
    """A stream: its chunks until [DONE], an error event, or the connection ending."""
    started = time.monotonic()
    tokens, error, done, status_code = 0, None, False, None
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body(prompt, True), timeout=BOUND_S) as r:
            status_code = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    error = event["error"]
                    continue
                tokens += 1
                first_token.set()
    except httpx.TransportError as exc:
        error = error or f"transport error {type(exc).__name__}"
    return {"kind": "stream", "status": status_code, "tokens": tokens, "done": done, "error": error,
            "complete": done and error is None and tokens >= MAX_TOKENS, "s": time.monotonic() - started}


def stop_all(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def start_group(model_dir: Path, tmp_path: Path, tag: str, sizes: list[str], *extra: str,
                env: dict[str, str | None] | None = None) -> tuple[subprocess.Popen, subprocess.Popen, str]:
    """Worker first (pods come up in any order), then the leader; returns (worker, leader, leader URL)."""
    rendezvous, http = free_port(), free_port()
    dist = [*sizes, "--world-size", "2", "--leader-address", f"127.0.0.1:{rendezvous}", *extra]
    worker = start(model_dir, tmp_path / f"worker{tag}.log", "--rank", "1", *dist)
    leader = start(model_dir, tmp_path / f"leader{tag}.log", "--rank", "0", *dist, "--port", str(http), env=env)
    return worker, leader, f"http://127.0.0.1:{http}"


@pytest.mark.parametrize(("layout", "recover"), [
    pytest.param("tp2", False, id="tp2"),
    pytest.param("tp2", True, id="tp2-and-restart", marks=pytest.mark.slow),
    pytest.param("pp2", True, id="pp2-and-restart", marks=pytest.mark.slow),
])
def test_worker_killed_mid_request_fails_every_request_and_the_probes_and_the_leader_exits_1(
        layout, recover, toy_model, tmp_path):
    model_dir = toy_model("llama-tiny")
    sizes = ["--tensor-parallel-size", "2"] if layout == "tp2" else ["--pipeline-parallel-size", "2"]
    worker, leader, url = start_group(model_dir, tmp_path, "", sizes, "--distributed-timeout", "20",
                                      env={"KILN_GROUP_FAILURE_EXIT_SECONDS": "3"})
    leader_log = tmp_path / "leader.log"
    try:
        wait_ready(url, leader, leader_log)
        first_token = threading.Event()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(plain, url, "The kiln fires"), pool.submit(plain, url, "Once upon a time"),
                       pool.submit(streamed, url, "fire and clay", first_token),
                       pool.submit(streamed, url, "a b c d e f", first_token)]
            assert first_token.wait(60), leader_log.read_text()
            time.sleep(0.3)  # a few steps into the batch
            worker.kill()
            killed = time.monotonic()
            worker.wait(10)
            health = ready = 200
            while time.monotonic() - killed < BOUND_S and 200 in (health, ready):
                health, ready = status(url, "/health"), status(url, "/ready")
                time.sleep(0.05)
            probes_503_s = time.monotonic() - killed
            assert (health, ready) == (503, 503), leader_log.read_text()
            results = [f.result(timeout=BOUND_S + 5) for f in futures]
        ended_s = max(r["s"] for r in results)
        for r in results:  # each one answered with an error, never a truncated "success", never a hang
            assert not r["complete"], r
            if r["kind"] == "plain":
                assert r["status"] == 503 and json.loads(r["outcome"])["error"]["code"] == "engine_dead", r
            else:  # the stream had started (200): an error event, then [DONE] as OpenAI streams end
                assert r["error"] is not None and r["error"]["code"] == "engine_dead", r
        assert ended_s < 10, results
        new = httpx.post(f"{url}/v1/completions", json=body("after", False), timeout=10)
        assert new.status_code == 503 and new.json()["error"]["code"] == "engine_dead", new.text
        assert leader.wait(30) == 1, leader_log.read_text()  # so that a LeaderWorkerSet recreates the group
        exited_s = time.monotonic() - killed
        log = leader_log.read_text()
        assert "Traceback" not in log, log
    finally:
        stop_all(worker, leader)
    facts = {"probes_503_within_s": round(probes_503_s, 1), "requests_ended_within_s": round(ended_s, 1),
             "saw": sorted({f"{r['kind']}: {r.get('status')} {'error event ' if r['kind'] == 'stream' else ''}"
                            "engine_dead" for r in results}),
             "leader_exit": 1, "leader_exit_after_s": round(exited_s, 1),
             "lost": "nothing silently: every in-flight request got an engine_dead error"}
    if recover:  # the LeaderWorkerSet's answer: the whole group started again; seconds to its first completion
        restarted = time.monotonic()
        worker, leader, url = start_group(model_dir, tmp_path, "-2", sizes)
        try:
            wait_ready(url, leader, tmp_path / "leader-2.log")
            r = httpx.post(f"{url}/v1/completions", json={**body("again", False), "max_tokens": 4}, timeout=60)
            assert r.status_code == 200, r.text
            facts["recover_s"] = round(time.monotonic() - restarted, 1)
        finally:
            stop_all(worker, leader)
    measured(f"worker rank SIGKILL mid-request ({layout})", **facts)
