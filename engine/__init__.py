"""Imported as ``kiln.engine`` (folder ``engine/``): the kiln runtime: paged KV cache, in-flight
batching, Llama-family models. It imports nothing else of kiln (docs/architecture.md).

Imports are lazy so that ``import kiln.engine.random_checkpoint`` or the sampling params do
not pull torch and the model code in.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "LLM": "kiln.engine.llm",
    "AsyncLLM": "kiln.engine.async_llm",
    "SamplingParams": "kiln.engine.sampling_params",
    "RequestOutput": "kiln.engine.outputs",
    "StreamDelta": "kiln.engine.outputs",
    "EngineStats": "kiln.engine.outputs",
    "EngineConfig": "kiln.engine.config",
    "RequestError": "kiln.engine.errors",
    "ConfigError": "kiln.engine.errors",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kiln.engine' has no attribute {name!r}")
