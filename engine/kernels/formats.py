"""The weight formats a linear holds, one row each (ggml's ``type_traits`` beside ``type_traits_cpu``).

The kernel table (``candidates.py``) says what can run a weight; this table says what the weight *is*:

=======  ==========  =========  ========================  ===============  ==================================
format   storage     per row    scale                     quantization     activations
=======  ==========  =========  ========================  ===============  ==================================
float    the model   K values   none                      (none)           float
int8     int8        K values   float32 per out channel   ``int8``         float (W8A8 candidates quantize)
fp8      e4m3        K values   float32 per out channel   ``fp8``          float; not a CPU tactic site
q8_0     uint8       K/32 x 34  in each block             ``gguf``         quantized per 32-block
q4_0     uint8       K/32 x 18  in each block             ``gguf``         quantized per 32-block
q4_1     uint8       K/32 x 20  in each block             ``gguf``         quantized per 32-block
=======  ==========  =========  ========================  ===============  ==================================

``quantization`` is the engine setting that makes a weight of the row (``EngineConfig.quantization``). A
format whose ``activations_quantized`` is set is defined with quantized activations (GGUF's kernels, as
llama.cpp's, multiply int8 blocks of them); a candidate that quantizes the activations of any other format
changes what the model computes, which is what the build's quality gate measures (``candidates.ACTIVATION_QUANT``).

Layers, the tactics and the loaders ask this table (``of_weight``, ``row.in_features``, ``row.quantize``)
instead of naming formats. A new quantization family is one row here, one candidate row in
``candidates.LINEAR`` that accepts it, and one C file in ``csrc/``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kiln.engine.kernels import gguf_blocks
from kiln.engine.kernels.fp8 import FP8_DTYPE, FP8_MAX

FLOAT = "float"


@dataclass(frozen=True)
class WeightFormat:
    name: str  # the tactic site's key suffix (``float32+q4_1:576x576``); "float" has none
    storage: torch.dtype | None  # how the weight is held (None: in the model's float dtype)
    quantization: str | None  # the EngineConfig.quantization that makes such weights
    qmax: float = 0.0  # per-output-channel formats: the largest stored magnitude (scale = max|w_row| / qmax)
    gguf_type: str | None = None  # block formats: ggml's type name (``gguf_blocks.GGUF_TYPES``)
    activations_quantized: bool = False  # the format's kernels multiply quantized activations by definition
    tactic_site: bool = True  # timed and packed by the tactic table (fp8 keeps torch's path, quant_linear.py)

    @property
    def key(self) -> str | None:
        """The site key's suffix (None for float weights)."""
        return None if self.name == FLOAT else self.name

    @property
    def scaled(self) -> bool:
        """One float32 scale per output channel beside the weight."""
        return self.qmax > 0

    def in_features(self, weight: torch.Tensor) -> int:
        """K of a stored ``[N, ...]`` weight."""
        return gguf_blocks.in_features(weight, self.gguf_type) if self.gguf_type else weight.shape[-1]

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A float ``[N, K]`` weight in this format -> (weight, float32 scale [N] or None): how a timing run
        makes a weight of the format, and how an engine quantizes at load."""
        if self.gguf_type:
            return gguf_blocks.quantize(w, self.gguf_type), None
        if not self.scaled:
            return w, None
        w32 = w.to(torch.float32)
        scale = (w32.abs().amax(dim=1) / self.qmax).clamp(min=1e-12)
        scaled = w32 / scale[:, None]
        if self.storage == torch.int8:
            return scaled.round().clamp(-self.qmax, self.qmax).to(torch.int8), scale
        return scaled.clamp(-self.qmax, self.qmax).to(self.storage), scale


FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    WeightFormat(FLOAT, None, None),
    WeightFormat("int8", torch.int8, "int8", qmax=127.0),
    WeightFormat("fp8", FP8_DTYPE, "fp8", qmax=FP8_MAX, tactic_site=False),
    *(WeightFormat(kind.lower(), torch.uint8, "gguf", gguf_type=kind, activations_quantized=True)
      for kind in gguf_blocks.GGUF_TYPES),
)}
# the formats each engine quantization makes (gguf: the file's block types, per tensor)
BY_QUANTIZATION: dict[str | None, tuple[WeightFormat, ...]] = {
    q: tuple(f for f in FORMATS.values() if f.quantization == q) for q in dict.fromkeys(
        f.quantization for f in FORMATS.values())}
SITE_KEYS = tuple(f.key for f in FORMATS.values() if f.tactic_site and f.key)  # a table's ``<dtype>+<key>``


def of(key: str | None) -> WeightFormat:
    """The row of a site's ``quant`` key (None: float); raises ValueError naming an unknown one."""
    row = FORMATS.get(key or FLOAT)
    if row is None:
        raise ValueError(f"weight format {key!r} is not one of {', '.join(FORMATS)}")
    return row


def of_weight(weight: torch.Tensor, scale: torch.Tensor | None = None) -> WeightFormat:
    """The row of a held weight: its storage dtype, a block weight's ``gguf_type``, a scale beside it."""
    kind = getattr(weight, "gguf_type", None)
    for row in FORMATS.values():
        if row.gguf_type is not None and row.gguf_type == kind and weight.dtype == row.storage:
            return row
        if row.scaled and scale is not None and weight.dtype == row.storage:
            return row
    return FORMATS[FLOAT]


def storage(quantization: str | None) -> torch.dtype | None:
    """The dtype weights of an engine ``quantization`` are held in (None: the model's float dtype)."""
    rows = BY_QUANTIZATION.get(quantization)
    if not rows:
        raise ValueError(f"quantization must be one of {', '.join(str(q) for q in BY_QUANTIZATION)}, "
                         f"got {quantization!r}")
    return rows[0].storage


def is_blocks(quantization: str | None) -> bool:
    """Weights of this engine quantization are block rows sized at load (a linear's placeholder is [N, 0])."""
    return any(f.gguf_type for f in BY_QUANTIZATION.get(quantization, ()))


def runtime_quantizable(quantization: str) -> WeightFormat:
    """The one row a float checkpoint is quantized to at load for ``quantization``; block formats keep a GGUF
    file's own blocks and are refused, naming the fix."""
    if is_blocks(quantization):
        raise ValueError(f"quantization {quantization} keeps a GGUF file's own blocks: build the GGUF source into "
                         f"an artifact (spec.quantization: {quantization}); a float checkpoint cannot be quantized "
                         "to it at load")
    rows = [f for f in BY_QUANTIZATION.get(quantization, ()) if f.scaled]
    if len(rows) != 1:
        names = sorted(str(f.quantization) for f in FORMATS.values() if f.scaled)
        raise ValueError(f"quantization must be one of {', '.join(names)}, got {quantization!r}")
    return rows[0]
