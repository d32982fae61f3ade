"""Schemathesis drives the live server from its own OpenAPI schema (/openapi.json): bodies that fit
the schema and bodies that break it, on every operation. None may get a 5xx; afterwards the engine
is alive and holds no request and no KV block.

The case count is fixed (a derandomized Hypothesis run, so CI sees the same cases every time) and
bounded in time by a small --max-seq-len. Set KILN_FUZZ_EXAMPLES for a longer run.
"""

from __future__ import annotations

import os
import time
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

M = "tiny"
EXAMPLES = int(os.environ.get("KILN_FUZZ_EXAMPLES", "100"))  # per operation and mode


@pytest.fixture(scope="module")
def fuzz_server(start_server):
    srv = start_server("--max-seq-len", "32", "--max-input-len", "24", "--num-kv-blocks", "64",
                       "--max-batch-size", "8")
    srv.wait_ready()
    return srv


def _with_model(case: Any) -> Any:
    """Most generated bodies name our model, so they get past the 404 and into validation and the engine."""
    if isinstance(case.body, dict) and case.body.get("model") != M and hash(repr(sorted(case.body))) % 4:
        case.body["model"] = M
    return case


@pytest.mark.timeout(900)
def test_fuzz_openapi_schema(fuzz_server, scrape):
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/prefix_cache/keys", "/v1/models", "/health"} <= paths
    seen: dict[str, list[int]] = {}
    failures: list[str] = []

    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            strategy = operation.as_strategy(generation_mode=mode).map(_with_model)

            @given(case=strategy)
            @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            def run(case: Any) -> None:
                name = f"{case.operation.method.upper()} {case.operation.path}"
                response = case.call(base_url=fuzz_server.url, timeout=60)
                seen.setdefault(name, []).append(response.status_code)
                if response.status_code >= 500:
                    failures.append(f"{response.status_code} {name} {case.body!r:.300} -> {response.text[:300]}")

            try:
                run()
            except Unsatisfiable:  # no negative case exists for an operation that takes no input
                assert mode is GenerationMode.NEGATIVE and not operation.body, operation.path

    total = sum(len(codes) for codes in seen.values())
    print(f"\nfuzz: {total} cases; status codes per operation:")
    for name, codes in sorted(seen.items()):
        print(f"  {name}: {len(codes)} cases, " + ", ".join(f"{c}x{codes.count(c)}" for c in sorted(set(codes))))
    assert not failures, "5xx answers:\n" + "\n".join(failures[:10])
    assert total >= EXAMPLES * 2  # hypothesis may stop early on a small space, never at zero
    posts = seen.get("POST /v1/completions", []) + seen.get("POST /v1/chat/completions", [])
    assert 200 in posts, "no generated body reached the engine: the fuzz would only test validation"
    assert any(400 <= c < 500 for c in posts)

    assert httpx.get(f"{fuzz_server.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{fuzz_server.url}/ready", timeout=10).status_code == 200
    deadline = time.monotonic() + 30  # streams cut by a client that stopped reading end within steps
    while True:
        metrics = scrape(fuzz_server.url)
        idle = (metrics[("kiln:num_requests_running", ())], metrics[("kiln:num_requests_waiting", ())],
                metrics[("kiln:kv_cache_usage_perc", ())]) == (0, 0, 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle, metrics
