"""Over HTTP (issue 31): slow grammar compiles fill only the compiler's own pool. A plain request, even one
big enough to be parsed off the event loop, is answered while they compile; a constrained request past the
pool's bound is a 429 at once, in OpenAI's error shape."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

M = "tiny"  # conftest.MODEL_NAME
LIMIT_S = 3.0
THREADS, QUEUE = 1, 6  # seven slow schemas fill the pool: more than the default executor's six threads
ASK = [{"role": "user", "content": "hi"}]


def slow_schema(n: int) -> dict:
    """~10 s to lower on a shared 2-core machine; ``n`` makes distinct cache keys."""
    return {"allOf": [{"anyOf": [{"type": "string", "pattern": f"^[a-z]*{chr(97 + i)}[a-z]*$", "maxLength": 50 + j + n}
                                 for i in range(8)]} for j in range(5)]}


def constrained(n: int) -> dict:
    return {"model": M, "messages": ASK, "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "slow", "schema": slow_schema(n)}}}


@pytest.fixture(scope="module")
def srv(start_server):
    s = start_server("--max-seq-len", "256", "--max-input-len", "128", "--num-kv-blocks", "256",
                     env={"KILN_GRAMMAR_COMPILE_TIMEOUT_S": str(LIMIT_S), "KILN_GRAMMAR_COMPILE_THREADS": str(THREADS),
                          "KILN_GRAMMAR_COMPILE_QUEUE": str(QUEUE)})
    s.wait_ready()
    return s


def test_slow_compiles_neither_stall_plain_requests_nor_queue_past_the_bound(srv):
    url = f"{srv.url}/v1/chat/completions"
    statuses: list[int] = []

    def send(n: int) -> None:
        statuses.append(httpx.post(url, json=constrained(n), timeout=60).status_code)

    senders = [threading.Thread(target=send, args=(n,)) for n in range(THREADS + QUEUE)]
    for t in senders:
        t.start()
    time.sleep(0.5)  # every one is in the compile pool now
    started = time.monotonic()
    # A body over routes._INLINE_BYTES is parsed and tokenized in a worker thread: not behind the compiles.
    plain = httpx.post(url, content=b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", '
                                    b'"content": "hi"}]}' + b" " * 70_000,
                       headers={"content-type": "application/json"}, timeout=60)
    assert plain.status_code == 200, plain.text
    assert time.monotonic() - started < 2.0
    busy = httpx.post(url, json=constrained(99), timeout=60)
    assert time.monotonic() - started < LIMIT_S - 0.5  # answered at once, while the pool is still full
    assert busy.status_code == 429, busy.text
    error = busy.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "grammar_compiler_busy"
    assert error["param"] == "response_format.json_schema" and "compile" in error["message"]
    assert int(busy.headers["Retry-After"]) >= 1
    for t in senders:
        t.join(timeout=60)
    # Each slow schema was stopped at the limit (400) or refused after waiting the whole limit (429).
    assert sorted(set(statuses)) <= [400, 429] and len(statuses) == THREADS + QUEUE
    assert "Traceback" not in srv.log()
