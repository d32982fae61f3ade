"""RoPE tables equal transformers' for each scaling variant the Llama family uses."""

from __future__ import annotations

import pytest
import torch
from kiln.engine.config import max_model_len
from kiln.engine.layers.rotary import RotaryEmbedding
from kiln.engine.rope_config import rope_parameters

VARIANTS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cos_sin_match_transformers(variant):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                      rope_parameters=dict(VARIANTS[variant]))
    hf = LlamaRotaryEmbedding(cfg)
    positions = torch.arange(256)
    x = torch.zeros(1, 256, 16)
    hf_cos, hf_sin = hf(x, positions[None])
    ours = RotaryEmbedding(16, 256, rope_parameters(cfg.to_dict()))
    cos, sin = ours.cos_sin(positions, torch.float32)
    torch.testing.assert_close(cos[:, 0], hf_cos[0], rtol=0, atol=0)
    torch.testing.assert_close(sin[:, 0], hf_sin[0], rtol=0, atol=0)


def test_old_style_rope_scaling_and_extended_length():
    old = {"max_position_embeddings": 1024, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    params = rope_parameters(old)
    assert params["rope_type"] == "linear" and params["rope_theta"] == 5e5
    assert max_model_len(old) == 2048
    assert max_model_len({"max_position_embeddings": 1024, "rope_parameters": VARIANTS["llama3"]}) == 1024
    assert max_model_len({"max_position_embeddings": 256, "rope_parameters": VARIANTS["yarn"]}) == 256


def test_every_rope_type_the_builder_accepts_loads_in_the_runtime(tmp_path):
    """One home (kiln.engine.rope_config): the builder's check refuses exactly what the runtime cannot run."""
    import json

    from kiln.builder.errors import InvalidSpec
    from kiln.builder.model_facts import model_facts
    from kiln.builder.stages.check import check_envelope
    from kiln.engine.rope_config import SUPPORTED_ROPE_TYPES

    for rope_type in SUPPORTED_ROPE_TYPES:
        params = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0, **VARIANTS.get(rope_type, {})}
        RotaryEmbedding(16, 64, rope_parameters({"rope_parameters": params}))
    config = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 32,
              "num_attention_heads": 2, "vocab_size": 64, "max_position_embeddings": 128,
              "rope_scaling": {"rope_type": "longrope", "factor": 4.0, "short_factor": [1.0] * 8,
                               "long_factor": [1.0] * 8}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    facts = model_facts(tmp_path)
    assert facts.rope_type == "longrope"
    with pytest.raises(ValueError):
        RotaryEmbedding(16, 64, rope_parameters(config))
    with pytest.raises(InvalidSpec, match="rope type 'longrope' is not supported"):
        check_envelope(None, facts)
