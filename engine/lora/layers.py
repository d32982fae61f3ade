"""Device slots of LoRA weights per linear, and the shrink/expand matmuls over a step's tokens.

Each adaptable linear (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``) gets a ``LoRASlots`` with
two preallocated, zero-padded stacks: ``A [max_loras, parts * max_rank, in]`` and ``Bt [max_loras, parts *
max_rank, out]`` (B stored transposed, so a slot's first ``used`` rank rows are one contiguous block). A fused
linear's parts (q/k/v, gate/up) are packed one after another along the rank axis, each part's ``B`` placed at
its slice of the fused output (zeros elsewhere), so one shrink and one expand serve every part. Tensor
parallel: a column-parallel linear keeps ``A`` whole and this rank's output rows of ``B``; a row-parallel one
keeps this rank's input columns of ``A`` and all of ``B``: its partial ``x_r A_r^T B^T`` is summed by the
same all-reduce as the base's partial product. On CPU with kiln's kernels, each slot's ``A`` and ``B`` (and
all slots' together) are also packed for kiln's GEMM in the model's dtype, repacked when a slot is filled.

Per step (``LoRAStep``, built once by the runner from the per-token slots, -1 = no adapter) the tokens form
runs of one slot (the runner orders a step's rows by slot, so there is one run per adapter and kind of
row). Each linear then adds, per run, ``y[a:b] += (x[a:b] @ A_s^T) @ Bt_s``: slices, no gather or scatter
(Punica's SGMV without a custom kernel). A small step with several runs (decode) takes the slot-dense path
instead (the BGMV idea): one shrink over every slot, ``h = x @ [A_0; ...; A_L]^T``, each token's columns of
the other slots zeroed by the step's ``[tokens, max_loras]`` mask (a base token's by all), one expand ``y +=
h @ [Bt_0; ...; Bt_L]``: four ops per linear whatever the number of adapters. With no adapter row in a step
there is no ``LoRAStep`` and the linears do no LoRA work at all.
"""

from __future__ import annotations

import ctypes
from typing import Protocol

import torch
from kiln.engine import parallel
from kiln.engine.forward_context import get_forward_context
from kiln.engine.kernels.native import Kernels
from kiln.engine.kernels.packed import PackedLinear
from kiln.engine.lora.step import LoRAStep, make_lora_step

__all__ = ["LoRASlots", "LoRAStep", "PartKey", "SlotHost", "make_lora_step"]

PartKey = str | int | None  # a fused linear's part: "q"/"k"/"v", 0/1 (gate/up), None (not fused)


class SlotHost(Protocol):
    """The linear whose output a ``LoRASlots`` adds to (``layers.linear.LinearBase``, which makes its own)."""

    input_size: int
    output_size: int

class LoRASlots:
    """The adapter slots of one linear (see the module docstring)."""

    def __init__(self, linear: SlotHost, parts: list[tuple[PartKey, int, int]], row_parallel: bool, max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device, kernels: Kernels | None = None,
                 compute_dtype: torch.dtype | None = None) -> None:
        """``parts``: (part key, offset, size) of each part in this rank's output (one part, key None, if not
        fused); ``dtype``: the stacks'; ``kernels``: kiln's CPU kernels, to pack the slots for in
        ``compute_dtype`` (the model's: the base weight may be quantized), or None (torch matmuls)."""
        self.parts, self.row_parallel, self.max_rank = parts, row_parallel, max_rank
        self.in_features, self.out_features = linear.input_size, linear.output_size
        self.tp_rank = parallel.tp_rank()
        width = len(parts) * max_rank
        self.A = torch.zeros(max_loras, width, self.in_features, dtype=dtype, device=device)
        self.Bt = torch.zeros(max_loras, width, self.out_features, dtype=dtype, device=device)
        self.used = [0] * max_loras  # rank rows of each slot in use (0: this adapter does not touch the linear)
        self.kernels, self.compute_dtype = kernels, compute_dtype
        # per slot: (A_s, Bt_s^T) packed for kiln's GEMM
        self.packed: list[tuple[PackedLinear, PackedLinear] | None] = [None] * max_loras
        # every slot's, for the dense path (packed on first use)
        self.packed_all: tuple[PackedLinear, PackedLinear] | None = None

    def set_slot(self, slot: int, weights: dict[PartKey, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
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
        self.packed[slot] = self._pack(self.A[slot, :col], self.Bt[slot, :col]) if col and self.kernels else None
        self.packed_all = None

    def _pack(self, a: torch.Tensor, bt: torch.Tensor) -> tuple[PackedLinear, PackedLinear]:
        dt = self.compute_dtype
        return self.kernels.pack_linear(a.to(dt)), self.kernels.pack_linear(bt.t().to(dt))

    def _mm(self, x: torch.Tensor, packed: PackedLinear) -> torch.Tensor:
        """``x @ W^T`` by kiln's GEMM (what ``Kernels.linear`` calls, without its checks: ~6 us a call, two
        thirds of a decode token's shrink; the packs run the FMA kernel at every row count, no bias)."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        n = packed.out_features
        y = x.new_empty((x.shape[0], n))
        if x.shape[0]:
            self.kernels._gemm(ctypes.byref(packed.weight), x.data_ptr(), 0, y.data_ptr(), x.shape[0], x.stride(0), n)
        return y

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``y`` (the base linear's output for ``x``) plus each adapter token's LoRA delta, in place."""
        step = get_forward_context().lora
        if step is None:
            return y
        kiln = self.kernels is not None and x.dtype == self.compute_dtype
        if step.mask is not None:  # the slot-dense path: every slot at once, the others' columns masked
            if kiln:
                if self.packed_all is None:
                    self.packed_all = self._pack(self.A.flatten(0, 1), self.Bt.flatten(0, 1))
                h = self._mm(x, self.packed_all[0])
            else:
                h = torch.mm(x.to(self.A.dtype), self.A.flatten(0, 1).t())
            # Zeroed by a fill, not a multiply: an overflow in another slot's columns (inf * 0 = NaN) must not
            # reach a row that does not use that slot (a base row least of all).
            h.view(step.tokens, len(self.used), -1).masked_fill_(step.others, 0)
            return y.add_(self._mm(h, self.packed_all[1]) if kiln
                          else torch.mm(h, self.Bt.flatten(0, 1)))
        for slot, start, end in step.runs:
            used = self.used[slot]
            if not used:
                continue
            xs, ys = (x, y) if end - start == step.tokens else (x[start:end], y[start:end])
            if kiln:
                a, bt = self.packed[slot]
                ys.add_(self._mm(self._mm(xs, a), bt))
            else:
                ys.add_(torch.mm(torch.mm(xs.to(self.A.dtype), self.A[slot, :used].t()), self.Bt[slot, :used]))
        return y
