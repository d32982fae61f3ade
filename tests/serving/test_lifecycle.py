"""Readiness during load, SIGTERM drain, API-key auth and backpressure, each on its own server."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

M = "tiny"
KEY = "sk-kiln-test-0123456789"
# The toy engine loads in a few tens of ms once its tokenizer has a record on the host (kiln.engine.light_tokenizer):
# these tests probe the server while it loads, so its tokenizer goes through transformers' import (0.5-1.5 s).
SLOW_LOAD = {"KILN_LIGHT_TOKENIZER": "0"}


def test_ready_only_after_load_then_sigterm_drains_in_flight_stream(start_server):
    srv = start_server("--max-seq-len", "512", "--drain-timeout", "60", env=SLOW_LOAD)
    srv.wait_listening()
    # The socket is bound before the engine loads: probes answer during the load.
    assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
    ready = httpx.get(f"{srv.url}/ready", timeout=10)
    assert ready.status_code == 503 and ready.json()["status"] == "loading"
    early = httpx.post(f"{srv.url}/v1/completions", json={"model": M, "prompt": "hi"}, timeout=10)
    assert early.status_code == 503 and early.json()["error"]["code"] == "not_ready"
    assert early.headers["retry-after"]
    srv.wait_ready()

    # 200 tokens: far longer than the checks below take, far shorter than the timeouts on a busy machine.
    payload = {"model": M, "prompt": "Drain me", "max_tokens": 200, "ignore_eos": True, "temperature": 0,
               "stream": True}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=payload, timeout=120) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        srv.proc.send_signal(signal.SIGTERM)
        # Draining: unready, new work refused, but the open stream carries on.
        for _ in range(100):
            if httpx.get(f"{srv.url}/ready", timeout=10).status_code == 503:
                break
        assert httpx.get(f"{srv.url}/ready", timeout=10).json()["status"] == "draining"
        refused = httpx.post(f"{srv.url}/v1/completions", json={"model": M, "prompt": "hi"}, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        rest = [line for line in lines if line.startswith("data: ")]
    events = [first, *rest]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert srv.proc.wait(timeout=120) == 0
    assert "drained; shutting down" in srv.log()


def test_sigterm_while_loading_exits_zero_promptly(start_server):
    srv = start_server(env=SLOW_LOAD)
    srv.wait_listening()
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(timeout=30) == 0
    assert "while loading; exiting" in srv.log()


def test_sigterm_drain_timeout_aborts_and_exits_zero(start_server):
    srv = start_server("--max-seq-len", "1024", "--drain-timeout", "0.2")
    srv.wait_ready()
    payload = {"model": M, "prompt": "Too long to wait for", "max_tokens": 1000, "ignore_eos": True,
               "stream": True}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=payload, timeout=60) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        srv.proc.send_signal(signal.SIGTERM)
        events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    finals = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finals[-1] == "abort"
    assert srv.proc.wait(timeout=30) == 0


@pytest.fixture(scope="module")
def guarded(start_server, tmp_path_factory):
    """A server with an API key and room for only two requests (1 running + 1 queued)."""
    key_file = tmp_path_factory.mktemp("key") / "api-key"
    key_file.write_text(KEY + "\n")
    srv = start_server("--api-key-file", str(key_file), "--max-batch-size", "1", "--max-queue-len", "1",
                       "--max-num-tokens", "64", "--max-seq-len", "1024")
    srv.wait_ready()
    return srv


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_auth(guarded):
    body = {"model": M, "prompt": "hi", "max_tokens": 2}
    for headers in ({}, auth("wrong"), {"Authorization": KEY}):
        response = httpx.post(f"{guarded.url}/v1/completions", json=body, headers=headers, timeout=30)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{guarded.url}/v1/models", timeout=30).status_code == 401
    assert (
        httpx.post(f"{guarded.url}/v1/completions", json=body, headers=auth(), timeout=30).status_code == 200
    )
    assert httpx.get(f"{guarded.url}/v1/models", headers=auth(), timeout=30).status_code == 200
    # Probes and metrics stay open for kubelet and Prometheus; /version tells what to attack, so it needs the key.
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{guarded.url}{path}", timeout=30).status_code == 200
    assert httpx.get(f"{guarded.url}/version", timeout=30).status_code == 401
    assert httpx.get(f"{guarded.url}/version", headers=auth(), timeout=30).status_code == 200
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):  # vLLM's, beside /v1
        assert httpx.post(f"{guarded.url}{path}", json=body, timeout=30).status_code == 401
        assert httpx.post(f"{guarded.url}{path}", json=body, headers=auth(), timeout=30).status_code == 200
    assert KEY not in guarded.log()


def test_backpressure_429_with_retry_after(guarded, scrape):
    long = {"model": M, "prompt": "Keep going", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60, headers=auth()) as http:
        with http.stream("POST", f"{guarded.url}/v1/completions", json=long) as first, \
                http.stream("POST", f"{guarded.url}/v1/completions", json=long) as second:
            # Both admitted (one running, one queued in the engine): the server is full.
            assert first.status_code == second.status_code == 200
            lines = first.iter_lines()  # keep a reference: a collected iterator closes the connection
            next(line for line in lines if line.startswith("data: "))
            refused = http.post(f"{guarded.url}/v1/completions", json={"model": M, "prompt": "hi"})
            assert refused.status_code == 429
            assert int(refused.headers["retry-after"]) >= 1
            error = refused.json()["error"]
            assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
            waiting = scrape(guarded.url)
            assert waiting[("kiln:num_requests_running", ())] == 1
            assert waiting[("kiln:num_requests_waiting", ())] == 1
        # Both clients left: their slots are released and new work is admitted again.
        for _ in range(50):
            ok = http.post(
                f"{guarded.url}/v1/completions", json={"model": M, "prompt": "hi", "max_tokens": 2}
            )
            if ok.status_code != 429:
                break
            time.sleep(0.1)
        assert ok.status_code == 200
    assert scrape(guarded.url)[("kiln:requests_rejected_total", (("reason", "queue_full"),))] >= 1
