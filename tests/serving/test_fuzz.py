"""Schemathesis drives the live server from its own OpenAPI schema (/openapi.json): bodies that fit
the schema and bodies that break it, on every operation. None may get a 5xx; afterwards the engine
is alive and holds no request and no KV block.

The case count is fixed (a derandomized Hypothesis run, so CI sees the same cases every time) and
bounded in time by a small --max-seq-len. Set KILN_FUZZ_EXAMPLES for a longer run.
"""

from __future__ import annotations

import os
import time
import zlib
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
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
    """Most generated bodies name our model, so they get past the 404 and into validation and the engine.
    Chosen by a stable hash: Python's own str hash changes per process, which made the cases differ per run."""
    if isinstance(case.body, dict) and case.body.get("model") != M and zlib.crc32(repr(sorted(case.body)).encode()) % 4:
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


# Constrained output: schemas, regexes, grammars and tools made of arbitrary (mostly schema-like) JSON and
# text. The OpenAPI schema types them as free-form objects and strings, so the fuzz above rarely builds a
# meaningful one; here every body carries one, and the grammar engine's verdict must be a 200 or a 400.
_KEYS = st.sampled_from(["type", "properties", "items", "required", "enum", "const", "anyOf", "oneOf", "allOf",
                         "$ref", "$defs", "minLength", "maxLength", "pattern", "format", "minimum", "maximum",
                         "additionalProperties", "prefixItems", "not", "a", "b"])
_JSON = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.sampled_from(
    ["object", "array", "string", "integer", "number", "boolean", "null", "#/$defs/a", "[a-z]+", "date-time"])
    | st.text(max_size=6), lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEYS, inner, max_size=4),
    max_leaves=16)
_CONSTRAINT = st.one_of(
    st.builds(lambda s, strict: {"response_format": {"type": "json_schema", "json_schema": {
        "name": "f", "schema": s, "strict": strict}}}, st.dictionaries(_KEYS, _JSON, max_size=4), st.booleans()),
    st.just({"response_format": {"type": "json_object"}}),
    st.builds(lambda r: {"structured_outputs": {"regex": r}}, st.text(max_size=12)),
    st.builds(lambda g: {"structured_outputs": {"grammar": g}}, st.text(max_size=30) | st.just('start: "a" | b')),
    st.builds(lambda c: {"guided_choice": c}, st.lists(st.text(max_size=5), max_size=3)),
    st.builds(lambda j: {"guided_json": j}, _JSON),
)
_TOOLS = st.builds(lambda params, choice: {"tools": [{"type": "function", "function": {"name": "f", "parameters": params}}],
                                           "tool_choice": choice},
                   st.dictionaries(_KEYS, _JSON, max_size=4),
                   st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]))


@pytest.mark.timeout(600)
def test_fuzz_constrained_output(fuzz_server, scrape):
    codes: list[int] = []
    failures: list[str] = []

    @given(extra=st.one_of(_CONSTRAINT, _TOOLS), chat=st.booleans(), stream=st.booleans())
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(extra: dict, chat: bool, stream: bool) -> None:
        chat = chat or "tools" in extra
        body = {"model": M, "max_tokens": 4, "stream": stream, **extra,
                **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        response = httpx.post(f"{fuzz_server.url}{path}", json=body, timeout=60)
        codes.append(response.status_code)
        if response.status_code not in (200, 400) or "Traceback" in response.text or (
                stream and response.status_code == 200 and "server_error" in response.text):
            failures.append(f"{response.status_code} {body!r:.300} -> {response.text[:300]}")

    run()
    print(f"\nconstrained fuzz: {len(codes)} cases, " + ", ".join(f"{c}x{codes.count(c)}" for c in sorted(set(codes))))
    assert not failures, "\n".join(failures[:10])
    assert 200 in codes and 400 in codes
    assert "Traceback" not in fuzz_server.log()
    assert httpx.get(f"{fuzz_server.url}/ready", timeout=10).status_code == 200
