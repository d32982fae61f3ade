"""Linear layers that know their tensor-parallel shard, and weight-only quantization.

Each parameter carries a ``weight_loader(param, tensor, shard_id=None)`` that
copies *its* slice of a full checkpoint tensor, so loading is data-driven
(see ``weights.py``): column-parallel layers split the output dimension,
row-parallel layers split the input dimension and all-reduce their output,
and the fused ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` place each
checkpoint tensor (``shard_id`` q/k/v or 0/1) at its offset in the fused weight.

Weight-only quantization (``int8`` / ``fp8``): ``weight`` holds int8 or
float8_e4m3fn values and ``weight_scale`` one float32 scale per output channel;
the forward pass dequantizes on the fly into the activation dtype (no fp8
matmul kernels are assumed), except int8 with bf16 activations on CPU, which
uses torch's int8-weight matmul (same math, scale applied to the output).
On CPU in bf16, unquantized weights are prepacked for oneDNN (``pack_model``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kiln.engine import parallel
from torch import nn

_HAS_INT8_MM = hasattr(torch, "_weight_int8pack_mm")
QUANT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
_QMAX = {"int8": 127.0, "fp8": 448.0}


def quantize_weight(w: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric quantization of a [out, in] weight -> (q, float32 scale[out])."""
    if method not in QUANT_DTYPES:
        raise ValueError(f"quantization must be one of {', '.join(QUANT_DTYPES)}, got {method!r}")
    w32 = w.to(torch.float32)
    scale = (w32.abs().amax(dim=1) / _QMAX[method]).clamp(min=1e-12)
    scaled = w32 / scale[:, None]
    if method == "int8":
        q = scaled.round().clamp(-127, 127).to(torch.int8)
    else:
        q = scaled.clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({d})")
    return n // d


class LinearBase(nn.Module):
    """y = x W^T + b over this rank's shard of W."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = parallel.tp_rank(), parallel.tp_size()
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.weight_scale: nn.Parameter | None = None
        self.packed_weight: torch.Tensor | None = None  # see pack_for_cpu_

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded)

    @property
    def quantization(self) -> str | None:
        if self.weight_scale is None:
            return None
        return "int8" if self.weight.dtype == torch.int8 else "fp8"

    def quantize_(self, method: str) -> None:
        """Replace the loaded float weight by its quantized form (runtime quantization)."""
        q, scale = quantize_weight(self.weight.data, method)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)

    def make_quantized_(self, method: str) -> None:
        """Empty quantized parameters to receive a pre-quantized (artifact) state dict."""
        self.weight = nn.Parameter(torch.empty(self.weight.shape, dtype=QUANT_DTYPES[method]), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(self.weight.shape[0], dtype=torch.float32, device=self.weight.device),
                                         requires_grad=False)

    def pack_for_cpu_(self, batch_hint: int) -> None:
        """Serve from a oneDNN-prepacked copy of the (bf16) weight and drop the plain one (see pack_model)."""
        self.packed_weight = prepack(self.weight.detach(), batch_hint)
        self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, bias)
        if self.weight_scale is None:
            return F.linear(x, self.weight, bias)
        if self.weight.dtype == torch.int8 and x.dtype == torch.bfloat16 and x.device.type == "cpu" and _HAS_INT8_MM \
                and x.shape[-1] % 32 == 0:
            # int8 x bf16 kernel: reads the int8 weight once instead of materializing a bf16 copy. It
            # crashes (segfault, torch 2.13) for input sizes that are not a multiple of 8; 32 keeps clear.
            x2 = x.reshape(-1, x.shape[-1]).contiguous()
            y = torch._weight_int8pack_mm(x2, self.weight, self.weight_scale.to(x.dtype))
            y = y.view(*x.shape[:-1], -1)
            return y if bias is None else y + bias
        w = self.weight.to(x.dtype) * self.weight_scale.to(x.dtype)[:, None]
        return F.linear(x, w, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Splits the output dimension; each rank produces its slice of the output."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, _divide(output_size, parallel.tp_size(), "output size"), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.data.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one weight (gate and up projections)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; each rank holds its query heads and their KV heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        tp = parallel.tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp, "num_attention_heads")
        self.num_kv_heads = _divide(num_kv_heads, tp, "num_key_value_heads")
        output_size = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))


class RowParallelLinear(LinearBase):
    """Splits the input dimension; partial products are summed across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(_divide(input_size, parallel.tp_size(), "input size"), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.data.dim() == 1:  # bias: added once, after the reduction
            param.data.copy_(loaded)
            return
        size = param.data.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = parallel.all_reduce(self._linear(x, None))
        return y if self.bias is None else y + self.bias


def can_prepack(device: str, dtype: torch.dtype) -> bool:
    """float32 on any CPU oneDNN runs; bf16 on a CPU whose oneDNN has bf16 kernels (AVX512-BF16 / AMX).

    For float32, aten's linear is MKL's sgemm on the plain weight; oneDNN's prepacked
    kernel is 1.5-4x faster at decode-size row counts (16-64) and no slower on prefill
    chunks (measured with torch 2.13, one thread, on an AVX-512 EPYC).
    """
    mkldnn = torch.ops.mkldnn
    if device != "cpu" or not torch.backends.mkldnn.is_available() or not hasattr(mkldnn, "_reorder_linear_weight"):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and mkldnn._is_mkldnn_bf16_supported())


def prepack(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_model(model: nn.Module, batch_hint: int) -> int:
    """Prepack every unquantized linear and the LM head for oneDNN; returns how many were packed.

    aten's bf16 linear on CPU already runs oneDNN but reorders the weight into the
    kernel's blocked layout on every call; packing once makes small-batch (decode)
    matmuls about 2x faster with bit-identical results. The packed copies are opaque
    tensors outside the state dict.
    """
    from kiln.engine.layers.embedding import ParallelLMHead

    count = 0
    for m in model.modules():
        if isinstance(m, LinearBase) and m.weight_scale is None:
            m.pack_for_cpu_(batch_hint)
            count += 1
        elif isinstance(m, ParallelLMHead):
            m.packed_weight = prepack(m.weight.detach(), batch_hint)  # tied: the embedding keeps the weight
            count += 1
    return count
