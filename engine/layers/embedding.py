"""Vocab-parallel token embedding and LM head: each rank holds a contiguous slice of the vocabulary.

The vocabulary is padded up to a multiple of the tensor-parallel size; padded
rows are zero and their logits are cut off after the all-gather.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kiln.engine import parallel
from kiln.engine.kernels import formats, gguf_blocks
from kiln.engine.layers.building import build_dtype
from kiln.engine.layers.linear import packed_linear
from torch import nn


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = parallel.tp_rank(), parallel.tp_size()
        self.num_embeddings = num_embeddings
        self.shard_size = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        # Not zeroed here: weight_loader zeroes it (padded rows), and an artifact's rows replace it whole.
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim, dtype=build_dtype()),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        rows = max(0, min(self.shard_size, self.num_embeddings - self.vocab_start))
        param.data.zero_()
        param.data[:rows].copy_(loaded.narrow(0, self.vocab_start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        kind = formats.of_weight(self.weight).gguf_type
        if kind:  # GGUF blocks: the rows dequantized
            return self._gguf_rows(input_ids, kind)
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mask = (local >= 0) & (local < self.shard_size)
        out = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * mask.unsqueeze(-1).to(self.weight.dtype)
        return parallel.all_reduce(out)


    def _gguf_rows(self, input_ids: torch.Tensor, kind: str) -> torch.Tensor:
        local = input_ids - self.vocab_start
        mask = (local >= 0) & (local < self.shard_size)
        out = gguf_blocks.embedding(local.clamp(0, self.shard_size - 1), self.weight, kind,
                                    torch.get_default_dtype() if self.dtype is None else self.dtype)
        return out if self.tp_size == 1 else parallel.all_reduce(out * mask.unsqueeze(-1).to(out.dtype))

    dtype = None  # the dequantized rows' dtype, for GGUF blocks (the engine's; set by weights.load_engine_state)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the full vocabulary (all-gathered from each rank's slice)."""

    packed_weight = None  # a packed copy on CPU (kiln.engine.tactics.bind)
    weight_int8 = weight_scale = None  # an int8 engine's head, quantized to be packed (tactics.bind.quantize_head)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self.packed_weight is not None:
            logits = packed_linear(hidden, self.packed_weight, None)
        elif formats.of_weight(self.weight).gguf_type:
            logits = gguf_blocks.gguf_linear(hidden, self.weight, self.weight.gguf_type, None)
        else:
            logits = F.linear(hidden, self.weight)
        return parallel.all_gather_last_dim(logits)[..., : self.num_embeddings]
