"""Device slots of LoRA weights per linear, and the grouped shrink/expand matmul over a step's tokens.

Each adaptable linear (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``) gets a ``LoRASlots`` with
two preallocated, zero-padded stacks: ``A [max_loras, parts * max_rank, in]`` and ``Bt [max_loras, parts *
max_rank, out]`` (B stored transposed, so a slot's first ``used`` rank rows are one contiguous block). A fused
linear's parts (q/k/v, gate/up) are packed one after another along the rank axis, each part's ``B`` placed at
its slice of the fused output (zeros elsewhere), so one shrink and one expand serve every part. Tensor
parallel: a column-parallel linear keeps ``A`` whole and this rank's output rows of ``B``; a row-parallel one
keeps this rank's input columns of ``A`` and all of ``B``: its partial ``x_r A_r^T B^T`` is summed by the
same all-reduce as the base's partial product.

A step's tokens are grouped by slot once (``LoRAStep``, built by the runner from the per-token slots, -1 =
no adapter); each linear then runs, per group, ``y[idx] += (x[idx] @ A_s[:used]^T) @ Bt_s[:used]`` (Punica's
SGMV idea without a custom kernel: one pair of GEMMs per adapter group). With no adapter row in a step there
is no ``LoRAStep`` and the linears do no LoRA work at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from kiln.engine import parallel


@dataclass
class LoRAStep:
    """The step's adapter groups: ``(slot, token indices)``; indices None = every token of the step."""

    groups: list[tuple[int, torch.Tensor | None]]


_step: LoRAStep | None = None


def set_lora_step(step: LoRAStep | None) -> None:
    global _step
    _step = step


def lora_step_active() -> bool:
    return _step is not None


def make_lora_step(token_slots: torch.Tensor | None, device: torch.device) -> LoRAStep | None:
    """Group a step's tokens by adapter slot; None when no token has one (the base path, no LoRA work)."""
    if token_slots is None or token_slots.numel() == 0:
        return None
    slots = [s for s in torch.unique(token_slots).tolist() if s >= 0]
    if not slots:
        return None
    if len(slots) == 1 and bool((token_slots == slots[0]).all()):
        return LoRAStep([(slots[0], None)])
    return LoRAStep([(s, (token_slots == s).nonzero().squeeze(1).to(device)) for s in slots])


class LoRASlots:
    """The adapter slots of one linear (see the module docstring)."""

    def __init__(self, linear: Any, parts: list[tuple[Any, int, int]], row_parallel: bool, max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        """``parts``: (part key, offset, size) of each part in this rank's output (one part, key None, if not
        fused); ``dtype``: the model's compute dtype (the base weight may be quantized)."""
        self.parts, self.row_parallel, self.max_rank = parts, row_parallel, max_rank
        self.in_features, self.out_features = linear.input_size, linear.output_size
        self.tp_rank = parallel.tp_rank()
        width = len(parts) * max_rank
        self.A = torch.zeros(max_loras, width, self.in_features, dtype=dtype, device=device)
        self.Bt = torch.zeros(max_loras, width, self.out_features, dtype=dtype, device=device)
        self.used = [0] * max_loras  # rank rows of each slot in use (0: this adapter does not touch the linear)

    def set_slot(self, slot: int, weights: dict[Any, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """Put an adapter's (full, unsharded) weights for this linear in ``slot``; None empties it."""
        self.A[slot].zero_()
        self.Bt[slot].zero_()
        col = 0
        for key, offset, size in self.parts:
            if not weights or key not in weights:
                continue
            a, b = weights[key]
            r = a.shape[0]
            if self.row_parallel:  # this rank's input columns of A; B whole
                a = a.narrow(1, self.tp_rank * self.in_features, self.in_features)
                self.Bt[slot, col:col + r].copy_(b.t())
            else:  # A whole; this rank's output rows of B, at the part's offset in the fused output
                self.Bt[slot, col:col + r, offset:offset + size].copy_(b.narrow(0, self.tp_rank * size, size).t())
            self.A[slot, col:col + r].copy_(a)
            col += r
        self.used[slot] = col

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``y`` (the base linear's output for ``x``) plus each adapter group's LoRA delta, in place."""
        step = _step
        if step is None:
            return y
        for slot, idx in step.groups:
            used = self.used[slot]
            if not used:
                continue
            a, bt = self.A[slot, :used], self.Bt[slot, :used]
            if idx is None:
                y.add_(torch.mm(torch.mm(x.to(a.dtype), a.t()), bt).to(y.dtype))
            else:
                xs = x.index_select(0, idx).to(a.dtype)
                y.index_add_(0, idx, torch.mm(torch.mm(xs, a.t()), bt).to(y.dtype))
        return y


def lora_targets(model: torch.nn.Module) -> list[tuple[int, str, Any]]:
    """(layer index, kiln linear name, the linear) of every adaptable linear of this rank's stage."""
    inner = model.model
    out = []
    for i in range(inner.start, inner.end):
        layer = inner.layers[i]
        for name, lin in (("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj),
                          ("gate_up_proj", layer.mlp.gate_up_proj), ("down_proj", layer.mlp.down_proj)):
            out.append((i, name, lin))
    return out


def _parts(name: str, lin: Any) -> list[tuple[Any, int, int]]:
    if name == "qkv_proj":
        q, kv = lin.num_heads * lin.head_dim, lin.num_kv_heads * lin.head_dim
        return [("q", 0, q), ("k", q, kv), ("v", q + kv, kv)]
    if name == "gate_up_proj":
        half = lin.output_size // 2
        return [(0, 0, half), (1, half, half)]
    return [(None, 0, lin.output_size)]


class LoRAModel:
    """This rank's slots over the model's adaptable linears; ``load(slot, adapter)`` fills one slot."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.max_loras = max_loras
        # On CPU the slots and the two small GEMMs are float32 whatever the model's dtype: torch's bf16 GEMM at
        # LoRA's shapes ([tokens, 16] products) measured ~5x slower than float32 on a Zen 4 core.
        dtype = torch.float32 if torch.device(device).type == "cpu" else dtype
        self.slots: dict[tuple[int, str], LoRASlots] = {}
        for layer, name, lin in lora_targets(model):
            lin.lora = LoRASlots(lin, _parts(name, lin), name in ("o_proj", "down_proj"), max_loras,
                                  max_rank, dtype, device)
            self.slots[(layer, name)] = lin.lora
        self.loaded: list[int | None] = [None] * max_loras  # the adapter (int_id) each slot holds
        self._read: dict[int, Any] = {}  # ranks other than 0: adapters read from disk, by int_id (LRU)

    def load(self, slot: int, adapter: Any) -> None:
        for key, lin_slots in self.slots.items():
            lin_slots.set_slot(slot, adapter.weights.get(key))
        self.loaded[slot] = adapter.int_id

    def load_path(self, slot: int, int_id: int, path: str, config: Any) -> None:
        """On a rank other than 0: read the adapter rank 0 put in ``slot`` (the same path on every node),
        keeping up to ``max_cpu_loras`` read adapters in memory."""
        from kiln.engine.lora.adapter import load_adapter

        adapter = self._read.pop(int_id, None) or load_adapter(
            path, f"#{int_id}", int_id, config.hf_config, config.max_lora_rank, config.torch_dtype)
        self._read[int_id] = adapter  # most recent last
        while len(self._read) > (config.max_cpu_loras or config.max_loras):
            del self._read[next(iter(self._read))]
        self.load(slot, adapter)

    @property
    def nbytes(self) -> int:
        return sum(s.A.numel() * s.A.element_size() + s.Bt.numel() * s.Bt.element_size() for s in self.slots.values())
