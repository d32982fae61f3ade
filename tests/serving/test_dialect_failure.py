"""A generation that fails after its stream started, through each SDK (in-process over ASGI, so the test can break
the engine's step): the Responses stream ends with ``error`` and ``response.failed`` (the Response failed, its
error named, the text so far), the Messages stream with Anthropic's ``error`` event, which the SDK raises."""

from __future__ import annotations

import anthropic
import httpx
import httpx2
import openai
import pytest
from kiln.serving.app import create_app
from kiln.serving.config import ServeConfig
from kiln.serving.server_state import READY


@pytest.fixture
async def asgi(model_dir):
    """The ready app, its engine's step failing from its third call on (each SDK wraps it in its own transport:
    openai's httpx, anthropic's httpx2)."""
    from kiln.engine import AsyncLLM

    app = create_app(ServeConfig(model=model_dir, served_model_name="tiny"))
    engine = AsyncLLM(model_dir, max_seq_len=256, num_kv_blocks=64)
    await engine.start()
    app.state.kiln.state.engine, app.state.kiln.state.phase = engine, READY
    step, calls = engine.engine.step, [0]

    def failing_step():
        calls[0] += 1
        if calls[0] > 2:
            raise RuntimeError("simulated device failure")
        return step()

    engine.engine.step = failing_step
    try:
        yield app
    finally:
        await engine.shutdown()


async def test_a_responses_stream_that_fails_ends_failed(asgi):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://kiln/v1") as http:
        client = openai.AsyncOpenAI(base_url="http://kiln/v1", api_key="unused", http_client=http, max_retries=0)
        stream = await client.responses.create(model="tiny", input="Hello there", max_output_tokens=50, stream=True)
        events = [event async for event in stream]
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2].code == "engine_dead" and "Traceback" not in events[-2].message
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert failed.error.message == events[-2].message
    texts = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert failed.output_text == texts
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://kiln/v1") as http:
        client = openai.AsyncOpenAI(base_url="http://kiln/v1", api_key="unused", http_client=http, max_retries=0)
        kept = await client.responses.retrieve(failed.id)  # stored as it stood
    assert kept.status == "failed" and kept.error.message == failed.error.message and kept.output_text == texts


async def test_a_messages_stream_that_fails_raises_in_the_sdk(asgi):
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=asgi), base_url="http://kiln") as http:
        client = anthropic.AsyncAnthropic(base_url="http://kiln", api_key="unused", http_client=http, max_retries=0)
        seen = []
        with pytest.raises(anthropic.APIStatusError) as info:
            async with client.messages.stream(model="tiny", max_tokens=50,
                                              messages=[{"role": "user", "content": "Hello there"}]) as stream:
                async for event in stream:
                    seen.append(event.type)
    assert seen[0] == "message_start"
    assert info.value.body["error"]["type"] == "api_error"
    assert "step loop failed" in info.value.body["error"]["message"]
