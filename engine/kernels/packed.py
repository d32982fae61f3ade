"""A weight packed once for kiln's CPU GEMMs, and the GEMM that runs each of its row buckets.

Panels of P output columns (P = the library's ``kiln_linear_panel``, the last panel zero-padded):
[ceil(out / P), in, P] in float32, [ceil(out / P), pairs, P, 2] in bfloat16 (K in pairs, padded to whole AMX
tiles: ``kiln_bf16_panel_pairs``), and [ceil(out / P), pairs / 2, P, 4] int8 (K in quads, what vpdpbusd
reads) for int8 weights with their float32 scales and int16 column sums per 32-block of K: one copy serves weight-only int8
(widened per panel into the bf16 layout) and W8A8 (``"w8a8"``). A decode step streams each panel once.

bf16 panels are byte for byte the blocked layout oneDNN itself chooses for a bf16 weight on the hosts
measured (``AB16b64a2b``, when it is asked to pack for one row): where that holds for a shape, the weight
can be packed *by oneDNN* and its buffer read by kiln's kernels too, so a row bucket may run oneDNN's GEMM
(``"onednn"``) on the same single copy. That is checked for each weight (its first and last panel, byte
for byte), never assumed.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from kiln.engine.host_pages import anonymous
from kiln.engine.kernels import torch_w8a8

ROW_BUCKETS = 16  # = KILN_ROW_BUCKETS: bucket b holds calls of (2^(b-1), 2^b] rows
# = enum kiln_gemm_kernel; oneDNN's runs from Python (C: FMA); W8A8 (on vector or AMX-INT8 tiles) runs int8 weights
# only; the gguf ones GGUF
# block weights only (gguf_blocks.PackedGGUF); torch's W8A8 ("qlinear") from Python on a second copy of an int8
# weight (PackedLinear.qlinear)
GEMM_KERNELS = {"fma": 0, "amx": 1, "onednn": 0, "w8a8": 2, "gguf": 3, "gguf_f32": 4, "qlinear": 0, "w8a8_amx": 5}
PYTHON_KERNELS = ("onednn", "qlinear")  # called from Python: a step with a bucket on one leaves the decoder stack


def row_bucket(rows: int) -> int:
    """The tactic bucket of a call with ``rows`` rows (as ``row_bucket`` in csrc/gemm_dispatch.c)."""
    return min(ROW_BUCKETS - 1, max(0, (int(rows) - 1).bit_length()))


class Kernels(Protocol):
    """What a packed weight needs of the loaded library (``native.Kernels``, which imports this module: the
    library is handed in, never imported)."""

    linear_panel: int
    linear_dtypes: tuple[torch.dtype, ...]
    gemm_kernels: dict[torch.dtype, dict[str, str | None]]
    _pack_linear: dict[torch.dtype, Callable[..., None]]
    bf16_panel_pairs: Callable[[int], int]

    def linear(self, x: torch.Tensor, packed: PackedLinear, bias: torch.Tensor | None) -> torch.Tensor: ...


class KilnWeight(ctypes.Structure):
    """``struct kiln_weight``: a packed weight and, per row bucket, the GEMM kernel that multiplies it."""

    _fields_ = [("panels", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("bsums", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("bf16", ctypes.c_int32),
                ("kernel", ctypes.c_uint8 * ROW_BUCKETS), ("qtype", ctypes.c_int32)]


def onednn_panels(kernels: Kernels, weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of a bf16 ``weight`` when its bytes are exactly kiln's panels, else None.

    Panels are independent of each other, so the first and the last one (the zero-padded one, where
    layouts differ first) are packed by kiln alone and compared with oneDNN's bytes: no second copy of the
    whole weight is ever held."""
    ops = torch.ops.mkldnn
    if weight.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return None
    n, k = weight.shape
    panel, pairs = kernels.linear_panel, kernels.bf16_panel_pairs(k)
    panel_bytes, panels = pairs * panel * 2 * 2, -(-n // panel)
    try:
        packed = ops._reorder_linear_weight(weight, 1)
        ptr, nbytes = ops.data_ptr(packed), ops._nbytes(packed)
    except (RuntimeError, AttributeError):
        return None
    if nbytes != panels * panel_bytes:
        return None
    for index in {0, panels - 1}:
        mine = torch.empty(pairs, panel, 2, dtype=torch.bfloat16)
        rows = weight[index * panel:(index + 1) * panel]
        kernels._pack_linear[torch.bfloat16](rows.data_ptr(), mine.data_ptr(), rows.shape[0], k, rows.stride(0))
        theirs = torch.empty_like(mine)
        ctypes.memmove(theirs.data_ptr(), ptr + index * panel_bytes, panel_bytes)
        if not torch.equal(mine, theirs):
            return None
    return packed


class PackedLinear:
    """A weight [out, in] packed for kiln's CPU GEMM: panels of P output columns (P = the library's
    ``kiln_linear_panel``, the last panel zero-padded), [ceil(out / P), in, P] in float32 and
    [ceil(out / P), pairs, P, 2] in bfloat16 (K in pairs, padded to whole AMX tiles: ``kiln_bf16_panel_pairs``;
    one copy serves the vdpbf16ps and AMX kernels), so a
    decode step streams each panel once; calling it is ``F.linear(x, weight, bias)``. An int8 weight is packed
    with K in quads, [ceil(out / P), pairs / 2, P, 4], with its float32 scales and int16 block column sums (``dtype``
    is the activations'): ``kiln_linear_i8`` widens a panel at a time (weight-only), and buckets that run
    ``"w8a8"`` quantize the activations per row and 32-block and multiply int8 by int8 (``csrc/gemm_w8a8.c``). ``weight``
    is the C side's record of it, with the GEMM kernel per row bucket (``set_tactics``)."""

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
        pairs = kernels.bf16_panel_pairs(k)
        per_panel = {torch.float32: (k, panel), torch.int8: (pairs // 2, panel, 4)}.get(weight.dtype, (pairs, panel, 2))
        panels = -(-self.out_features // panel)
        self.onednn = None  # oneDNN's copy, when it is these panels byte for byte and a bucket runs it
        if (share_onednn or (share_onednn is None and tactics and "onednn" in tactics)) and not self.int8:
            self.onednn = onednn_panels(kernels, weight)
        if self.onednn is not None:  # one copy: kiln's kernels read oneDNN's buffer
            self.panels, ptr = self.onednn, torch.ops.mkldnn.data_ptr(self.onednn)
        self.scales = self.bsums = None
        # torch's prepacked copy (a second copy of the weight), made only when a bucket runs it
        self.qlinear = torch_w8a8.QLinear(weight, scales) if self.int8 and tactics and "qlinear" in tactics else None
        if self.int8:  # padded to whole panels: the kernels read a panel's scales (and block sums) as vectors
            self.scales = torch.zeros(panels * panel, dtype=torch.float32)
            self.scales[:self.out_features] = scales.float()
            self.bsums = torch.zeros((panels, pairs // 16, panel), dtype=torch.int16)  # per 32-block of K
        if self.onednn is None:
            shape = (panels, *per_panel)
            self.panels = anonymous(math.prod(shape) * weight.itemsize, huge=True).view(weight.dtype).view(shape)
            extra = (self.bsums.data_ptr(),) if self.int8 else ()
            kernels._pack_linear[weight.dtype](weight.data_ptr(), self.panels.data_ptr(), *extra, self.out_features,
                                               k, weight.stride(0))
            ptr = self.panels.data_ptr()
        self._kernels = kernels
        self.weight = KilnWeight(ptr, 0 if self.scales is None else self.scales.data_ptr(),
                                 0 if self.bsums is None else self.bsums.data_ptr(), self.out_features, k,
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
            if name in ("w8a8", "w8a8_amx", "qlinear") and not self.int8:
                why = why or "W8A8 multiplies int8 weights, not float ones"
            if name == "qlinear" and self.qlinear is None:
                why = why or "torch's W8A8 runs its own copy of the weight, which was not made (pack with it)"
            if name.startswith("gguf"):
                why = "the GGUF kernels multiply GGUF block weights"
            if why:
                raise ValueError(f"GEMM kernel {name!r} cannot run {self.dtype} here: {why}")
        self.tactics = tuple(tactics)
        self.weight.kernel[:] = [GEMM_KERNELS[t] for t in tactics]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._kernels.linear(x, self, bias)
