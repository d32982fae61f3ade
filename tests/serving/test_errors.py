"""Bad input gets OpenAI error JSON with the right status and the parameter named; never a 500."""

from __future__ import annotations

import httpx
import pytest

M = "tiny"
USER = [{"role": "user", "content": "hi"}]
LONG = "word " * 300  # over --max-input-len 128

COMPLETION_CASES = [
    ({"model": M}, 400, "prompt"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ({"model": M, "prompt": ""}, 400, "prompt"),
    ({"model": M, "prompt": []}, 400, "prompt"),
    ({"model": M, "prompt": LONG}, 400, "prompt"),
    ({"model": M, "prompt": [5, 10**7]}, 400, "prompt"),
    ({"model": M, "prompt": "hi", "max_tokens": 1000}, 400, "max_tokens"),
    ({"model": M, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": M, "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": M, "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ({"model": M, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"model": M, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"model": M, "prompt": "hi", "top_k": -5}, 400, "top_k"),
    ({"model": M, "prompt": "hi", "n": 0}, 400, "n"),
    ({"model": M, "prompt": "hi", "n": 1000}, 400, "n"),
    ({"model": M, "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"model": M, "prompt": "hi", "stop": [""]}, 400, "stop[0]"),
    ({"model": M, "prompt": "hi", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens"),
    ({"model": M, "prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    ({"model": M, "prompt": "hi", "logit_bias": {"999999": 10}}, 400, "logit_bias"),
    ({"model": M, "prompt": "hi", "suffix": "end"}, 400, "suffix"),
    ({"model": M, "prompt": "hi", "max_token": 5}, 400, "max_token"),
    (
        {"model": M, "prompt": "hi", "stream_options": {"include_usage": "y"}},
        400,
        "stream_options.include_usage",
    ),
]

CHAT_CASES = [
    ({"model": M}, 400, "messages"),
    ({"model": M, "messages": []}, 400, "messages"),
    ({"model": "gpt-4", "messages": USER}, 404, "model"),
    ({"model": M, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ({"model": M, "messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    (
        {
            "model": M,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        },
        400,
        "messages[0].content",
    ),
    ({"model": M, "messages": USER, "max_completion_tokens": 1000}, 400, "max_completion_tokens"),
    ({"model": M, "messages": USER, "temperature": -1}, 400, "temperature"),
    # Constrained output: each refusal names the field the client sent (tests/serving/test_structured.py
    # has the ones that need the grammar engine's verdict).
    ({"model": M, "messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     400, "response_format.json_schema"),
    ({"model": M, "messages": USER, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    ({"model": M, "messages": USER, "tool_choice": "required"}, 400, "tool_choice"),
    ({"model": M, "messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice.function.name"),
    ({"model": M, "messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}] * 2}, 400, "tools"),
    ({"model": M, "messages": USER, "tools": [{"type": "function", "function": {"name": f"f{i}"}}
                                              for i in range(129)]}, 400, "tools"),
    ({"model": M, "messages": USER, "functions": [{"name": "f"}]}, 400, "functions"),
    ({"model": M, "messages": USER, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"model": M, "messages": USER, "response_format": {"type": "json_object"},
      "structured_outputs": {"regex": "a+"}}, 400, "structured_outputs"),
    ({"model": M, "messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    ({"model": M, "messages": USER, "logprobs": 3}, 400, "logprobs"),
]


def assert_openai_error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param
    if param:
        assert param.split("[")[0].split(".")[0] in error["message"]
    assert "Traceback" not in response.text
    return error


@pytest.mark.parametrize(("body", "status", "param"), COMPLETION_CASES)
def test_completion_bad_input(server, body, status, param):
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert_openai_error(response, status, param)


@pytest.mark.parametrize(("body", "status", "param"), CHAT_CASES)
def test_chat_bad_input(server, body, status, param):
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert_openai_error(response, status, param)


@pytest.mark.parametrize("raw", [b"{bad json", b"", b"[1, 2]", b"\xff\xfe", b'"just a string"'])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_malformed_body_is_400(server, raw, path):
    response = httpx.post(f"{server.url}{path}", content=raw, headers={"content-type": "application/json"},
                          timeout=30)
    error = assert_openai_error(response, 400, None)
    assert error["code"] == "invalid_json"


def test_unknown_path_and_method(server):
    assert_openai_error(httpx.get(f"{server.url}/v1/nothing", timeout=30), 404, None)
    assert_openai_error(httpx.get(f"{server.url}/v1/completions", timeout=30), 405, None)
    assert_openai_error(httpx.get(f"{server.url}/v1/models/gpt-4", timeout=30), 404, "model")


def test_errors_leave_the_server_healthy(server):
    # After every bad input above, a good request still works and nothing leaked a slot.
    response = httpx.post(f"{server.url}/v1/completions", json={"model": M, "prompt": "hi", "max_tokens": 2},
                          timeout=30)
    assert response.status_code == 200
    assert "Traceback" not in server.log()


def test_oversized_body_is_413_and_huge_prompt_is_400(server):
    huge = b'{"model": "tiny", "prompt": "' + b"x" * (17 * 2**20) + b'"}'
    response = httpx.post(f"{server.url}/v1/completions", content=huge, timeout=60,
                          headers={"content-type": "application/json"})
    assert_openai_error(response, 413, None)
    # Under the body cap but far over max_input_len: tokenized off the event loop, then refused.
    response = httpx.post(f"{server.url}/v1/completions", timeout=60,
                          json={"model": M, "prompt": "hello " * 20000, "max_tokens": 2})
    assert_openai_error(response, 400, "prompt")
    assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}
