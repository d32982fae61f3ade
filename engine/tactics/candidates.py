"""The implementations a linear can run on CPU ("candidates"), what each needs, and how to pack and call it.

A candidate runs on weights in one *layout*; every candidate of a layout shares the packed copy, so a
linear holds one copy of its weight and the table can still pick a different kernel per row bucket
among the candidates of its layout:

====================  ========  ====================================================================
candidate             layout    what runs
====================  ========  ====================================================================
``kiln-fma``          kiln      kiln's register-tiled FMA kernel (float32 FMA; bf16 vdpbf16ps)
``kiln-amx``          kiln      kiln's AMX tile kernel, same panels (bf16; Sapphire Rapids and later)
``onednn-panels``     kiln      oneDNN's GEMM on the same panels: bf16 weights whose oneDNN packing is
                                kiln's panels byte for byte (``kernels/packed.py``; checked per weight)
``onednn``            onednn    oneDNN through torch, weight prepacked once (oneDNN picks AMX, AVX-512,
                                VNNI or AVX2 itself)
``aten``              plain     ``torch.nn.functional.linear`` on the plain weight (MKL's sgemm for
                                float32; oneDNN with a reorder on every call for bf16); for an int8
                                weight torch's int8 path (``layers.quant.quantized_linear``)
====================  ========  ====================================================================

int8 weights (weight-only quantization) have kiln's candidates too: the same kernels over int8 panels
widened per call (``csrc/gemm_int8.c``); oneDNN's packed linear takes float weights only.

``why_not`` says why a candidate cannot run a shape here (None: it can): a candidate the host cannot
run is never timed and never chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Candidate:
    name: str
    layout: str
    gemm_kernel: str | None = None  # kiln's C kernel (kernels.native.GEMM_KERNELS) for the kiln layout


LINEAR: dict[str, Candidate] = {c.name: c for c in (
    Candidate("kiln-fma", "kiln", "fma"),
    Candidate("kiln-amx", "kiln", "amx"),
    Candidate("onednn-panels", "kiln", "onednn"),
    Candidate("onednn", "onednn"),
    Candidate("aten", "plain"),
)}
LAYOUTS = ("kiln", "onednn", "plain")


def onednn_unavailable(dtype: torch.dtype) -> str | None:
    """Why torch's oneDNN cannot prepack ``dtype`` weights here (None: it can)."""
    mkldnn = torch.ops.mkldnn
    if not torch.backends.mkldnn.is_available() or not hasattr(mkldnn, "_reorder_linear_weight"):
        return "this torch has no oneDNN linear"
    if dtype == torch.bfloat16 and not mkldnn._is_mkldnn_bf16_supported():
        return "oneDNN has no bf16 kernels on this CPU"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"oneDNN's packed linear takes float32 or bfloat16, not {dtype}"
    return None


def why_not(name: str, dtype: torch.dtype, native, quant: str | None = None) -> str | None:
    """Why candidate ``name`` cannot run a linear with ``dtype`` activations (and a ``quant`` weight) on this
    host (``native``: kiln's loaded CPU kernels, or None)."""
    cand = LINEAR[name]
    if quant not in (None, "int8"):
        return None if cand.layout == "plain" else f"{quant} weights run torch's path only"
    if quant and (cand.layout == "onednn" or cand.gemm_kernel == "onednn"):
        return "oneDNN's packed linear takes float weights, not int8"
    if cand.layout == "kiln":
        if native is None:
            return "kiln's CPU kernels are not loaded"
        why = native.gemm_kernels.get(dtype, {}).get(cand.gemm_kernel, f"kiln's GEMM takes no {dtype}")
        if why is None and cand.gemm_kernel == "fma" and dtype not in native.linear_dtypes:
            why = f"kiln's GEMM does not pack {dtype} here"
        return why
    if cand.layout == "onednn":
        return onednn_unavailable(dtype)
    return None


def pack(layout: str, weight: torch.Tensor, native, batch_hint: int = 64, tactics=None,
         scale: torch.Tensor | None = None, dtype: torch.dtype | None = None, share_onednn: bool | None = None):
    """``weight`` [out, in] in ``layout``: a ``kernels.native.PackedLinear`` (kiln; ``tactics`` = its GEMM
    kernel per row bucket; an int8 weight with its ``scale`` for ``dtype`` activations; ``share_onednn``: as
    ``Kernels.pack_linear``), an opaque oneDNN tensor, or the weight itself (plain)."""
    if layout == "kiln":
        return native.pack_linear(weight.detach(), tactics, scale, dtype, share_onednn)
    if layout == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
    return weight.detach()


def run(packed, x: torch.Tensor, bias: torch.Tensor | None, plain: bool = False,
        scale: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through whatever ``pack`` made of the weight (a plain int8 weight: with
    its ``scale``, by torch's int8 path)."""
    if plain and scale is not None:
        from kiln.engine.layers.quant import quantized_linear

        return quantized_linear(x, packed, scale, bias)
    if plain:
        return F.linear(x, packed, bias)
    if isinstance(packed, torch.Tensor):
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return packed(x, bias)
