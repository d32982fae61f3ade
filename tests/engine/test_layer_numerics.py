"""The fused forms of small layers equal transformers' reference ops bit for bit (fp32 and bf16)."""

from __future__ import annotations

import pytest
import torch
from kiln.engine.layers.norm import RMSNorm
from kiln.engine.layers.rotary import RotaryEmbedding, apply_rotary, apply_rotary_qk
from kiln.engine.rope_config import rope_parameters


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_residual_equals_transformers(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(0)
    hf = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    ours = RMSNorm(96, eps=1e-5).to(dtype)
    weight = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    hf.weight.data.copy_(weight)
    ours.weight.data.copy_(weight)
    x, residual = (3 * torch.randn(2, 7, 96, generator=g)).to(dtype), torch.randn(2, 7, 96, generator=g).to(dtype)
    out, new_residual = ours(x, residual)
    assert torch.equal(new_residual, x + residual)
    assert torch.equal(out, hf(x + residual))
    assert torch.equal(ours(x), hf(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rotary_over_packed_q_and_k_equals_transformers(dtype, partial):
    from transformers.models.llama.modeling_llama import rotate_half

    heads, kv_heads, d, tokens = 6, 2, 32, 11
    params = {**rope_parameters({"rope_theta": 10000.0}), "partial_rotary_factor": partial}
    rope = RotaryEmbedding(d, 64, params)
    positions = torch.tensor([0, 1, 2, 3, 9, 10, 40, 41, 42, 5, 63])
    cos, sin = rope.cos_sin(positions, dtype)
    g = torch.Generator().manual_seed(1)
    qk = torch.randn(tokens, heads + kv_heads, d, generator=g).to(dtype)
    rot = int(d * partial)

    def reference(x):  # transformers' apply_rotary_pos_emb on the rotated part
        x_rot = x[..., :rot]
        return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x[..., rot:]), dim=-1)

    fused = apply_rotary_qk((cos, sin), qk)
    assert torch.equal(fused, reference(qk))
    q, k = apply_rotary((cos, sin), qk[:, :heads], qk[:, heads:])
    assert torch.equal(torch.cat((q, k), dim=1), fused)
