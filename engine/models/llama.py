"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM3) as one model with config switches.

Differences between the family members are data, read from config.json:
query/key/value bias (Qwen2, or Llama's ``attention_bias``), each head's query and
key RMS-normed before the rotary (Qwen3's ``q_norm``/``k_norm``), layers without
rotary (SmolLM3's ``no_rope_layers``), tied embeddings,
grouped-query vs multi-head attention, an explicit ``head_dim``, and the rope
scaling variant. Parameter names follow the Hugging Face checkpoints, except
for the fused projections named in ``packed_modules``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from kiln.engine import parallel
from kiln.engine.forward_context import get_forward_context, step_has_lora
from kiln.engine.layers.attention import Attention
from kiln.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kiln.engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kiln.engine.layers.norm import RMSNorm
from kiln.engine.layers.rotary import RotaryEmbedding, apply_rotary_qk
from kiln.engine.rope_config import rope_parameters
from torch import nn


def head_dim_of(cfg: dict[str, Any]) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def kv_heads_of(cfg: dict[str, Any]) -> int:
    """The model's K/V heads (every rank's together): ``num_key_value_heads``, else one per attention head."""
    return cfg.get("num_key_value_heads") or cfg["num_attention_heads"]


def uses_rope(cfg: dict[str, Any], layer: int) -> bool:
    """Whether decoder layer ``layer`` rotates q and k: SmolLM3's ``no_rope_layers`` (1 rope, 0 none) leaves some
    layers position-free (NoPE); every other member rotates in every layer."""
    flags = cfg.get("no_rope_layers") if cfg.get("model_type") == "smollm3" else None
    return bool(flags[layer]) if flags else True


class LlamaAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], layer: int = 0) -> None:
        super().__init__()
        self.use_rope = uses_rope(cfg, layer)
        tp = parallel.tp_size()
        num_heads, num_kv_heads = cfg["num_attention_heads"], kv_heads_of(cfg)
        self.head_dim = head_dim_of(cfg)
        qkv_bias = cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False))
        o_bias = cfg.get("model_type") != "qwen2" and bool(cfg.get("attention_bias", False))
        self.qkv_proj = QKVParallelLinear(cfg["hidden_size"], self.head_dim, num_heads, num_kv_heads, qkv_bias)
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, cfg["hidden_size"], bias=o_bias)
        self.num_heads, self.num_kv_heads = num_heads // tp, num_kv_heads // tp
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)
        # Qwen3: one RMSNorm over each query head and one over each key head, before the rotary (as transformers')
        has_qk_norm = cfg.get("model_type") == "qwen3"
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(self.head_dim, eps) if has_qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if has_qk_norm else None

    native_ops = None  # kernels.native.Kernels: rotary in place, in one pass (set by the runner)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        qk, v = self.qkv_proj(hidden).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k are adjacent in the fused output: one rotary pass over both.
        qk = qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qk = self._norm_heads(qk)
        if self.use_rope and self.native_ops is not None and cos_sin[0].shape[-1] == self.head_dim:
            qk = self.native_ops.rotary_(qk, *cos_sin)
        elif self.use_rope:
            qk = apply_rotary_qk(cos_sin, qk)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return self.o_proj(self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim)))

    def _norm_heads(self, qk: torch.Tensor) -> torch.Tensor:
        """q and k [tokens, heads, head_dim], each head's row RMS-normed by its norm: one row per head, as
        kernels.native's rms_norm (and the C decoder stack) takes them."""
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        d = self.head_dim
        return torch.cat((self.q_norm(q.reshape(-1, d)).view(-1, self.num_heads, d),
                          self.k_norm(k.reshape(-1, d)).view(-1, self.num_kv_heads, d)), dim=1)


# On CPU (native kernels) the MLP of a step with more tokens runs in slices of ``mlp_rows`` rows: a
# 2048-token prefill's gate|up output is 2048 x 2 x intermediate floats (64 MiB for an 8B model), far
# past the caches, while a slice's stays in L2/L3 for the SiLU and the down projection. The best slice
# depends on the host's GEMM (256 on a Zen 4's FMA tiles: 2 threads ~5-10 % faster than unsliced; larger
# where AMX tiles run it), so a build times MLP_ROWS_CHOICES end to end (a tactic: kiln.builder.
# stages.tactics); without a build's table the MLP runs CPU_MLP_ROWS.
CPU_MLP_ROWS = 256
MLP_ROWS_CHOICES = (256, 512, 1024)


def mlp_rows_choices(tokens: int) -> tuple[int, ...]:
    """The slices worth timing for a prefill step of ``tokens`` rows (the one rule a build and a load share):
    each choice smaller than the step, and the smallest that holds the step whole (any larger one runs the same
    unsliced MLP). Fewer than two: nothing to choose."""
    return tuple(r for r in MLP_ROWS_CHOICES if r < tokens) + tuple(r for r in MLP_ROWS_CHOICES if r >= tokens)[:1]


def mlp_rows_at_load(max_num_tokens: int) -> tuple[int, tuple[int, ...]]:
    """(rows, choices) a load times one layer's MLP on where its table has no slice: the step's tokens, capped at
    the largest choice (a longer step only repeats its slices, and costs the load more)."""
    rows = min(max_num_tokens, max(MLP_ROWS_CHOICES))
    return rows, mlp_rows_choices(rows)


def sliced_mlps(model) -> list:
    """The model's MLPs that run a prefill step in slices of ``mlp_rows`` (those on the native path)."""
    return [m for m in model.modules() if hasattr(m, "mlp_rows") and m.rows_per_call]


def apply_mlp_rows(mlps: list, table) -> None:
    """Set each of ``mlps`` to the slice ``table`` timed fastest (``model["mlp_rows"]``); none timed: unchanged."""
    rows = (table.model.get("mlp_rows") or {}).get("winner")
    for m in mlps if rows else ():
        m.mlp_rows = int(rows)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.get('hidden_act')!r} is not supported (only silu)")
        bias = bool(cfg.get("mlp_bias", False))
        inter = cfg["intermediate_size"]
        self.gate_up_proj = MergedColumnParallelLinear(cfg["hidden_size"], [inter, inter], bias=bias)
        self.down_proj = RowParallelLinear(inter, cfg["hidden_size"], bias=bias)

    native_ops = None  # kernels.native.Kernels: SiLU(gate) * up in one pass (set by the runner)
    mlp_rows = CPU_MLP_ROWS  # the slice a prefill step's MLP runs in on the native path (a tactic's choice)

    @property
    def rows_per_call(self) -> int | None:
        """The most rows one call of these linears may see: a prefill step's MLP runs in slices on the native
        path (up to the largest slice a tactic table may choose)."""
        return max(MLP_ROWS_CHOICES) if self.native_ops is not None else None

    def _native(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.native_ops.silu_mul(self.gate_up_proj(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native_ops is not None and x.dim() == 2:
            # a prefill step: keep the [rows, 2 x intermediate] output in cache (LoRA groups index the whole step)
            if x.shape[0] > self.mlp_rows and not step_has_lora():
                return torch.cat([self._native(part) for part in x.split(self.mlp_rows)])
            return self._native(x)
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class LlamaDecoderLayer(nn.Module):
    stack_member = True  # its linears run inside kernels.native.DecoderStack when one is bound (tactics.bind)

    def __init__(self, cfg: dict[str, Any], layer: int = 0) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))

    def forward(self, cos_sin, hidden, residual):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(cos_sin, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class OtherStageLayer(nn.Module):
    """A decoder layer that another pipeline stage runs: no parameters, never called."""


Intermediate = tuple[torch.Tensor, torch.Tensor]  # (hidden, residual) handed from one stage to the next


class LlamaModel(nn.Module):
    """One pipeline stage of the model: stage 0 embeds, the last stage norms; each runs its layers.

    Layers keep their global index (``layers.{i}``) so checkpoint names load unchanged;
    ``is_foreign(name)`` says which checkpoint tensors belong to another stage.
    """

    def __init__(self, cfg: dict[str, Any], max_position: int) -> None:
        super().__init__()
        num_layers = cfg["num_hidden_layers"]
        self.first, self.last = parallel.is_first_stage(), parallel.is_last_stage()
        self.start, self.end = parallel.stage_layers(num_layers, parallel.pp_rank(), parallel.pp_size())
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"]) if self.first else None
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) if self.start <= i < self.end else OtherStageLayer()
                                    for i in range(num_layers))
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)) if self.last else None
        # One table for every layer: cos/sin are looked up once per forward pass.
        self.rotary_emb = RotaryEmbedding(head_dim_of(cfg), max_position, rope_parameters(cfg))
        self.native_stack = None  # kernels.native.DecoderStack: the layers in one C call (bind_native_stack)

    def bind_native_stack(self, kernels) -> str | None:
        """Run this stage's layers as one ``kernels.native.DecoderStack`` call per step; returns None, or why
        the per-module path stays (it then runs as before). Call after the weights are packed for kiln's GEMM
        (``kiln.engine.tactics.bind``) and the KV caches are bound."""
        from kiln.engine.kernels.native import DecoderStack, PackedLinear, supports

        self.native_stack = None
        layers = list(self.layers[self.start:self.end])
        if kernels is None or not layers:
            return "no CPU kernels" if kernels is None else "no layers in this stage"
        if parallel.tp_size() > 1:
            return "tensor parallel (the row-parallel linears all-reduce between kernels)"
        first = layers[0]
        attn, mlp = first.self_attn, first.mlp
        dtype = first.input_layernorm.weight.dtype
        if self.rotary_emb.cos_cache.shape[-1] != attn.head_dim:
            return "partial rotary embedding"
        records = []
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            linears = (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
            if not all(isinstance(lin.packed_weight, PackedLinear) and lin.packed_weight.dtype == dtype
                       for lin in linears):
                return f"linears not packed for kiln's {dtype} GEMM (quantized, or a dtype it does not run here)"
            cache = a.attn.k_cache
            if cache.dim() != 4 or not supports(dtype, cache.dtype):
                return f"KV cache {cache.dtype} with a {dtype} model"
            records.append({
                "input_norm": layer.input_layernorm.weight.detach().contiguous(),
                "post_norm": layer.post_attention_layernorm.weight.detach().contiguous(),
                "qkv": a.qkv_proj.packed_weight, "o": a.o_proj.packed_weight,
                "gate_up": m.gate_up_proj.packed_weight, "down": m.down_proj.packed_weight,
                "qkv_bias": None if a.qkv_proj.bias is None else a.qkv_proj.bias.detach().float().contiguous(),
                "gate_up_bias": None if m.gate_up_proj.bias is None else m.gate_up_proj.bias.detach().float().contiguous(),
                "o_bias": None if a.o_proj.bias is None else a.o_proj.bias.detach().contiguous(),
                "down_bias": None if m.down_proj.bias is None else m.down_proj.bias.detach().contiguous(),
                "k_cache": a.attn.k_cache, "v_cache": a.attn.v_cache,
                "q_norm": None if a.q_norm is None else a.q_norm.weight.detach().contiguous(),
                "k_norm": None if a.k_norm is None else a.k_norm.weight.detach().contiguous(),
                "rope": int(a.use_rope),
            })
        kvh, num_blocks, block_size, _ = first.self_attn.attn.k_cache.shape
        shape = dict(hidden=first.input_layernorm.weight.shape[0], heads=attn.num_heads, kv_heads=attn.num_kv_heads,
                     head_dim=attn.head_dim, inter=mlp.down_proj.input_size, num_blocks=num_blocks,
                     block_size=block_size, mlp_rows=mlp.mlp_rows, eps=first.input_layernorm.eps, scale=attn.attn.scale)
        self.native_stack = DecoderStack(kernels, shape, records, dtype)
        return None

    def _native_step(self, hidden: torch.Tensor):
        """This step's attention metadata when the native stack runs it (its kernels serve the step), else None."""
        if (self.native_stack is None or hidden.dim() != 2 or hidden.dtype != self.native_stack.dtype
                or not self.native_stack.can_run(hidden.shape[0])):
            return None
        ctx = get_forward_context()
        if ctx.has_lora:  # adapters: module by module
            return None
        md = ctx.attention
        return md if md.native is not None and md.native_row_starts is not None else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: Intermediate | None = None) -> torch.Tensor | Intermediate:
        if self.first:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate
        cos_sin = self.rotary_emb.cos_sin(positions, hidden.dtype)
        md = self._native_step(hidden)
        if md is not None:
            hidden, residual = self.native_stack(hidden, residual, *cos_sin, md.slot_mapping, md.decode_block_tables,
                                                 md.decode_ctx_lens, md.native_row_starts)
        else:
            for layer in self.layers[self.start:self.end]:
                hidden, residual = layer(cos_sin, hidden, residual)
        if not self.last:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # checkpoint tensor name part -> (fused parameter name part, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: dict[str, Any], max_position: int) -> None:
        super().__init__()
        self.model = LlamaModel(cfg, max_position)
        self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"]) if self.model.last else None
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        # With pipeline stages the LM head lives apart from the embedding: a tied head loads the
        # checkpoint's embedding into its own parameter (``checkpoint_aliases``).
        if self.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def checkpoint_aliases(self) -> dict[str, str]:
        """Extra checkpoint tensor -> parameter mappings of this stage."""
        if self.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is None:
            return {"model.embed_tokens.weight": "lm_head.weight"}
        return {}

    def is_foreign(self, name: str) -> bool:
        """True for a checkpoint tensor another pipeline stage holds."""
        m = self.model
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            return not m.start <= index < m.end
        if name.startswith("model.embed_tokens."):
            return m.embed_tokens is None and not self.checkpoint_aliases
        if name.startswith("model.norm."):
            return m.norm is None
        if name.startswith("lm_head."):
            return self.lm_head is None
        return False

    def bind_native_stack(self, kernels) -> str | None:
        return self.model.bind_native_stack(kernels)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: Intermediate | None = None) -> torch.Tensor | Intermediate:
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
