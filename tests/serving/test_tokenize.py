"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` on the shared server: a prompt and a conversation come back
as the ids the generating endpoints run (a chat request's ``usage.prompt_tokens``, a completion's echoed prompt
logprobs), with the template's variables and tools; ids go back to text; bad input is a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

M = "tiny"
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three rivers."}]
TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a river up",
                                         "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def _post(http, path, body, status=200):
    response = http.post(path, json=body)
    assert response.status_code == status, response.text
    return response.json()


def test_a_prompt_is_its_encoding_with_or_without_special_tokens(http, tok):
    text = "The quick brown fox"
    got = _post(http, "/tokenize", {"model": M, "prompt": text, "return_token_strs": True})
    assert got["tokens"] == tok.encode(text) and got["count"] == len(got["tokens"]) and got["max_model_len"] == 256
    assert got["token_strs"] == tok.convert_ids_to_tokens(got["tokens"])
    bare = _post(http, "/tokenize", {"prompt": text, "add_special_tokens": False})  # model may be left out
    assert bare["tokens"] == tok.encode(text, add_special_tokens=False) and "token_strs" not in bare
    echoed = _post(http, "/v1/completions", {"model": M, "prompt": text, "max_tokens": 1, "echo": True,
                                            "logprobs": 0, "temperature": 0})
    assert len(echoed["choices"][0]["logprobs"]["tokens"]) == got["count"] + 1  # the prompt's, then the new one


def test_a_conversation_is_what_chat_completions_runs(http, tok):
    for extra in ({}, {"add_generation_prompt": False}):
        got = _post(http, "/tokenize", {"model": M, "messages": ASK, **extra})
        chat = _post(http, "/v1/chat/completions", {"model": M, "messages": ASK, "max_tokens": 1, **extra})
        assert got["count"] == len(got["tokens"]) == chat["usage"]["prompt_tokens"], extra
    # With tools the prompt outgrows this engine's max_input_len (128): /tokenize counts it all the same, and the
    # chat request's refusal names the same length.
    got = _post(http, "/tokenize", {"model": M, "messages": ASK, "tools": [TOOL]})
    refused = _post(http, "/v1/chat/completions", {"model": M, "messages": ASK, "tools": [TOOL]}, 400)["error"]
    assert got["count"] > 128 and f"messages is {got['count']} tokens long" in refused["message"]
    plain = _post(http, "/tokenize", {"messages": ASK})["tokens"]
    rendered = tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)
    assert plain == tok.encode(rendered, add_special_tokens=False)


def test_detokenize_gives_the_text_back(http, tok):
    ids = tok.encode("Rivers run to the sea", add_special_tokens=False)
    assert _post(http, "/detokenize", {"model": M, "tokens": ids}) == {"prompt": tok.decode(ids)}
    assert _post(http, "/detokenize", {"tokens": []}) == {"prompt": ""}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"model": "nope", "prompt": "x"}, "model"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/tokenize", {"messages": ASK, "add_special_tokens": True}, "add_special_tokens"),
    ("/tokenize", {"messages": ASK, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ("/detokenize", {"tokens": [0, 10**9]}, "tokens[1]"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
])
def test_bad_input_names_the_field(http, path, body, param):
    status = 404 if param == "model" else 400
    error = _post(http, path, body, status)["error"]
    assert error["param"].startswith(param), error
