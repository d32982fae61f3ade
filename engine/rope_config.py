"""Which rope (rotary position) variants kiln runs, read from a checkpoint's config: one home.

The runtime (``layers/rotary.py``), the engine's position limit (``config.max_model_len``)
and the builder's check stage all use these, so a checkpoint the builder accepts is one
the runtime loads, and both compute the same context length. Plain Python: no torch.
"""

from __future__ import annotations

from typing import Any

# What layers/rotary.py implements.
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# Those whose factor multiplies the usable context beyond the original max_position_embeddings
# (llama3 keeps max_position_embeddings as the full length).
EXTENDING_ROPE_TYPES = ("linear", "dynamic", "yarn")


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Rope settings from either config form: transformers 5's ``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling``; ``rope_type`` always set ("default" when unscaled)."""
    params = dict(hf_config.get("rope_parameters") or {})
    for key, value in (hf_config.get("rope_scaling") or {}).items():
        params.setdefault(key, value)
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def max_positions(hf_config: dict[str, Any]) -> int:
    """Positions the model supports: max_position_embeddings, or the original length times the rope
    factor for the variants that extend the context."""
    mpe = int(hf_config.get("max_position_embeddings") or 2048)
    rope = rope_parameters(hf_config)
    if rope["rope_type"] in EXTENDING_ROPE_TYPES and rope.get("factor"):
        base = int(rope.get("original_max_position_embeddings") or mpe)
        return max(mpe, int(base * float(rope["factor"])))
    return mpe
