"""What a checkpoint is, read from ``config.json`` and the safetensors headers alone (no torch).

:class:`ModelFacts` is what every later stage needs of the model: its architecture, shape, positions
(with rope scaling, ``kiln.engine.rope_config``) and parameter counts, the quantizable ones counted
apart (:func:`is_quantizable`, the linears the runtime quantizes). The ``check`` stage reads them
for the target and the draft model; the KV plan and the memory estimate (:mod:`kiln.builder.sizing`)
size the engine from them.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kiln.engine.rope_config import max_positions, rope_parameters

# Used only when the engine's own registry cannot be imported.
FALLBACK_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def supported_architectures() -> tuple[str, ...]:
    """The runtime's registry; the fallback only matters for a runtime without one."""
    try:
        from kiln.engine.models.registry import MODEL_REGISTRY  # the registry imports torch: only when asked
    except ImportError:
        return FALLBACK_ARCHITECTURES
    return tuple(sorted(MODEL_REGISTRY))


def read_safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """Tensor name -> {"dtype", "shape"} from a safetensors file, without loading it."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def is_quantizable(name: str, shape: list[int]) -> bool:
    """Linear projection weights inside decoder layers; embeddings, lm_head and norms stay in dtype."""
    return len(shape) == 2 and ".layers." in name and name.endswith(".weight")


@dataclass
class ModelFacts:
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    max_positions: int  # with rope scaling
    rope_type: str
    num_params: int
    num_quantizable_params: int
    num_quantizable_rows: int  # output channels of quantizable linears (one scale each)

    def to_dict(self) -> dict:
        return asdict(self)


def _count_params(checkpoint_dir: Path) -> tuple[int, int, int]:
    """(parameters, quantizable parameters, quantizable output rows) over the checkpoint's headers."""
    num_params = num_q = num_rows = 0
    for f in sorted(checkpoint_dir.glob("*.safetensors")):
        for name, t in read_safetensors_header(f).items():
            numel = 1
            for d in t["shape"]:
                numel *= d
            num_params += numel
            if is_quantizable(name, t["shape"]):
                num_q += numel
                num_rows += t["shape"][0]
    return num_params, num_q, num_rows


def model_facts(checkpoint_dir: Path) -> ModelFacts:
    config = json.loads((checkpoint_dir / "config.json").read_text())
    archs = config.get("architectures") or [config.get("model_type", "?")]
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    rope_type = rope_parameters(config)["rope_type"]
    mpe = int(config.get("max_position_embeddings", 2048))
    num_params, num_q, num_rows = _count_params(checkpoint_dir)
    return ModelFacts(
        architecture=archs[0], num_layers=int(config["num_hidden_layers"]), hidden_size=hidden,
        intermediate_size=int(config.get("intermediate_size", 4 * hidden)), num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads), vocab_size=int(config["vocab_size"]),
        max_position_embeddings=mpe, max_positions=max_positions(config), rope_type=rope_type, num_params=num_params,
        num_quantizable_params=num_q, num_quantizable_rows=num_rows,
    )
