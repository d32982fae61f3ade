"""The one table from the spec to the engine's settings: which spec field becomes which ``LLM(...)`` keyword.

``engine.json``'s ``engine_config`` is the keyword arguments of ``kiln.engine.LLM`` (the fields of
:class:`kiln.engine.config.EngineConfig`). Each row of :data:`ENGINE_SETTINGS` names a spec attribute
path, the ``EngineConfig`` field it sets and, where the runtime takes another form, the transform;
a row without a spec path is set by the build itself (the planned KV pool, the tuned CUDA-graph
buckets). :func:`engine_config` reads the table in order, so ``engine.json`` lists the settings in it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from kiln.builder.sizing import parallel_degree
from kiln.engine.config import EngineConfig, canonical_quantization

DEFAULTS = {f.name: f.default for f in fields(EngineConfig)}

# (spec attribute path, or None where the build sets it; EngineConfig field; transform or None)
ENGINE_SETTINGS: tuple[tuple[str | None, str, Callable[[Any], Any] | None], ...] = (
    ("dtype", "dtype", None),
    ("quantization", "quantization", canonical_quantization),  # "none" -> None
    ("kv_cache_dtype", "kv_cache_dtype", None),
    ("tensor_parallel", "tensor_parallel_size", None),
    ("pipeline_parallel", "pipeline_parallel_size", parallel_degree),
    ("max_batch_size", "max_batch_size", None),
    ("max_input_len", "max_input_len", None),
    ("max_seq_len", "max_seq_len", None),
    ("max_num_tokens", "max_num_tokens", None),
    ("kv.block_size", "block_size", None),
    ("kv.enable_prefix_caching", "enable_prefix_caching", None),
    (None, "num_kv_blocks", None),  # the KV plan's pool (kiln.builder.kv_plan)
    ("kv.memory_fraction", "kv_memory_fraction", None),
    (None, "cuda_graph_batch_sizes", None),  # the tune stage's buckets; None: the runtime's defaults
    ("lora", "enable_lora", lambda lora: lora is not None),
    ("lora.max_loras", "max_loras", lambda n: n or DEFAULTS["max_loras"]),  # no spec.lora: the runtime's default
    ("lora.max_lora_rank", "max_lora_rank", lambda r: r or DEFAULTS["max_lora_rank"]),
    ("lora.max_cpu_loras", "max_cpu_loras", None),  # None: max_loras
)


def spec_value(spec, path: str) -> Any:
    """The value at a dotted attribute path of the spec; None where the spec does not carry it."""
    return functools.reduce(lambda obj, name: getattr(obj, name, None), path.split("."), spec)


def engine_config(spec, num_kv_blocks: int, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Keyword arguments for ``LLM(...)``: the envelope's limits plus what was planned and tuned."""
    built = {"num_kv_blocks": num_kv_blocks, "cuda_graph_batch_sizes": None}
    cfg = {}
    for path, name, transform in ENGINE_SETTINGS:
        value = built[name] if path is None else spec_value(spec, path)
        cfg[name] = transform(value) if transform is not None else value
    cfg.update(overrides or {})
    return cfg
