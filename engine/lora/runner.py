"""The runner's half of LoRA, in one place: this rank's adapter slots over the model's adaptable linears (each
linear makes its own ``LoRASlots``, ``LinearBase.enable_lora``), what a step loads into them (sent on to the
other ranks, ``wire.py``), the rows' slots a step packs, and the step's ``LoRAStep`` for its forward context.
"""

from __future__ import annotations

from typing import Any

import torch
from kiln.engine import parallel
from kiln.engine.kernels.native import Kernels
from kiln.engine.layers.linear import LinearBase
from kiln.engine.lora.adapter import LoRAAdapter
from kiln.engine.lora.config import LoRAConfig
from kiln.engine.lora.layers import LoRASlots, PartKey
from kiln.engine.lora.step import LoRAStep, make_lora_step
from kiln.engine.lora.wire import send_slot
from kiln.engine.sequence import Request
from kiln.engine.step_inputs import StepInputs

ROW_PARALLEL = ("o_proj", "down_proj")


def lora_targets(model: torch.nn.Module) -> list[tuple[int, str, LinearBase]]:
    """(layer index, kiln linear name, the linear) of every adaptable linear of this rank's stage."""
    inner = model.model
    out = []
    for i in range(inner.start, inner.end):
        layer = inner.layers[i]
        for name, lin in (("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj),
                          ("gate_up_proj", layer.mlp.gate_up_proj), ("down_proj", layer.mlp.down_proj)):
            out.append((i, name, lin))
    return out


def _parts(name: str, lin: LinearBase) -> list[tuple[PartKey, int, int]]:
    if name == "qkv_proj":
        q, kv = lin.num_heads * lin.head_dim, lin.num_kv_heads * lin.head_dim
        return [("q", 0, q), ("k", q, kv), ("v", q + kv, kv)]
    if name == "gate_up_proj":
        half = lin.output_size // 2
        return [(0, 0, half), (1, half, half)]
    return [(None, 0, lin.output_size)]


class LoRARunner:
    """This rank's slots over the model's adaptable linears; ``load(slot, adapter)`` fills one slot."""

    def __init__(self, model: torch.nn.Module, lora: LoRAConfig, device: torch.device,
                 kernels: Kernels | None = None) -> None:
        """``kernels``: kiln's CPU kernels (the runner's, None without them): the slots' GEMMs run on them, in
        the model's dtype, when it is one they multiply."""
        self.config, self.device, self.max_loras, dtype = lora, device, lora.max_loras, lora.dtype
        if kernels is None or dtype not in kernels.linear_dtypes:
            kernels = None
        stack_dtype = lora.stack_dtype(device)
        self.slots: dict[tuple[int, str], LoRASlots] = {}
        for layer, name, lin in lora_targets(model):
            self.slots[(layer, name)] = lin.enable_lora(lora, _parts(name, lin), name in ROW_PARALLEL, stack_dtype,
                                                        device, kernels)
        self.loaded: list[int | None] = [None] * lora.max_loras  # the adapter (int_id) each slot holds

    def load_step(self, lora_loads: list[tuple[int, LoRAAdapter | None]]) -> None:
        """Rank 0, before a step: the (slot, adapter) loads the scheduler assigned it, on every rank's device
        (the other ranks get the weights, not a path: ``wire.py``)."""
        for slot, adapter in lora_loads:
            self.load(slot, adapter)
            if parallel.world_size() > 1:
                send_slot(slot, adapter)

    def token_slots(self, reqs: list[Request]) -> list[int]:
        """Each row's adapter slot (-1: the base), as the step packs them (``step_inputs.pack_rows``)."""
        return [-1 if r.lora_slot is None else r.lora_slot for r in reqs]

    def step(self, inputs: StepInputs) -> LoRAStep | None:
        """The step's LoRA work for its forward context (None: no adapter row, the linears do no LoRA work)."""
        return make_lora_step(inputs.token_lora_slots, self.device, self.max_loras)

    def load(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Put ``adapter`` in ``slot``; None empties it (its adapter was unloaded)."""
        for key, lin_slots in self.slots.items():
            lin_slots.set_slot(slot, None if adapter is None else adapter.weights.get(key))
        self.loaded[slot] = None if adapter is None else adapter.int_id

    def load_weights(self, slot: int, int_id: int, weights: dict[tuple[int, str], Any]) -> None:
        """On a rank other than 0: fill ``slot`` with the weights rank 0 sent (``lora/wire.py``); int_id 0
        and no weights: empty it."""
        for key, lin_slots in self.slots.items():
            lin_slots.set_slot(slot, weights.get(key))
        self.loaded[slot] = int_id or None

    @property
    def nbytes(self) -> int:
        return sum(s.A.numel() * s.A.element_size() + s.Bt.numel() * s.Bt.element_size() for s in self.slots.values())
