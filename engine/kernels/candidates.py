"""The implementations a linear can run on CPU ("candidates"), what each needs, and how to pack and call it.

A candidate runs on weights in one *layout*; every candidate of a layout shares the packed copy, so a
linear holds one copy of its weight and the table can still pick a different kernel per row bucket
among the candidates of its layout (one exception, ``SECOND_COPY``: an int8 weight may hold torch's W8A8 copy
beside kiln's panels, each running the buckets it wins):

====================  ========  ====================================================================
candidate             layout    what runs
====================  ========  ====================================================================
``kiln-fma``          kiln      kiln's register-tiled FMA kernel (float32 FMA; bf16 vdpbf16ps)
``kiln-amx``          kiln      kiln's AMX tile kernel, same panels (bf16; Sapphire Rapids and later)
``onednn-panels``     kiln      oneDNN's GEMM on the same panels: bf16 weights whose oneDNN packing is
                                kiln's panels byte for byte (``packed.py``; checked per weight)
``onednn``            onednn    oneDNN through torch, weight prepacked once (oneDNN picks AMX, AVX-512,
                                VNNI or AVX2 itself)
``aten``              plain     ``torch.nn.functional.linear`` on the plain weight (MKL's sgemm for
                                float32; oneDNN with a reorder on every call for bf16); for an int8
                                weight torch's int8 path (``kernels.quant_linear.quantized_linear``)
``kiln-w8a8``         kiln      int8 weights only: the activations quantized per row and 32-block on each
                                call and multiplied int8 x int8 on vpdpbusd (AVX512-VNNI), same int8 panels
``kiln-w8a8-amx``     kiln      int8 weights only: ``kiln-w8a8``'s integer sums on AMX-INT8 tiles (tdpbusd), up
                                to 16 rows a tile, its epilogue: the same results bit for bit, timed as its own
``torch-w8a8``        qlinear   int8 weights only: torch's ``quantized.linear_dynamic`` (x86 engine:
                                FBGEMM / oneDNN), activations quantized per call, one 7-bit scale (``torch_w8a8.py``)
``kiln-gguf``         kiln      GGUF block weights only (Q8_0 / Q4_0 / Q4_1, ``gguf_blocks.py``): the
                                activations quantized per 32-block, int8 dot products (VNNI / AVX2)
``kiln-gguf-f32``     kiln      GGUF block weights only: a panel dequantized to float32 per call, FMA
                                tiles (float32 activations; the fallback a table may pick by timing)
====================  ========  ====================================================================

int8 weights (weight-only quantization) have kiln's candidates too: the same kernels over int8 panels
widened per call (``csrc/gemm_int8.c``); oneDNN's packed linear takes float weights only. The ``*-w8a8``
candidates (``quantizes_activations``) compute something else than the weight-only ones: the activations
lose bits. The tactics time them beside the rest unless told not to: ``$KILN_TACTICS_EXCLUDE`` (``EXCLUDE_ENV``:
candidate names, comma- or space-separated, ``w8a8`` for all of ``ACTIVATION_QUANT``) makes ``why_not`` refuse
them, so no table measured here picks them, a table that runs them is re-timed, and the exclusion is part of
the host signature a table records (a quality gate that fails W8A8 sets it).

``why_not`` says why a candidate cannot run a shape here (None: it can): a candidate the host cannot
run is never timed and never chosen.

This is the table beneath every CPU linear (llama.cpp's ``type_traits_cpu``): the layers run a packed weight
through ``run``, the tactics (``kiln.engine.tactics``: timing, the table, resolve and bind) ask it what can
run and pack by it; it imports nothing above the kernels.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from kiln.engine.kernels import formats, torch_w8a8
from kiln.engine.kernels.quant_linear import quantized_linear

_FLOAT_INT8 = ("float", "int8")
_BLOCKS = tuple(f.name for f in formats.FORMATS.values() if f.gguf_type)


@dataclass(frozen=True)
class Candidate:
    name: str
    layout: str
    gemm_kernel: str | None = None  # kiln's C kernel (native.GEMM_KERNELS) for the kiln layout
    accepts: tuple[str, ...] = _FLOAT_INT8  # the weight formats (formats.FORMATS) it multiplies
    quantizes_activations: bool = False  # multiplies int8 activations, quantized per call

    @property
    def changes_semantics(self) -> bool:
        """It quantizes the activations of a format defined without (W8A8 on int8 weights): what a quality
        gate measures and may exclude."""
        return self.quantizes_activations and not all(formats.FORMATS[f].activations_quantized for f in self.accepts)


LINEAR: dict[str, Candidate] = {c.name: c for c in (
    Candidate("kiln-fma", "kiln", "fma"),
    Candidate("kiln-amx", "kiln", "amx"),
    Candidate("onednn-panels", "kiln", "onednn", accepts=("float",)),
    Candidate("onednn", "onednn", accepts=("float",)),
    Candidate("aten", "plain", accepts=tuple(f for f in formats.FORMATS if f not in _BLOCKS)),
    Candidate("kiln-w8a8", "kiln", "w8a8", accepts=("int8",), quantizes_activations=True),
    Candidate("kiln-w8a8-amx", "kiln", "w8a8_amx", accepts=("int8",), quantizes_activations=True),
    Candidate("torch-w8a8", "qlinear", accepts=("int8",), quantizes_activations=True),
    Candidate("kiln-gguf", "kiln", "gguf", accepts=_BLOCKS, quantizes_activations=True),
    Candidate("kiln-gguf-f32", "kiln", "gguf_f32", accepts=_BLOCKS),
)}
LAYOUTS = ("kiln", "onednn", "plain", "qlinear")
# Candidates of another layout that a weight in kiln's layout may run too, from a second copy of the weight held
# beside its panels, with the ``PackedLinear`` kernel that runs it (``packed.PackedLinear.qlinear``). Held where the
# copy wins some row bucket by ``SECOND_COPY_MARGIN`` and kiln's kernels win another (``tactics.table.both_copies``):
# FBGEMM's W8A8 wins prefill-sized buckets where kiln's wins decode (AVX2 and AVX-512 without VNNI), and one layout
# per weight made batch-1 decode pay 2x. The copy costs the int8 weight once more; ``$KILN_TACTICS_SECOND_COPY=0``
# keeps one copy of every weight.
SECOND_COPY = {"torch-w8a8": "qlinear"}
SECOND_COPY_MARGIN = 1.25
SECOND_COPY_ENV = "KILN_TACTICS_SECOND_COPY"
# the candidates that quantize activations where the format does not (W8A8): what a quality gate turns off
ACTIVATION_QUANT = tuple(c.name for c in LINEAR.values() if c.changes_semantics)
EXCLUDE_ENV = "KILN_TACTICS_EXCLUDE"
ALIASES = {"w8a8": ACTIVATION_QUANT}


def expand(names) -> frozenset[str]:
    """Candidate names with the aliases (``w8a8``) spelled out; raises ValueError naming an unknown one."""
    out: set[str] = set()
    for name in names or ():
        if name not in ALIASES and name not in LINEAR:
            raise ValueError(f"{name!r} is not a candidate ({', '.join(LINEAR)}) or {' or '.join(ALIASES)}")
        out.update(ALIASES.get(name, (name,)))
    return frozenset(out)


def second_copy_margin() -> float | None:
    """By how much a ``SECOND_COPY`` candidate must win some row bucket for a weight to hold its copy beside kiln's
    panels (None: never, ``$KILN_TACTICS_SECOND_COPY=0``)."""
    return None if os.environ.get(SECOND_COPY_ENV, "1").strip() == "0" else SECOND_COPY_MARGIN


def known(names) -> bool:
    """Every name is a candidate or an alias (:func:`expand` would take them)."""
    try:
        expand(names or ())
    except (ValueError, TypeError):
        return False
    return True


def excluded(configured=()) -> frozenset[str]:
    """The candidates taken out of a table: ``configured`` (an engine's ``tactics_exclude``, passed by whoever
    loads it) plus ``$KILN_TACTICS_EXCLUDE``'s (names, or ``w8a8``: every candidate that quantizes activations;
    an unknown name is warned about and ignored)."""
    names: set[str] = set(expand(configured))
    for token in os.environ.get(EXCLUDE_ENV, "").replace(",", " ").split():
        if token in ALIASES or token in LINEAR:
            names.update(ALIASES.get(token, (token,)))
        else:
            logging.getLogger("kiln.engine.tactics").warning(
                "$%s names %r, which is not a candidate (%s) or %s; ignored", EXCLUDE_ENV, token, ", ".join(LINEAR),
                " or ".join(ALIASES))
    return frozenset(names)


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


def why_not(name: str, dtype: torch.dtype, native, quant: str | None = None,
            exclude: frozenset[str] | tuple = ()) -> str | None:
    """Why candidate ``name`` cannot run a linear with ``dtype`` activations (and a ``quant`` weight, a format
    key) on this host (``native``: kiln's loaded CPU kernels, or None; ``exclude``: the engine's
    ``tactics_exclude``)."""
    cand, fmt = LINEAR[name], formats.of(quant)
    if name in excluded(exclude):
        return f"tactics_exclude or ${EXCLUDE_ENV} excludes it"
    if fmt.name not in cand.accepts:
        return f"{name} multiplies {' / '.join(cand.accepts)} weights, not {fmt.name} ones"
    if cand.layout == "kiln":
        return _kiln_why_not(cand, dtype, native)
    return {"qlinear": torch_w8a8.unavailable, "onednn": lambda: onednn_unavailable(dtype)}.get(
        cand.layout, lambda: None)()


def _kiln_why_not(cand: Candidate, dtype: torch.dtype, native) -> str | None:
    if native is None:
        return "kiln's CPU kernels are not loaded"
    why = native.gemm_kernels.get(dtype, {}).get(cand.gemm_kernel, f"kiln's GEMM takes no {dtype}")
    if why is None and cand.gemm_kernel == "fma" and dtype not in native.linear_dtypes:
        why = f"kiln's GEMM does not pack {dtype} here"
    return why


def stack_candidate(quant: str | None) -> str:
    """The kiln candidate whose runnability says a linear of ``quant`` weights can join the decoder stack."""
    fmt = formats.of(quant)
    return next(c.name for c in LINEAR.values() if c.layout == "kiln" and fmt.name in c.accepts)


def pack(layout: str, weight: torch.Tensor, native, batch_hint: int = 64, tactics=None,
         scale: torch.Tensor | None = None, dtype: torch.dtype | None = None, share_onednn: bool | None = None):
    """``weight`` [out, in] in ``layout``: a ``kernels.native.PackedLinear`` (kiln; ``tactics`` = its GEMM
    kernel per row bucket; an int8 weight with its ``scale`` for ``dtype`` activations; ``share_onednn``: as
    ``Kernels.pack_linear``), an opaque oneDNN tensor, torch's prepacked int8 weight (qlinear: a
    ``torch_w8a8.QLinear``), or the weight itself (plain)."""
    if layout == "qlinear":
        return torch_w8a8.QLinear(weight, scale)
    if layout == "kiln":  # a GGUF block weight carries its type (formats.of_weight)
        return native.pack_linear(weight.detach(), tactics, scale, dtype, share_onednn,
                                  getattr(weight, "gguf_type", None))
    if layout == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
    return weight.detach()


def run(packed, x: torch.Tensor, bias: torch.Tensor | None, plain: bool = False,
        scale: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through whatever ``pack`` made of the weight (a plain int8 weight: with
    its ``scale``, by torch's int8 path)."""
    if plain and scale is not None:
        return quantized_linear(x, packed, scale, bias)
    if plain:
        return F.linear(x, packed, bias)
    if isinstance(packed, torch.Tensor):
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return packed(x, bias)
