"""GGUF block weights (``quantization: gguf``): the formats kiln runs as they are, and the weight that runs them.

A GGUF weight row of K inputs is K/32 blocks (ggml's own layouts, little-endian):

=======  ==========  ==========================================  ==================
type     bytes/32    block                                       value
=======  ==========  ==========================================  ==================
Q8_0     34          fp16 d, int8 q[32]                          q d
Q4_0     18          fp16 d, 16 bytes: q[i] low, q[i + 16] high  (q - 8) d
Q4_1     20          fp16 d, fp16 m, 16 bytes as Q4_0            q d + m
=======  ==========  ==========================================  ==================

An engine keeps such a weight as the file's bytes, ``uint8 [N, K/32 x bytes]``, with its type on the parameter
(``param.gguf_type``, from the artifact's ``kiln_gguf_types`` metadata, ``weights.load_engine_state``). On CPU it
is repacked once at load (``PackedGGUF``: the same bytes, in groups of 16 output columns, ``csrc/gemm_gguf.c``)
and run by kiln's GGUF GEMM (the activations quantized per 32-block, int8 dot products on VNNI / AVX2) or its
dequantizing mode, as the tactic table picks per row bucket (candidates ``kiln-gguf``, ``kiln-gguf-f32``).
Without kiln's kernels a layer dequantizes per call (``gguf_linear``). Other GGUF types (K-quants, Q5_*, ...)
are not runnable: the builder refuses them in the decoder's linears (``builder/gguf.py``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from kiln.engine.host_pages import anonymous
from kiln.engine.kernels.packed import GEMM_KERNELS, ROW_BUCKETS, KilnWeight, PackedLinear

# type name -> (ggml type id, bytes per block of 32)
GGUF_TYPES = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34)}
# a tactic site's quant for each type (its table key: ``float32+q4_1:576x576``)
QUANTS = {name.lower(): name for name in GGUF_TYPES}
GGUF_KERNELS = ("gguf", "gguf_f32")
BLOCK = 32


def site_quant(weight: torch.Tensor) -> str | None:
    """``q4_1`` etc. for a GGUF block weight (uint8 with a ``gguf_type``), else None."""
    kind = getattr(weight, "gguf_type", None)
    return kind.lower() if weight.dtype == torch.uint8 and kind in GGUF_TYPES else None


def row_bytes(k: int, kind: str) -> int:
    if k % BLOCK:
        raise ValueError(f"a GGUF {kind} row holds whole blocks of {BLOCK}, not {k} values")
    return k // BLOCK * GGUF_TYPES[kind][1]


def in_features(weight: torch.Tensor, kind: str) -> int:
    return weight.shape[-1] // GGUF_TYPES[kind][1] * BLOCK


def _blocks(weight: torch.Tensor, kind: str) -> torch.Tensor:
    return weight.reshape(weight.shape[0], -1, GGUF_TYPES[kind][1])


def dequantize(weight: torch.Tensor, kind: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float values of a ``uint8 [N, K/32 x bytes]`` block weight, ``[N, K]`` (ggml's dequantization)."""
    b = _blocks(weight, kind)
    d = b[..., 0:2].contiguous().view(torch.float16).float()
    if kind == "Q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()
        out = q * d
    else:
        qs = b[..., 4:] if kind == "Q4_1" else b[..., 2:]
        q = torch.cat([qs & 15, qs >> 4], dim=-1).float()
        if kind == "Q4_0":
            out = (q - 8) * d
        else:
            out = q * d + b[..., 2:4].contiguous().view(torch.float16).float()
    return out.reshape(weight.shape[0], -1).to(dtype)


def quantize(w: torch.Tensor, kind: str) -> torch.Tensor:
    """A float ``[N, K]`` weight as ``kind`` blocks, ``uint8 [N, K/32 x bytes]`` (ggml's reference quantizers:
    ``quantize_row_q8_0/q4_0/q4_1_ref``); for tests and for timing a shape with random weights."""
    n, k = w.shape
    x = w.float().reshape(n, k // BLOCK, BLOCK)
    if kind == "Q8_0":
        d = x.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = (x * inv).round().clamp(-128, 127).to(torch.int8).view(torch.uint8)
        head = [d.half().view(torch.uint8)]
    elif kind == "Q4_0":
        idx = x.abs().argmax(-1, keepdim=True)
        d = x.gather(-1, idx) / -8
        inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        q = (x * inv + 8.5).clamp(0, 15).to(torch.uint8)
        q = q[..., :16] | (q[..., 16:] << 4)
        head = [d.half().view(torch.uint8)]
    elif kind == "Q4_1":
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        d = (hi - lo) / 15
        inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        q = ((x - lo) * inv + 0.5).clamp(0, 15).to(torch.uint8)
        q = q[..., :16] | (q[..., 16:] << 4)
        head = [d.half().view(torch.uint8), lo.half().view(torch.uint8)]
    else:
        raise ValueError(f"GGUF type {kind!r} is not one kiln runs ({', '.join(GGUF_TYPES)})")
    out = torch.cat([*head, q], dim=-1).reshape(n, -1).contiguous()
    out.gguf_type = kind
    return out


def gguf_linear(x: torch.Tensor, weight: torch.Tensor, kind: str, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` of a block weight by dequantizing it for this call (no kiln kernels here)."""
    return F.linear(x, dequantize(weight, kind, x.dtype), bias)


def embedding(ids: torch.Tensor, weight: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """The rows ``ids`` of a block-quantized embedding table, dequantized."""
    rows = weight.index_select(0, ids.reshape(-1))
    return dequantize(rows, kind, dtype).reshape(*ids.shape, -1)


def declare(lib) -> dict:
    """The library's GGUF entry points, typed."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    pack = lib.kiln_pack_gguf
    pack.restype, pack.argtypes = None, [ptr, ptr, i64, i64, ctypes.c_int]
    size = lib.kiln_gguf_packed_bytes
    size.restype, size.argtypes = i64, [i64, i64, ctypes.c_int]
    vnni = lib.kiln_gguf_set_vnni
    vnni.restype, vnni.argtypes = None, [ctypes.c_int]
    return {"pack": pack, "size": size, "set_vnni": vnni}


class PackedGGUF(PackedLinear):
    """A GGUF block weight repacked for kiln's GGUF GEMM (``csrc/gemm_gguf.c``: 16-column groups, the file's
    bytes), multiplying ``dtype`` activations; the GEMM kernel per row bucket is ``"gguf"`` (int8 dot products
    over activations quantized per block) or ``"gguf_f32"`` (dequantized panels, FMA tiles; float32 only)."""

    int8 = False
    onednn = None
    scales = sums = None

    def __init__(self, kernels, weight: torch.Tensor, kind: str, tactics: Sequence[str] | None = None,
                 dtype: torch.dtype | None = None) -> None:
        if kind not in GGUF_TYPES or weight.dtype != torch.uint8 or weight.dim() != 2:
            raise ValueError(f"kiln's GGUF GEMM packs uint8 block weights of {', '.join(GGUF_TYPES)}, not {kind} "
                             f"{weight.dtype} {tuple(weight.shape)}")
        self.kind, self.dtype = kind, dtype or torch.float32
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"kiln's GGUF GEMM takes float32 or bfloat16 activations, not {self.dtype}")
        weight = weight.contiguous()
        self.out_features, self.in_features = weight.shape[0], in_features(weight, kind)
        code = GGUF_TYPES[kind][0]
        api = kernels.gguf
        self.panels = anonymous(api["size"](self.out_features, self.in_features, code), huge=True)
        api["pack"](weight.data_ptr(), self.panels.data_ptr(), self.out_features, self.in_features, code)
        self._kernels = kernels
        self.weight = KilnWeight(self.panels.data_ptr(), 0, 0, self.out_features, self.in_features,
                                 int(self.dtype == torch.bfloat16))
        self.weight.qtype = code
        self.set_tactics(tactics or ["gguf"] * ROW_BUCKETS)

    def set_tactics(self, tactics: Sequence[str]) -> None:
        if len(tactics) != ROW_BUCKETS:
            raise ValueError(f"tactics name a kernel for each of the {ROW_BUCKETS} row buckets, got {len(tactics)}")
        for name in set(tactics):
            why = self._kernels.gemm_kernels[self.dtype].get(name) if name in GGUF_KERNELS else \
                f"a GGUF {self.kind} weight runs {' or '.join(GGUF_KERNELS)}"
            if why:
                raise ValueError(f"GEMM kernel {name!r} cannot run {self.kind} x {self.dtype} here: {why}")
        self.tactics = tuple(tactics)
        self.weight.kernel[:] = [GEMM_KERNELS[t] for t in tactics]
