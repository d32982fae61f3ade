"""Many concurrent streams, disconnects that free KV blocks, and /metrics that moves as expected."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import openai
from kiln.engine import SamplingParams

M = "tiny"
LONG_GEN = {"model": M, "prompt": "Tell me a long story", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True}


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def engine_idle(scrape, url):
    values = scrape(url)
    return values[("kiln:num_requests_running", ())] == 0 and values[("kiln:kv_cache_usage_perc", ())] == 0


def aborted(values) -> float:
    return values.get(("kiln:request_success_total", (("finished_reason", "abort"),)), 0.0)


async def test_64_concurrent_streaming_clients(server, offline):
    prompts = [f"Client number {i} says" for i in range(64)]
    tok = offline.tokenizer
    # Odd clients use completions (the prompt as is), even ones chat (the prompt through the template).
    engine_prompts = [
        p
        if i % 2
        else tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for i, p in enumerate(prompts)
    ]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [o.text for o in offline.generate(engine_prompts, params)]
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120,
                                http_client=None)

    async def one(i: int) -> tuple[str, str | None]:
        if i % 2:
            stream = await client.completions.create(model=M, prompt=prompts[i], max_tokens=6, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True})
            parts, reason = [], None
            async for chunk in stream:
                if chunk.choices:
                    parts.append(chunk.choices[0].text)
                    reason = chunk.choices[0].finish_reason or reason
            return "".join(parts), reason
        stream = await client.chat.completions.create(
            model=M, messages=[{"role": "user", "content": prompts[i]}], max_tokens=6, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        parts, reason = [], None
        async for chunk in stream:
            parts.append(chunk.choices[0].delta.content or "")
            reason = chunk.choices[0].finish_reason or reason
        return "".join(parts), reason

    results = await asyncio.gather(*(one(i) for i in range(64)))
    await client.close()
    assert all(reason == "length" for _, reason in results)
    assert [text for text, _ in results] == want


def test_disconnect_mid_stream_frees_blocks(server, scrape):
    before = scrape(server.url)
    with httpx.Client(timeout=30) as http:
        with http.stream(
            "POST", f"{server.url}/v1/completions", json={**LONG_GEN, "stream": True}
        ) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: "):
                    got += 1
                    if got == 3:
                        break
            running = scrape(server.url)
            assert running[("kiln:num_requests_running", ())] == 1
            assert running[("kiln:kv_cache_usage_perc", ())] > 0
        # Leaving the block closes the connection mid-stream.
    # 200 tokens would take seconds; the abort frees everything within a step or two.
    assert wait_for(lambda: engine_idle(scrape, server.url), timeout=5)
    assert aborted(scrape(server.url)) == aborted(before) + 1


def test_disconnect_during_non_streamed_request(server, scrape):
    before = scrape(server.url)
    body = json.dumps({**LONG_GEN, "max_tokens": 240}).encode()
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert wait_for(lambda: scrape(server.url)[("kiln:num_requests_running", ())] == 1, timeout=10)
    # The socket is closed with the request still generating: the server must notice and abort it.
    assert wait_for(lambda: aborted(scrape(server.url)) == aborted(before) + 1, timeout=5)
    assert wait_for(lambda: engine_idle(scrape, server.url), timeout=5)


def test_metrics_parse_and_counters_move(server, scrape):
    before = scrape(server.url)
    body = httpx.post(
        f"{server.url}/v1/completions",
        timeout=30,
        json={"model": M, "prompt": "Count the tokens", "max_tokens": 5, "ignore_eos": True},
    ).json()
    after = scrape(server.url)

    def delta(name, labels=()):
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    usage = body["usage"]
    assert delta("kiln:prompt_tokens_total") == usage["prompt_tokens"]
    assert delta("kiln:generation_tokens_total") == usage["completion_tokens"] == 5
    assert delta("kiln:request_success_total", (("finished_reason", "length"),)) == 1
    assert delta("kiln:time_to_first_token_seconds_count") == 1
    assert delta("kiln:e2e_request_latency_seconds_count") == 1
    assert delta("kiln:inter_token_latency_seconds_count") == 4
    assert delta("kiln:prefix_cache_queries_total") >= usage["prompt_tokens"]
    assert delta("kiln:iteration_batch_size_count") >= 5  # one prefill and four decode steps at least
    assert delta("kiln:iteration_batch_size_sum") >= 5
    assert after[("kiln:num_requests_waiting", ())] == 0
    for name in ("kiln:kv_cache_usage_perc", "kiln:num_requests_running", "kiln:prefix_cache_hits_total",
                 "kiln:request_queue_time_seconds_count"):
        assert any(key[0] == name for key in after), name


def test_same_prompt_twice_hits_the_prefix_cache(server, scrape):
    prompt = "A shared prefix that spans more than one block of sixteen tokens, " * 2
    payload = {"model": M, "prompt": prompt, "max_tokens": 1}
    httpx.post(f"{server.url}/v1/completions", json=payload, timeout=30)
    before = scrape(server.url)
    second = httpx.post(f"{server.url}/v1/completions", json=payload, timeout=30).json()
    after = scrape(server.url)
    hits = after[("kiln:prefix_cache_hits_total", ())] - before[("kiln:prefix_cache_hits_total", ())]
    assert hits > 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == hits


def test_sse_wire_format(server):
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=30,
                      json={"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                            "stream": True, "stream_options": {"include_usage": True}}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        request_id = response.headers["x-request-id"]
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(p["id"] == request_id for p in payloads)
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["total_tokens"] > 0
    assert payloads[-2]["choices"][0]["delta"] == {} and payloads[-2]["choices"][0]["finish_reason"]


def test_server_log_has_no_tracebacks(server):
    # Last in the suite's last module: disconnects, aborts and bad input above left no error behind.
    log = server.log()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
