"""LoRA adapters over the OpenAI API, vLLM's names (docs/lora.md).

A request picks an adapter with ``"model": NAME``; ``--lora-modules NAME=PATH`` (or vLLM's JSON form
``{"name", "path", "base_model_name"}``) registers adapters at start, and with
``--allow-runtime-lora-updating`` (or ``KILN_ALLOW_RUNTIME_LORA_UPDATING=1``) ``POST /v1/load_lora_adapter
{"lora_name", "lora_path"}`` and ``POST /v1/unload_lora_adapter {"lora_name"}`` change them at run time;
without it those routes do not exist (404, as vLLM). Adapters are read and checked in a worker thread, never
on the event loop. A bad adapter is a 400 naming why; one that would push host memory past
``--max-cpu-loras`` while every cached adapter is in use is a 429.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from kiln.serving.errors import APIError, parse_json_body

router = APIRouter()

ENV_ALLOW_UPDATING = "KILN_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed(flag: bool) -> bool:
    return flag or os.environ.get(ENV_ALLOW_UPDATING, "").strip().lower() in ("1", "true", "yes", "on")


def parse_lora_module(text: str) -> dict[str, Any]:
    """``NAME=PATH`` or a JSON object ``{"name": ..., "path": ..., "base_model_name": ...}`` (vLLM's forms)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--lora-modules {text!r}: not JSON: {exc}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("path"), str):
            raise ValueError(f"--lora-modules {text!r}: a JSON module needs string \"name\" and \"path\"")
        return {"name": obj["name"], "path": obj["path"], "base_model_name": obj.get("base_model_name")}
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: expected NAME=PATH or a JSON object")
    return {"name": name, "path": path, "base_model_name": None}


class LoRARegistry:
    """The adapters this server serves by name (what ``/v1/models`` lists), and their metrics."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.adapters: dict[str, Any] = {}  # name -> kiln.engine.lora.LoRARequest
        self._next_id = 0  # LoRARequest ids are never reused: an id names one adapter's weights
        self._lock = asyncio.Lock()

    def get(self, name: str) -> Any | None:
        return self.adapters.get(name)

    async def ensure_loaded(self, lora: Any) -> None:
        """The adapter in the engine's host memory, read in a worker thread if it was evicted (LRU). The read
        runs under the registry's lock, as ``add`` and ``remove`` do, and only while ``lora`` is still the
        adapter registered under its name: an unload (or an unload and a reload of a new version) between a
        request's lookup and its load never brings the old version back."""
        engine = self.ctx.state.engine
        if lora.lora_name in engine.list_loras():
            return
        async with self._lock:
            if self.adapters.get(lora.lora_name) is not lora:
                raise APIError(404, f"The lora adapter '{lora.lora_name}' was unloaded; list the adapters served "
                               "with GET /v1/models", param="model", code="model_not_found")
            if lora.lora_name not in engine.list_loras():
                await self._load(lora)

    async def _load(self, lora: Any) -> None:
        from kiln.engine.errors import RequestError

        started = time.monotonic()
        try:
            await self.ctx.state.engine.add_lora(lora)
        except RequestError as exc:
            status = 429 if exc.code == "lora_capacity" else 400
            raise APIError(status, str(exc), param=exc.param, code=exc.code or "invalid_lora_adapter",
                           headers={"Retry-After": "1"} if status == 429 else None) from None
        self.ctx.metrics.lora_loaded(time.monotonic() - started)

    async def add(self, name: str, path: str, base_model_name: str | None = None) -> None:
        from kiln.engine.lora import LoRARequest

        async with self._lock:
            if name in self.adapters or name in self.ctx.model_names:
                raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
            self._next_id += 1
            lora = LoRARequest(name, self._next_id, path, base_model_name)
            await self._load(lora)
            self.adapters[name] = lora

    async def remove(self, name: str) -> None:
        async with self._lock:
            if name not in self.adapters:
                raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                               code="model_not_found")
            del self.adapters[name]
            await self.ctx.state.engine.remove_lora(name)

    def cards(self, created: int, parent: str) -> list[dict[str, Any]]:
        return [{"id": name, "object": "model", "created": created, "owned_by": "kiln", "root": lora.lora_path,
                 "parent": lora.base_model_name or parent} for name, lora in self.adapters.items()]


def _body_field(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    return value if isinstance(value, str) and value else None


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> PlainTextResponse:
    ctx = request.app.state.kiln
    ctx.state.check_accepting()
    body = parse_json_body(await request.body())
    name, path = _body_field(body, "lora_name"), _body_field(body, "lora_path")
    if name is None or path is None:
        raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                       param="lora_name" if name is None else "lora_path")
    await ctx.loras.add(name, path)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    ctx = request.app.state.kiln
    ctx.state.check_accepting()
    body = parse_json_body(await request.body())
    name = _body_field(body, "lora_name")
    if name is None:
        raise APIError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", param="lora_name")
    await ctx.loras.remove(name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
