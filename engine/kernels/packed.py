"""A weight packed once for kiln's CPU GEMMs, and the GEMM that runs each of its row buckets.

Panels of P output columns (P = the library's ``kiln_linear_panel``, the last panel zero-padded):
[ceil(out / P), in, P] in float32, [ceil(out / P), pairs, P, 2] in bfloat16 (K in pairs, padded to whole AMX
tiles: ``kiln_bf16_panel_pairs``), and the bf16 layout in one byte per value for int8 weights with their
float32 scales (weight-only quantization). A decode step streams each panel once.

bf16 panels are byte for byte the blocked layout oneDNN itself chooses for a bf16 weight on the hosts
measured (``AB16b64a2b``, when it is asked to pack for one row): where that holds for a shape, the weight
can be packed *by oneDNN* and its buffer read by kiln's kernels too, so a row bucket may run oneDNN's GEMM
(``"onednn"``) on the same single copy. That is checked byte for byte for each weight, never assumed.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kiln.engine.kernels.native import Kernels

ROW_BUCKETS = 16  # = KILN_ROW_BUCKETS: bucket b holds calls of (2^(b-1), 2^b] rows
GEMM_KERNELS = {"fma": 0, "amx": 1, "onednn": 0}  # = enum kiln_gemm_kernel; oneDNN's runs from Python (C: FMA)


def row_bucket(rows: int) -> int:
    """The tactic bucket of a call with ``rows`` rows (as ``row_bucket`` in csrc/gemm.c)."""
    return min(ROW_BUCKETS - 1, max(0, (int(rows) - 1).bit_length()))


class KilnWeight(ctypes.Structure):
    """``struct kiln_weight``: a packed weight and, per row bucket, the GEMM kernel that multiplies it."""

    _fields_ = [("panels", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("bf16", ctypes.c_int32), ("kernel", ctypes.c_uint8 * ROW_BUCKETS)]


def onednn_panels(weight: torch.Tensor, panels: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of a bf16 ``weight`` when its bytes are exactly kiln's ``panels``, else None."""
    ops = torch.ops.mkldnn
    if weight.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = ops._reorder_linear_weight(weight, 1)
        ptr, nbytes = ops.data_ptr(packed), ops._nbytes(packed)
    except (RuntimeError, AttributeError):
        return None
    if nbytes != panels.numel() * panels.element_size():
        return None
    view = torch.empty(panels.numel(), dtype=panels.dtype)
    ctypes.memmove(view.data_ptr(), ptr, nbytes)
    return packed if torch.equal(view, panels.flatten()) else None


class PackedLinear:
    """A weight [out, in] packed for kiln's CPU GEMM: panels of P output columns (P = the library's
    ``kiln_linear_panel``, the last panel zero-padded), [ceil(out / P), in, P] in float32 and
    [ceil(out / P), pairs, P, 2] in bfloat16 (K in pairs, padded to whole AMX tiles: ``kiln_bf16_panel_pairs``;
    one copy serves the vdpbf16ps and AMX kernels), so a
    decode step streams each panel once; calling it is ``F.linear(x, weight, bias)``. An int8 weight keeps
    the bf16 layout in one byte per value with its float32 scales (weight-only quantization; ``dtype`` is the
    activations', and ``kiln_linear_i8`` widens a panel at a time). ``weight`` is the C side's record of
    it, with the GEMM kernel per row bucket (``set_tactics``)."""

    def __init__(self, kernels: Kernels, weight: torch.Tensor, tactics: Sequence[str] | None = None,
                 scales: torch.Tensor | None = None, dtype: torch.dtype | None = None,
                 share_onednn: bool | None = None) -> None:
        self.int8 = weight.dtype == torch.int8
        self.dtype = (dtype or torch.float32) if self.int8 else weight.dtype  # of the activations and outputs
        if (self.dtype not in kernels.linear_dtypes or weight.dim() != 2 or weight.device.type != "cpu"
                or self.int8 != (scales is not None)):
            raise ValueError(f"kiln's CPU linear packs 2-D CPU weights of {', '.join(map(str, kernels.linear_dtypes))} "
                             f"(or int8 with scales, for those activations) on this host, not {weight.dtype} "
                             f"{tuple(weight.shape)} for {self.dtype} activations")
        if weight.stride(1) != 1:
            weight = weight.contiguous()
        self.out_features, self.in_features = weight.shape
        panel, k = kernels.linear_panel, self.in_features
        per_panel = (k, panel) if weight.dtype == torch.float32 else (kernels.bf16_panel_pairs(k), panel, 2)
        panels = -(-self.out_features // panel)
        self.panels = weight.new_empty((panels, *per_panel))
        kernels._pack_linear[weight.dtype](weight.data_ptr(), self.panels.data_ptr(), self.out_features, k,
                                           weight.stride(0))
        self.scales = None
        if self.int8:  # padded to whole panels: the kernels read a panel's scales as vectors
            self.scales = torch.zeros(panels * panel, dtype=torch.float32)
            self.scales[:self.out_features] = scales.float()
        self._kernels = kernels
        self.onednn = None  # oneDNN's copy, when it is these panels byte for byte and a bucket runs it
        ptr = self.panels.data_ptr()
        if (share_onednn or (share_onednn is None and tactics and "onednn" in tactics)) and not self.int8:
            self.onednn = onednn_panels(weight, self.panels)
            if self.onednn is not None:  # one copy: kiln's kernels read oneDNN's buffer
                self.panels, ptr = self.onednn, torch.ops.mkldnn.data_ptr(self.onednn)
        self.weight = KilnWeight(ptr, 0 if self.scales is None else self.scales.data_ptr(), self.out_features, k,
                                 int(self.dtype == torch.bfloat16))
        self.set_tactics(tactics or ["fma"] * ROW_BUCKETS)

    def set_tactics(self, tactics: Sequence[str]) -> None:
        """The GEMM kernel (a ``GEMM_KERNELS`` name) for each row bucket; one that cannot run here is refused."""
        if len(tactics) != ROW_BUCKETS:
            raise ValueError(f"tactics name a kernel for each of the {ROW_BUCKETS} row buckets, got {len(tactics)}")
        for name in set(tactics):
            why = self._kernels.gemm_kernels[self.dtype].get(name, f"not one of {', '.join(GEMM_KERNELS)}")
            if name == "onednn" and self.onednn is None:
                why = "oneDNN's packing of this weight is not these panels (or it was packed without it)"
            if why:
                raise ValueError(f"GEMM kernel {name!r} cannot run {self.dtype} here: {why}")
        self.tactics = tuple(tactics)
        self.weight.kernel[:] = [GEMM_KERNELS[t] for t in tactics]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._kernels.linear(x, self, bias)
