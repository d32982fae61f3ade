"""Which model class serves which Hugging Face ``architectures`` entry."""

from __future__ import annotations

from typing import Any

from kiln.engine.errors import UnsupportedModelError
from kiln.engine.models import SUPPORTED_ARCHITECTURES
from kiln.engine.models.llama import LlamaForCausalLM
from torch import nn

# The Llama family is one class with config switches (see models/llama.py).
MODEL_REGISTRY: dict[str, type[nn.Module]] = {name: LlamaForCausalLM for name in SUPPORTED_ARCHITECTURES}


def model_class(hf_config: dict[str, Any]) -> type[nn.Module]:
    """The class for a config.json, or an error listing what is supported."""
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise UnsupportedModelError(
        f"model architecture {', '.join(archs) or '(none in config.json)'} is not supported; "
        f"supported architectures: {', '.join(sorted(MODEL_REGISTRY))}"
    )
