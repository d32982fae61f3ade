"""When the engine's step loop dies: streams get an error event, probes and new requests say 503.

Runs the app in-process over ASGI (no uvicorn) so the test can break the engine's step.
"""

from __future__ import annotations

import asyncio
import json

import httpx
from kiln.serving.app import create_app
from kiln.serving.config import ServeConfig
from kiln.serving.server_state import READY

BODY = {"model": "tiny", "prompt": "Hello there", "max_tokens": 50, "ignore_eos": True}


async def test_engine_loop_failure_is_reported_not_hidden(model_dir):
    from kiln.engine import AsyncLLM

    app = create_app(ServeConfig(model=model_dir, served_model_name="tiny"))
    ctx = app.state.kiln
    engine = AsyncLLM(model_dir, max_seq_len=256, num_kv_blocks=64)
    await engine.start()
    ctx.state.engine, ctx.state.phase = engine, READY
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://kiln", timeout=60) as client:
            assert (await client.post("/v1/completions", json={**BODY, "max_tokens": 2})).status_code == 200

            def broken_step():
                raise RuntimeError("simulated device failure")

            engine.engine.step = broken_step
            response = await client.post("/v1/completions", json={**BODY, "stream": True})
            assert response.status_code == 200
            events = [e for e in response.text.split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            error = json.loads(events[-2].removeprefix("data: "))["error"]
            assert error["type"] == "server_error" and "Traceback" not in error["message"]

            for _ in range(100):
                if not engine.is_running:
                    break
                await asyncio.sleep(0.05)
            assert (await client.get("/health")).status_code == 503
            ready = await client.get("/ready")
            assert ready.status_code == 503 and ready.json()["status"] == "engine_dead"
            refused = await client.post("/v1/completions", json=BODY)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"
            assert ctx.state.num_in_flight == 0
    finally:
        await engine.shutdown()
