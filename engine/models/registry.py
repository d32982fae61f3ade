"""Which model class serves which Hugging Face ``architectures`` entry, and building one on a device."""

from __future__ import annotations

from typing import Any

import torch
from kiln.engine.errors import UnsupportedModelError
from kiln.engine.layers.building import building_in
from kiln.engine.layers.linear import born_quantized
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


def create_model(hf_config: dict[str, Any], max_position: int, dtype: torch.dtype, device: str | torch.device,
                 quantization: str | None = None) -> nn.Module:
    """This rank's shard of the model with unloaded parameters, every parameter and buffer on ``device``.

    With ``quantization``, the linears are built holding empty int8/fp8 weights and scales to receive
    an artifact's state dict (``weights.load_engine_state``); no float copy is ever allocated. Built on ``meta`` by the placement
    tests: nothing may land on another device.
    """
    cls = model_class(hf_config)
    # The dtype is this thread's (building_in), never torch's process-wide default: a pool builds engines on
    # threads of their own while the loaded ones step.
    with torch.device(device), building_in(dtype), born_quantized(quantization):  # never a full-precision copy
        return cls(hf_config, max_position)
