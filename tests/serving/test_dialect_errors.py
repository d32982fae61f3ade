"""The Messages and Responses APIs' errors over raw HTTP: Anthropic's shape on /v1/messages
(``{"type": "error", "error": {"type", "message"}}``), OpenAI's on /v1/responses, each naming the field and
the fix, with kiln's status codes (400, 401, 404, 413, 429 + Retry-After); the API key as a bearer token
or ``x-api-key``; requests counted by endpoint on /metrics."""

from __future__ import annotations

import httpx
import pytest

M = "tiny"
KEY = "sk-dialects"
MSG = {"model": M, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
RESP = {"model": M, "input": "hi", "max_output_tokens": 4}


@pytest.fixture(scope="module")
def guarded(start_server, tmp_path_factory):
    """A server with an API key and room for two requests (1 running + 1 queued)."""
    key_file = tmp_path_factory.mktemp("key") / "api-key"
    key_file.write_text(KEY + "\n")
    srv = start_server("--api-key-file", str(key_file), "--max-batch-size", "1", "--max-queue-len", "1",
                       "--max-num-tokens", "64", "--max-seq-len", "512", "--max-input-len", "400")
    srv.wait_ready()
    return srv


@pytest.fixture(scope="module")
def http(guarded):
    with httpx.Client(base_url=guarded.url, timeout=60, headers={"x-api-key": KEY}) as client:
        yield client


def _anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return body["error"]["message"]


@pytest.mark.parametrize(("patch", "says"), [
    ({"max_tokens": None}, "max_tokens is required"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]},
     "messages[0].content[0]"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tool_choice": {"type": "tool", "name": "f"}}, "tool_choice"),
    ({"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"stop_sequence": ["x"]}, "stop_sequence"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
    ({"tools": [{"name": "f", "input_schema": {"type": "wat"}}], "tool_choice": {"type": "tool", "name": "f"}},
     "tools[0].input_schema"),
    ({"messages": [{"role": "user", "content": "word " * 2000}]}, "messages is"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
      "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "any"}},
     "output_config.format and tool_choice"),
    ({"max_tokens": 5000}, "lower max_tokens to"),
])
def test_messages_bad_input_names_the_field(http, patch, says):
    body = {k: v for k, v in {**MSG, **patch}.items() if v is not None}
    message = _anthropic_error(http.post("/v1/messages", json=body), 400, "invalid_request_error")
    assert says in message and "response_format" not in message  # Anthropic's names, never chat's


def test_messages_take_the_sdk_s_top_level_cache_control_and_routing_hints(http):
    """The SDK's top-level ``cache_control`` (automatic caching), ``inference_geo`` and ``speed``: accepted, as
    the block-level ``cache_control`` is, and meaning nothing here (kiln's prefix cache needs no marker)."""
    extra = {"cache_control": {"type": "ephemeral"}, "inference_geo": "us", "speed": "standard"}
    assert http.post("/v1/messages", json={**MSG, **extra}).status_code == 200
    count = http.post("/v1/messages/count_tokens", json={"model": M, "messages": MSG["messages"], **extra})
    assert count.status_code == 200 and count.json()["input_tokens"] > 0
    _anthropic_error(http.post("/v1/messages", json={**MSG, "speed": "warp"}), 400, "invalid_request_error")


def test_messages_unknown_model_malformed_json_and_huge_body(http):
    assert "'nope'" in _anthropic_error(http.post("/v1/messages", json={**MSG, "model": "nope"}), 404, "not_found_error")
    _anthropic_error(http.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"}),
                     400, "invalid_request_error")
    _anthropic_error(http.post("/v1/messages/count_tokens", json={"model": M}), 400, "invalid_request_error")
    huge = b'{"model": "tiny", "messages": [], "pad": "' + b"x" * (17 * 2**20) + b'"}'
    _anthropic_error(http.post("/v1/messages", content=huge), 413, "request_too_large")


def test_messages_paths_kiln_lacks_answer_in_anthropic_s_shape_and_replies_carry_request_id(http):
    for method, path in (("POST", "/v1/messages/batches"), ("GET", "/v1/messages/batches/b1")):
        message = _anthropic_error(http.request(method, path, json=MSG), 404, "not_found_error")
        assert "/v1/messages/count_tokens" in message
    _anthropic_error(http.get("/v1/messages"), 405, "api_error")
    reply = http.post("/v1/messages", json=MSG)
    assert reply.headers["request-id"] == reply.headers["x-request-id"]  # the SDK's message._request_id


def test_the_key_goes_as_x_api_key_or_a_bearer_token(guarded):
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
        response = httpx.post(f"{guarded.url}/v1/messages", json=MSG, headers=headers, timeout=30)
        assert "x-api-key" in _anthropic_error(response, 401, "authentication_error")
        response = httpx.post(f"{guarded.url}/v1/responses", json=RESP, headers=headers, timeout=30)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    for headers in ({"x-api-key": KEY, "anthropic-version": "2023-06-01"}, {"Authorization": f"Bearer {KEY}"}):
        assert httpx.post(f"{guarded.url}/v1/messages", json=MSG, headers=headers, timeout=60).status_code == 200


@pytest.mark.parametrize(("patch", "param"), [
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"background": True}, "background"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"modle": M}, "modle"),
    ({"input": "word " * 2000}, "input"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "wat"}}],
      "tool_choice": {"type": "function", "name": "f"}}, "tools[0].parameters"),
    ({"instructions": "Be terse.", "input": [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{bad"}]}, "input[1].arguments"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0].arguments"),
    ({"text": {"format": {"type": "json_object"}}, "tools": [{"type": "function", "name": "f", "parameters": {}}],
      "tool_choice": "required"}, "tool_choice"),
    ({"include": ["message.output_text.logprobs", "output_text.everything"]}, "include[1]"),
    ({"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
])
def test_responses_bad_input_names_the_field(http, patch, param):
    response = http.post("/v1/responses", json={**RESP, **patch})
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["param"] == param and param.split("[")[0] in error["message"], response.text
    for chat_name in ("max_tokens", "response_format", "messages[", "function.arguments"):  # Responses' names only
        assert chat_name not in error["message"], response.text


def test_openai_fields_that_change_nothing_here_are_accepted(http):
    body = {**RESP, "include": ["reasoning.encrypted_content", "web_search_call.action.sources"],
            "prompt_cache_retention": "24h", "max_tool_calls": 2}
    response = http.post("/v1/responses", json=body)
    assert response.status_code == 200 and response.json()["status"] in ("completed", "incomplete"), response.text


def test_a_stored_response_is_not_replayed_as_a_stream(http):
    made = http.post("/v1/responses", json=RESP).json()
    response = http.get(f"/v1/responses/{made['id']}", params={"stream": "true"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream", response.text
    assert http.get(f"/v1/responses/{made['id']}", params={"stream": "false"}).json()["id"] == made["id"]


def test_unknown_response_ids_are_404(http):
    for method in ("GET", "DELETE"):
        response = http.request(method, "/v1/responses/resp_nothing")
        assert response.status_code == 404 and response.json()["error"]["code"] == "response_not_found"
        assert "another replica" in response.json()["error"]["message"]


def test_backpressure_is_429_with_retry_after_in_each_shape(http, scrape, guarded):
    # Two long chat streams fill the server (admission is one, whichever dialect asks).
    long = {"model": M, "prompt": "Keep going", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=long) as first, \
            http.stream("POST", "/v1/completions", json=long) as second:
        assert first.status_code == second.status_code == 200
        lines = first.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        refused = http.post("/v1/messages", json=MSG)
        assert int(refused.headers["retry-after"]) >= 1
        _anthropic_error(refused, 429, "rate_limit_error")
        refused = http.post("/v1/responses", json=RESP)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
    counts = scrape(guarded.url)
    for endpoint in ("/v1/messages", "/v1/responses"):
        assert counts[("kiln:endpoint_requests_total", (("endpoint", endpoint),))] >= 2


def test_the_translation_s_cost_is_counted_by_endpoint(http, scrape, guarded):
    """kiln:dialect_translation_seconds_total{endpoint} moves for each dialect's request, streamed and not
    (kiln bench --server --endpoints reads it)."""
    key = "kiln:dialect_translation_seconds_total"
    before = scrape(guarded.url)
    assert http.post("/v1/messages", json=MSG).status_code == 200
    with http.stream("POST", "/v1/responses", json={**RESP, "stream": True}) as stream:
        lines = list(stream.iter_lines())
        assert stream.status_code == 200 and any("response.incomplete" in line for line in lines), lines[-3:]
    after = scrape(guarded.url)
    for endpoint in ("/v1/messages", "/v1/responses"):
        series = (key, (("endpoint", endpoint),))
        assert after[series] > before.get(series, 0.0)
