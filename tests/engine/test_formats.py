"""The weight-format table (kernels/formats.py) beside the kernel table: one row per format, and the layers,
the tactics and ``why_not`` asking it instead of naming formats."""

from __future__ import annotations

import pytest
import torch
from kiln.engine.kernels import candidates, formats, gguf_blocks
from kiln.engine.layers import linear
from kiln.engine.tactics.timing import LinearSite


def test_one_row_per_format_with_what_it_is():
    assert list(formats.FORMATS) == ["float", "int8", "fp8", "q4_0", "q4_1", "q8_0"]
    assert formats.of(None) is formats.FORMATS["float"] and formats.of("q8_0").gguf_type == "Q8_0"
    assert [f.name for f in formats.BY_QUANTIZATION["gguf"]] == ["q4_0", "q4_1", "q8_0"]
    assert formats.SITE_KEYS == ("int8", "q4_0", "q4_1", "q8_0")  # fp8 keeps torch's path: not a tactic site
    assert {f.name for f in formats.FORMATS.values() if f.activations_quantized} == {"q4_0", "q4_1", "q8_0"}
    with pytest.raises(ValueError, match="'q5_k' is not one of float, int8"):
        formats.of("q5_k")


@pytest.mark.parametrize("name", ["int8", "fp8", "q8_0", "q4_0", "q4_1"])
def test_a_row_quantizes_for_timing_and_knows_its_in_features(name):
    fmt = formats.FORMATS[name]
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    q, scale = fmt.quantize(w)
    assert q.dtype == fmt.storage and fmt.in_features(q) == 64 and (scale is not None) == fmt.scaled
    assert formats.of_weight(q, scale) is fmt
    back = gguf_blocks.dequantize(q, fmt.gguf_type) if fmt.gguf_type else q.float() * scale[:, None]
    assert (back - w).abs().max() < w.abs().max() / 4


def test_candidates_declare_the_formats_they_accept():
    """``why_not`` refuses a format a candidate does not accept, in one line naming both; W8A8 is the
    candidates that quantize activations of a format defined without (GGUF's kernel is not: its format is)."""
    assert "kiln-w8a8 multiplies int8 weights, not float ones" == candidates.why_not("kiln-w8a8", torch.float32,
                                                                                       None, None)
    assert "not q4_1 ones" in candidates.why_not("kiln-fma", torch.float32, None, "q4_1")
    assert "not int8 ones" in candidates.why_not("onednn", torch.float32, None, "int8")
    assert candidates.why_not("aten", torch.float32, None, "fp8") is None
    assert candidates.LINEAR["kiln-gguf"].quantizes_activations and "kiln-gguf" not in candidates.ACTIVATION_QUANT
    assert set(candidates.ACTIVATION_QUANT) == {"kiln-w8a8", "kiln-w8a8-amx", "torch-w8a8"}
    assert candidates.stack_candidate("q8_0") == "kiln-gguf" and candidates.stack_candidate(None) == "kiln-fma"


def test_layers_ask_the_table():
    """A linear born quantized holds the row's storage; its format and its tactic site come from the table."""
    from kiln.engine.tactics.bind import linear_modules

    for method, shape in (("int8", (16, 32)), ("fp8", (16, 32)), ("gguf", (16, 0))):
        with linear.born_quantized(method):
            lin = linear.ColumnParallelLinear(32, 16)
        assert tuple(lin.weight.shape) == shape and lin.weight.dtype == formats.storage(method)
    with linear.born_quantized("gguf"):
        lin = linear.ColumnParallelLinear(64, 8)
    lin.weight.data = gguf_blocks.quantize(torch.randn(8, 64), "Q4_1")
    lin.weight.gguf_type = "Q4_1"
    assert lin.weight_format.name == "q4_1" and lin.quantization == "gguf"
    [(_, site)] = linear_modules(lin, 32, 4, torch.float32)
    assert site == LinearSite(torch.float32, 8, 64, 32, quant="q4_1")
    with linear.born_quantized("fp8"):
        assert linear_modules(linear.ColumnParallelLinear(32, 16), 32, 4, torch.float32) == []
    with pytest.raises(ValueError, match="quantization gguf keeps a GGUF file's own blocks"):
        linear.quantize_weight(torch.randn(4, 32), "gguf")
