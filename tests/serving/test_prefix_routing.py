"""A router's view of the prefix cache matches the engine's: keys computed on the client side
from the documented scheme (docs/prefix-routing.md, written out here with hashlib, not imported
from kiln) predict exactly how many prompt tokens each request finds cached."""

from __future__ import annotations

import hashlib
import random
import struct

import httpx

M = "tiny"


def client_keys(ids: list[int], block_size: int) -> list[bytes]:
    """kiln-prefix-v1, as a router would implement it from the docs."""
    keys, parent = [], hashlib.sha256(b"kiln-prefix-v1").digest()
    for i in range(len(ids) // block_size):
        block = ids[i * block_size:(i + 1) * block_size]
        parent = hashlib.sha256(parent + struct.pack(f"<{block_size}I", *block)).digest()
        keys.append(parent)
    return keys


def predicted_hit(ids: list[int], cached: set[bytes], block_size: int) -> int:
    usable = client_keys(ids, block_size)[: (len(ids) - 1) // block_size]  # the last token is computed
    hits = 0
    for key in usable:
        if key not in cached:
            break
        hits += 1
    return hits * block_size


def test_client_side_keys_predict_engine_hits(server, scrape):
    info = httpx.get(f"{server.url}/v1/prefix_cache", timeout=10).json()
    assert info["scheme"] == "kiln-prefix-v1" and info["enabled"]
    size = info["block_size"]
    metrics = scrape(server.url)
    config = [labels for (name, labels) in metrics if name == "vllm:cache_config_info"]
    assert config and dict(config[0])["block_size"] == str(size)

    rng = random.Random(7)
    vocab = 1000  # within the toy model's vocabulary
    stems = [[rng.randrange(5, vocab) for _ in range(3 * size + 5)] for _ in range(3)]
    prompts = []
    for _ in range(12):  # prompts sharing 0..3 blocks of a stem, plus a random tail
        stem = rng.choice(stems)
        shared = rng.randrange(0, 4) * size + rng.randrange(0, size)
        prompts.append(stem[:shared] + [rng.randrange(5, vocab) for _ in range(rng.randrange(1, 2 * size))])
    cached: set[bytes] = set()
    predictions, actual = [], []
    for ids in prompts:
        keys = httpx.post(f"{server.url}/v1/prefix_cache/keys", json={"model": M, "prompt": ids}, timeout=10)
        assert keys.status_code == 200, keys.text
        assert keys.json()["keys"] == [k.hex() for k in client_keys(ids, size)[: (len(ids) - 1) // size]]
        predictions.append(predicted_hit(ids, cached, size))
        # max_tokens 1: the sampled token is never fed back, so exactly the prompt's full blocks get cached.
        out = httpx.post(f"{server.url}/v1/completions", json={"model": M, "prompt": ids, "max_tokens": 1},
                         timeout=60)
        assert out.status_code == 200, out.text
        actual.append(out.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        cached.update(client_keys(ids, size))
    assert predictions == actual
    assert sum(1 for p in predictions if p) >= 3  # the sequence really exercises hits


def test_keys_of_a_conversation_use_the_chat_template(server):
    messages = [{"role": "user", "content": "Tell me about kilns " * 8}]
    keys = httpx.post(f"{server.url}/v1/prefix_cache/keys", json={"model": M, "messages": messages}, timeout=10)
    assert keys.status_code == 200, keys.text
    body = keys.json()
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={"model": M, "messages": messages, "max_tokens": 1},
                      timeout=60).json()
    assert body["num_prompt_tokens"] == chat["usage"]["prompt_tokens"]
    bad = httpx.post(f"{server.url}/v1/prefix_cache/keys", json={"model": M}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"


def salted_keys(ids: list[int], block_size: int, salt: str) -> list[bytes]:
    """A cache_salt salts the root (docs/prefix-routing.md): SHA-256(root || 0 "salt" 0 || salt)."""
    keys = []
    parent = hashlib.sha256(hashlib.sha256(b"kiln-prefix-v1").digest() + b"\x00salt\x00" + salt.encode()).digest()
    for i in range(len(ids) // block_size):
        parent = hashlib.sha256(parent + struct.pack(f"<{block_size}I", *ids[i * block_size:(i + 1) * block_size])).digest()
        keys.append(parent)
    return keys


def test_cache_salt_keeps_tenants_apart_on_both_endpoints(server):
    """vLLM's cache_salt: a tenant's prompt is a hit only for requests with the same salt, so cached_tokens (and
    latency) tell no other tenant whether it is cached."""
    size = httpx.get(f"{server.url}/v1/prefix_cache", timeout=10).json()["block_size"]
    ids = [random.Random(11).randrange(5, 1000) for _ in range(3 * size + 1)]

    def cached(salt: str | None, chat: bool = False) -> int:
        body = {"model": M, "max_tokens": 1, **({"cache_salt": salt} if salt else {})}
        if chat:
            body["messages"] = [{"role": "user", "content": "kilns and salts " * 10}]
        else:
            body["prompt"] = ids
        r = httpx.post(f"{server.url}/v1/{'chat/completions' if chat else 'completions'}", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("tenant-a") == 0 and cached("tenant-a") == 3 * size
    assert cached("tenant-b") == 0 and cached(None) == 0
    assert cached("tenant-a", chat=True) == 0 and cached("tenant-b", chat=True) == 0
    assert cached("tenant-a", chat=True) > 0
    keys = httpx.post(f"{server.url}/v1/prefix_cache/keys", json={"model": M, "prompt": ids, "cache_salt": "t"},
                      timeout=10).json()["keys"]
    assert keys == [k.hex() for k in salted_keys(ids, size, "t")[:3]]
    bad = httpx.post(f"{server.url}/v1/completions", json={"model": M, "prompt": ids, "cache_salt": ""}, timeout=10)
    assert bad.status_code == 400 and "cache_salt" in bad.text


WEATHER_TOOL = {"name": "get_weather", "description": "Weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def _keys(server, endpoint: str, body: dict) -> dict:
    r = httpx.post(f"{server.url}/v1/prefix_cache/keys", params={"endpoint": endpoint}, json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_keys_of_messages_and_responses_bodies_are_the_blocks_those_endpoints_reuse(server):
    """A router forwards the body a client sent to /v1/messages or /v1/responses with ?endpoint=: the keys are
    that request's (system, tools and instructions rendered as the endpoint renders them), so a repeat of the
    request reads exactly those blocks from the cache."""
    messages = {"model": M, "max_tokens": 1, "system": "You are a kiln expert.",
                "messages": [{"role": "user", "content": [{"type": "text", "text": "How hot is a kiln? " * 2}]}]}
    tools = {**messages, "tools": [WEATHER_TOOL], "tool_choice": {"type": "auto"}}  # over max_input_len: counted
    counted = httpx.post(f"{server.url}/v1/messages/count_tokens", json={k: v for k, v in tools.items()
                                                                         if k != "max_tokens"}, timeout=30)
    assert _keys(server, "/v1/messages", tools)["num_prompt_tokens"] == counted.json()["input_tokens"]
    keys = _keys(server, "/v1/messages", messages)
    size = keys["block_size"]

    def post(path: str) -> dict:
        r = httpx.post(f"{server.url}{path}", json=messages if path == "/v1/messages" else responses, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    first, again = post("/v1/messages")["usage"], post("/v1/messages")["usage"]
    assert keys["num_prompt_tokens"] == first["input_tokens"] + first["cache_read_input_tokens"]
    assert again["cache_read_input_tokens"] == len(keys["keys"]) * size > 0

    responses = {"model": M, "max_output_tokens": 1, "instructions": "Answer in French. " * 3,
                 "input": [{"role": "user", "content": [{"type": "input_text", "text": "Why glaze pots? " * 3}]}]}
    keys = _keys(server, "/v1/responses", responses)
    made, again = post("/v1/responses"), post("/v1/responses")["usage"]
    assert keys["num_prompt_tokens"] == made["usage"]["input_tokens"]
    assert again["input_tokens_details"]["cached_tokens"] == len(keys["keys"]) * size > 0
    follow = {"model": M, "max_output_tokens": 1, "previous_response_id": made["id"], "input": "And then?"}
    keys = _keys(server, "/v1/responses", follow)  # the conversation stored on this replica comes first
    assert keys["num_prompt_tokens"] == httpx.post(f"{server.url}/v1/responses", json=follow,
                                                   timeout=60).json()["usage"]["input_tokens"]


def test_keys_of_a_dialect_body_refuse_in_its_own_fields(server):
    url = f"{server.url}/v1/prefix_cache/keys"
    bad = httpx.post(url, params={"endpoint": "/v1/messages"},
                     json={"model": M, "messages": [{"role": "user", "content": "hi"}]}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens", bad.text
    gone = httpx.post(url, params={"endpoint": "/v1/responses"},
                      json={"model": M, "input": "x", "previous_response_id": "resp_0"}, timeout=10)
    assert gone.status_code == 400 and gone.json()["error"]["param"] == "previous_response_id"
    other = httpx.post(url, params={"endpoint": "/v1/embeddings"}, json={"model": M, "input": "x"}, timeout=10)
    assert other.status_code == 400 and other.json()["error"]["param"] == "endpoint"
    assert "/v1/messages" in other.json()["error"]["message"]
