"""Linear layers that know their tensor-parallel shard, and weight-only quantization.

Each parameter carries a ``weight_loader(param, tensor, shard_id=None)`` that
copies *its* slice of a full checkpoint tensor, so loading is data-driven
(see ``weights.py``): column-parallel layers split the output dimension,
row-parallel layers split the input dimension and all-reduce their output,
and the fused ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` place each
checkpoint tensor (``shard_id`` q/k/v or 0/1) at its offset in the fused weight.

Weight-only quantization (``int8`` / ``fp8``, ``quant.py``): ``weight`` holds int8 or
float8_e4m3fn values and ``weight_scale`` one float32 scale per output channel, and
``kernels.quant_linear.quantized_linear`` picks the GEMM (int8/fp8 kernels on a GPU, torch's int8-weight
matmul or a per-call dequantization on CPU). Every parameter is created on the device of
the model being built, including the quantized ones that replace the float weight.
On CPU, unquantized weights are packed once at load, each in the layout its tactic table entry chose
(``kiln.engine.tactics``: kiln's GEMM panels, oneDNN's blocked layout, or left plain), and ``packed_weight``
then serves the linear (``packed_linear``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from kiln.engine import parallel
from kiln.engine.kernels import formats
from kiln.engine.kernels.candidates import run
from kiln.engine.kernels.gguf_blocks import gguf_linear
from kiln.engine.kernels.native import Kernels
from kiln.engine.kernels.quant_linear import quantized_linear
from kiln.engine.layers.building import build_dtype
from kiln.engine.layers.quant import quantize_weight
from kiln.engine.lora.config import LoRAConfig
from kiln.engine.lora.layers import LoRASlots, PartKey
from torch import nn

__all__ = ["ColumnParallelLinear", "LinearBase", "MergedColumnParallelLinear", "QKVParallelLinear",
           "RowParallelLinear", "packed_linear", "quantize_weight"]


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({d})")
    return n // d


# Set by born_quantized(), for the thread that builds a model: a pool builds several engines at once, each on a
# thread of its own, and one module-wide value gave a float32 engine's linears the GGUF engine's empty blocks.
_born_quantized: contextvars.ContextVar[str | None] = contextvars.ContextVar("kiln_born_quantized", default=None)


@contextlib.contextmanager
def born_quantized(method: str | None) -> Iterator[None]:
    """Linears constructed inside (in this thread) hold empty ``method`` (int8/fp8) weights and scales from the
    start.

    A quantized artifact's model is thus never allocated in full precision first: building the float
    linears and then swapping them (``make_quantized_``) peaks at the unquantized size, which is what
    quantizing was meant to avoid (70B fp8 on one 80 GB GPU would not fit its own bf16 copy).
    """
    token = _born_quantized.set(method)
    try:
        yield
    finally:
        _born_quantized.reset(token)


class LinearBase(nn.Module):
    """y = x W^T + b over this rank's shard of W (plus, with LoRA on, the step's adapter deltas)."""

    lora: LoRASlots | None = None  # its adapter slots when the engine serves adapters (``enable_lora``)

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = parallel.tp_rank(), parallel.tp_size()
        self.input_size, self.output_size = input_size, output_size
        method = _born_quantized.get()
        # block formats: the file's blocks (uint8, sized at load by weights.load_engine_state, gguf_blocks.py)
        self.weight = nn.Parameter(torch.empty(output_size, 0 if formats.is_blocks(method) else input_size,
                                               dtype=formats.storage(method) or build_dtype()), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=build_dtype()), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.weight_scale: nn.Parameter | None = None
        if method and not formats.is_blocks(method):
            self.weight_scale = nn.Parameter(torch.empty(output_size, dtype=torch.float32), requires_grad=False)
        self.packed_weight = None  # a packed copy on CPU, set by kiln.engine.tactics.bind (the plain one is dropped)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded)

    def enable_lora(self, lora: LoRAConfig, parts: list[tuple[PartKey, int, int]], row_parallel: bool,
                    stack_dtype: torch.dtype, device: torch.device, kernels: Kernels | None = None) -> LoRASlots:
        """Make this linear's adapter slots (``lora/layers.py``): from now on ``forward`` adds the step's
        adapter deltas (the forward context's LoRA work). ``parts``: as ``LoRASlots`` takes them."""
        self.lora = LoRASlots(self, parts, row_parallel, lora.max_loras, lora.max_rank, stack_dtype, device,
                              kernels, lora.dtype)
        return self.lora

    @property
    def weight_format(self) -> formats.WeightFormat:
        """The row of the format table this linear's weight is held in."""
        return formats.of_weight(self.weight, self.weight_scale)

    @property
    def quantization(self) -> str | None:
        """The engine quantization that makes this linear's weight (None: float)."""
        return self.weight_format.quantization

    def quantize_(self, method: str) -> None:
        """Replace the loaded float weight by its quantized form (runtime quantization)."""
        q, scale = quantize_weight(self.weight.data, method)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)

    def make_quantized_(self, method: str) -> None:
        """Empty quantized parameters to receive a pre-quantized (artifact) state dict, on the device of
        the float weight they replace (a model built on CUDA keeps its quantized weights there)."""
        shape, device = self.weight.shape, self.weight.device
        self.weight = nn.Parameter(torch.empty(shape, dtype=formats.storage(method), device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(shape[0], dtype=torch.float32, device=device), requires_grad=False)

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, bias)
        fmt = self.weight_format
        if fmt.gguf_type:  # GGUF blocks without kiln's kernels: dequantized per call
            return gguf_linear(x, self.weight, fmt.gguf_type, bias)
        if not fmt.scaled:
            return F.linear(x, self.weight, bias)
        return quantized_linear(x, self.weight, self.weight_scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._linear(x, self.bias)
        return y if self.lora is None else self.lora.add_to(y, x)


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
        y = self._linear(x, None)
        if self.lora is not None:  # this rank's partial LoRA delta, summed by the same all-reduce
            y = self.lora.add_to(y, x)
        y = parallel.all_reduce(y)
        return y if self.bias is None else y + self.bias


def packed_linear(x: torch.Tensor, packed, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` through a packed weight (a ``kernels.native.PackedLinear`` or oneDNN's opaque tensor)."""
    return run(packed, x, bias)
