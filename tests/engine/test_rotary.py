"""RoPE tables equal transformers' for each scaling variant the Llama family uses."""

from __future__ import annotations

import pytest
import torch
from kiln.engine.config import max_model_len
from kiln.engine.layers.rotary import RotaryEmbedding, rope_parameters

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
