"""LoRA on a group started as separate processes (leader `kiln serve --rank 0`, worker `--rank 1`, as
LeaderWorkerSet pods are), and an adapter replaced under load.

The worker is a process that has no adapter files (reading one exits it, as a pod without them would fail):
it serves adapters with the weights rank 0 sends it. While streams run under the adapter and the base, the
adapter is unloaded and a new version loaded under its name (what the operator's adapter sync does when a
source changes). Seen by the user: every in-flight stream finishes whole, the group stays up (no exit, no
Traceback), requests after the swap answer from the new version, the base's answer never changes.
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
from conftest import REPO, measured
from netutil import free_port
from test_fault_rank_kill import FLAGS, GROUP, start, stop_all, wait_ready

sys.path.insert(0, str(REPO / "tests" / "engine"))
from lora_testlib import ATTN, MLP, make_adapter  # noqa: E402

# A worker pod: the kiln CLI, in a process where reading any adapter's files is an error.
PODLIKE = ("import sys\nfrom kiln.engine.lora import adapter\n"
           "def refuse(*a, **k):\n    raise SystemExit('the worker read an adapter file')\n"
           "adapter.read_adapter_files = adapter.load_adapter = refuse\n"
           "from kiln.cli import main\nsys.argv[0] = 'kiln'\nmain()\n")
LORA = ["--enable-lora", "--max-loras", "1", "--max-lora-rank", "8", "--max-cpu-loras", "2"]
MAX_TOKENS = 160


def start_podlike_worker(model_dir: Path, log: Path, *args: str) -> subprocess.Popen:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("LWS_", "KILN_"))}, "OMP_NUM_THREADS": "1",
           **GROUP}
    out = open(log, "wb")  # noqa: SIM115 - the process owns it
    return subprocess.Popen([sys.executable, "-P", "-c", PODLIKE, "serve", "--model", str(model_dir), *FLAGS, *args],
                            stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                            env={k: v for k, v in env.items() if v is not None})


def complete(url: str, model: str, prompt: str = "The kiln fires") -> str:
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8,
                                                  "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def stream(url: str, model: str, prompt: str, first_token: threading.Event) -> dict:
    """A stream to [DONE]: its tokens (the usage chunk), how it finished, any error event."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    tokens, error, done, finish = 0, None, False, None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[len("data: "):])
                error = event.get("error", error)
                tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
                finish = next((c["finish_reason"] for c in event.get("choices", []) if c.get("finish_reason")), finish)
                first_token.set()
    return {"model": model, "status": r.status_code, "tokens": tokens, "error": error, "finish": finish,
            "complete": done and error is None and finish == "length" and tokens == MAX_TOKENS}


def test_worker_rank_serves_adapters_and_an_adapter_replaced_under_load(toy_model, tmp_path):
    model_dir = toy_model("llama-tiny")
    v1 = make_adapter(model_dir, tmp_path / "one-v1", ATTN + MLP, 1)
    v2 = make_adapter(model_dir, tmp_path / "one-v2", MLP, 2)
    rendezvous, http = free_port(), free_port()
    dist = ["--tensor-parallel-size", "2", "--world-size", "2", "--leader-address", f"127.0.0.1:{rendezvous}", *LORA]
    worker = start_podlike_worker(model_dir, tmp_path / "worker.log", "--rank", "1", *dist)
    leader = start(model_dir, tmp_path / "leader.log", "--rank", "0", *dist, "--port", str(http),
                   "--allow-runtime-lora-updating", "--lora-modules", f"one={v1}")
    url, logs = f"http://127.0.0.1:{http}", [tmp_path / "leader.log", tmp_path / "worker.log"]
    try:
        wait_ready(url, leader, logs[0])
        base, before = complete(url, "tiny"), complete(url, "one")
        assert before != base
        first_token = threading.Event()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(stream, url, model, prompt, first_token) for model, prompt in (
                ("tiny", "fire and clay"), ("one", "clay and fire"), ("tiny", "a b c d e f"), ("one", "f e d c"))]
            assert first_token.wait(60), logs[0].read_text()
            time.sleep(0.5)  # the streams are mid-generation under the old version
            swap = time.monotonic()
            r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "one"}, timeout=30)
            assert r.status_code == 200, r.text
            r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "one", "lora_path": str(v2)}, timeout=30)
            assert r.status_code == 200, r.text
            after = complete(url, "one")
            swapped_s = time.monotonic() - swap
            results = [f.result(timeout=120) for f in streams]
        for result in results:
            assert result["complete"], result
        assert after not in (before, base) and complete(url, "one") == after and complete(url, "tiny") == base
        assert worker.poll() is None and leader.poll() is None
        for log in logs:
            assert "Traceback" not in log.read_text() and "adapter file" not in log.read_text(), log.read_text()
    finally:
        stop_all(worker, leader)
    measured("adapter replaced under load on a worker rank (tp2)", saw="every stream whole; the new version after",
             new_version_answers_within_s=round(swapped_s, 1), lost="nothing")
