"""kiln's CPU kernels (``csrc/*.c``) through ctypes: attention, the fused pointwise ops, the GEMMs, the layer stack.

Where the library comes from (an artifact's shipped copy, or compiled here for the host's ISA level) is
``cpu_library.py``'s; which kernels of it may run on this host (``isa.py``) is reported per GEMM kernel in
``Kernels.gemm_kernels``, and which one *does* run for a weight is its tactic table's choice per row bucket
(``PackedLinear.set_tactics``; ``kiln.engine.tactics``), applied in C by ``kiln_gemm`` for the module path
and the decoder stack alike.
"""

from __future__ import annotations

import ctypes
import functools
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from kiln.engine.kernels import cpu_library, gguf_blocks, torch_w8a8
from kiln.engine.kernels.isa import amx_tile_state, feature_missing, log, vnni_flag, w8a8_amx_units, w8a8_units
from kiln.engine.kernels.kernel_timers import GEMM, KernelTimers
from kiln.engine.kernels.packed import GEMM_KERNELS, PYTHON_KERNELS, ROW_BUCKETS, KilnWeight, PackedLinear, row_bucket

__all__ = ["GEMM_KERNELS", "ROW_BUCKETS", "DecoderStack", "Kernels", "KilnWeight", "PackedLinear", "kernels",
           "reset", "row_bucket", "supports"]


class Kernels:
    """The loaded library, with argument types declared once."""

    def __init__(self, path: Path, level: str) -> None:
        self.path, self.level = path, level
        lib = ctypes.CDLL(str(path))
        if lib.kiln_abi_version() != cpu_library.ABI_VERSION:
            raise RuntimeError(f"{path} has ABI {lib.kiln_abi_version()}, this kiln needs {cpu_library.ABI_VERSION}")
        i64, ptr, f32, flag = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int

        def declare(name: str, restype, *argtypes):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, list(argtypes)
            return fn

        self._attention = declare("kiln_paged_attention", ctypes.c_int, *[ptr] * 7, *[i64] * 9, f32, flag, i64)
        # Prefill groups of at least this many query vectors attend on AMX tiles (0: never); the tactic table's
        # choice (kiln.engine.tactics), for a bf16 cache in pair layout.
        self.attention_amx_queries = 0
        self._silu_mul = declare("kiln_silu_mul", None, *[ptr] * 2, *[i64] * 4, flag)
        self._rms_norm = declare("kiln_add_rms_norm", None, *[ptr] * 5, *[i64] * 2, f32, flag)
        self._rotary = declare("kiln_rotary", None, *[ptr] * 3, *[i64] * 5, flag)
        self._cache_write = declare("kiln_cache_write", None, *[ptr] * 5, *[i64] * 7, flag)
        self._pack_linear = {torch.float32: declare("kiln_pack_linear_f32", None, *[ptr] * 2, *[i64] * 3),
                             torch.bfloat16: declare("kiln_pack_linear_bf16", None, *[ptr] * 2, *[i64] * 3),
                             torch.int8: declare("kiln_pack_linear_i8", None, *[ptr] * 3, *[i64] * 3)}
        self._w8a8_quantize = declare("kiln_w8a8_quantize", None, *[ptr] * 3, *[i64] * 3, flag)
        self._gemm = declare("kiln_gemm", ctypes.c_int, ctypes.POINTER(KilnWeight), *[ptr] * 3, *[i64] * 3)
        self.linear_panel = declare("kiln_linear_panel", i64)()
        self.bf16_panel_pairs = declare("kiln_bf16_panel_pairs", i64, i64)
        self._stack = declare("kiln_decoder_stack", ctypes.c_int, ptr, ptr, i64, ptr, ptr, flag, i64, ptr, ptr, i64,
                              ptr, ptr, i64, ptr, ptr, i64, ptr)
        self._stack_workspace = declare("kiln_stack_workspace", i64, ptr, i64)
        self.timers = KernelTimers(lib)  # opt-in per-component timers (kernel_timers.py; kiln bench --profile)
        # dtype -> GEMM kernel -> None (runs here) or why not. bf16 needs vdpbf16ps (the x86-64-v4 library on a
        # CPU with AVX512-BF16) to pack and to run at all; AMX tiles also need the kernel's leave to use them.
        bf16_fma = None if declare("kiln_linear_bf16_available", ctypes.c_int)() else f"not in the {level} library"
        bf16_fma = bf16_fma or feature_missing("avx512_bf16", level)
        amx = feature_missing("amx", level) or bf16_fma or amx_tile_state(declare)
        w8a8, self.w8a8_isa = w8a8_units(declare, level)
        w8a8_amx = w8a8_amx_units(declare, level, w8a8)
        # GGUF block weights (gguf_blocks.PackedGGUF): vpdpbusd where VNNI may run here (the library's width, as
        # W8A8's), else AVX2 / portable code
        self.gguf = gguf_blocks.declare(lib)
        self.gguf["set_vnni"](int(feature_missing(vnni_flag(level), level) is None))
        mkldnn = torch.ops.mkldnn
        onednn = None if torch.backends.mkldnn.is_available() and mkldnn._is_mkldnn_bf16_supported() else \
            "torch's oneDNN has no bf16 kernels on this CPU"
        self.gemm_kernels: dict[torch.dtype, dict[str, str | None]] = {
            torch.float32: {"fma": None, "amx": "AMX multiplies bf16, not float32",
                            "onednn": "oneDNN packs float32 weights in another layout than kiln's panels",
                            "w8a8": w8a8, "w8a8_amx": w8a8_amx, "gguf": None, "gguf_f32": None,
                            "qlinear": torch_w8a8.unavailable()},
            torch.bfloat16: {"fma": bf16_fma, "amx": amx, "onednn": bf16_fma or onednn, "w8a8": bf16_fma or w8a8,
                             "w8a8_amx": bf16_fma or w8a8_amx,
                             "gguf": None, "gguf_f32": "the dequantizing GGUF kernel takes float32 activations",
                             "qlinear": torch_w8a8.unavailable()}}
        self.linear_dtypes = tuple(dt for dt, ks in self.gemm_kernels.items() if ks["fma"] is None)

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        ctx_lens: torch.Tensor, scale: float, out: torch.Tensor,
                        row_starts: torch.Tensor | None = None) -> None:
        """Attention of every row of q [rows, heads, d] over its ``ctx_lens`` tokens in the blocks of its
        ``block_tables`` row, into ``out`` (see ``kiln_paged_attention``). ``row_starts`` groups rows that share
        a table (``layers/paged_metadata.token_rows``); None = every row alone. int32 tables, lengths and
        groups, unit strides in the last two dims; dtypes as ``supports``."""
        kvh, num_blocks, block_size, d = k_cache.shape
        rows, heads, _ = q.shape
        if row_starts is None:
            row_starts = torch.arange(rows + 1, dtype=torch.int32)
        rc = self._attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                             ctx_lens.data_ptr(), row_starts.data_ptr(), out.data_ptr(), row_starts.shape[0] - 1,
                             heads, kvh, num_blocks, block_size, d, block_tables.stride(0), q.stride(0), out.stride(0),
                             scale, self.kv_mode(q.dtype), self.attention_amx_queries)
        if rc:
            raise MemoryError("kiln CPU attention could not allocate its scratch memory")

    # The pointwise kernels take float32 or bfloat16 tensors whose last dimension is contiguous (the
    # callers' layers guarantee it: they run only when the runner picked "native" for these dtypes).
    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x[:, :n]) * x[:, n:] for the fused gate|up output x [rows, 2n]."""
        rows, n = x.shape[0], x.shape[1] // 2
        out = x.new_empty((rows, n))
        self._silu_mul(x.data_ptr(), out.data_ptr(), rows, n, x.stride(0), n, _bf16(x))
        return out

    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
        """RMSNorm(x) or (RMSNorm(x + residual), x + residual), as layers/norm.RMSNorm; x, residual contiguous 2-D."""
        out = torch.empty_like(x)
        res_out = None if residual is None else torch.empty_like(x)
        self._rms_norm(x.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
                       0 if res_out is None else res_out.data_ptr(), x.shape[0], x.shape[1], eps, _bf16(x))
        return out if residual is None else (out, res_out)

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE in place over x [tokens, heads, d] (rows strided, heads packed), cos/sin [tokens, 1, d]."""
        tokens, heads, d = x.shape
        self._rotary(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens, heads, d, x.stride(0), cos.stride(0), _bf16(x))
        return x

    def cache_write(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slots: torch.Tensor) -> None:
        """Write the step's k/v [tokens, kv_heads, d] into their int64 ``slots`` of caches shaped
        [kv_heads, blocks, block_size, d], in the kernels' own layout (``kv_mode``; ``read_cache`` gives
        torch's back): K blocks transposed and V as rows, or both in bf16 pairs."""
        kvh, num_blocks, block_size, d = k_cache.shape
        self._cache_write(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
                          k.shape[0], kvh, d, k.stride(0), v.stride(0), num_blocks, block_size, self.kv_mode(k.dtype))

    def kv_mode(self, dtype: torch.dtype) -> int:
        """The kernels' ``bf16`` argument for a cache of ``dtype``: 0 float32, 1 bfloat16, 2 bfloat16 where this
        host runs vdpbf16ps (the pair layout, csrc/attention_bf16.c, for 16-token blocks and head sizes that
        are multiples of 32)."""
        if dtype != torch.bfloat16:
            return 0
        return 2 if self.gemm_kernels[torch.bfloat16]["fma"] is None else 1

    def read_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of a cache the kernels wrote, as torch lays it out: [kv_heads, blocks, block_size, d] each."""
        kvh, nb, bs, d = k_cache.shape
        if self.kv_mode(k_cache.dtype) == 2 and bs == 16 and d % 32 == 0:
            keys = k_cache.view(kvh, nb, d // 2, bs, 2).permute(0, 1, 3, 2, 4).reshape(kvh, nb, bs, d)
            return keys, v_cache.view(kvh, nb, bs // 2, d, 2).permute(0, 1, 2, 4, 3).reshape(kvh, nb, bs, d)
        return k_cache.view(kvh, nb, d, bs).transpose(-1, -2).clone(), v_cache.clone()

    def store_cache(self, keys: torch.Tensor, values: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Write whole caches given in torch's layout ([kv_heads, blocks, block_size, d]) in the kernels' own."""
        kvh, nb, bs, d = k_cache.shape
        rows = lambda t: t.permute(1, 2, 0, 3).reshape(nb * bs, kvh, d).contiguous()  # noqa: E731
        self.cache_write(rows(keys), rows(values), k_cache, v_cache, torch.arange(nb * bs))

    def pack_linear(self, weight: torch.Tensor, tactics: Sequence[str] | None = None, scales: torch.Tensor | None = None,
                    dtype: torch.dtype | None = None, share_onednn: bool | None = None,
                    gguf_type: str | None = None) -> PackedLinear:
        """A weight [out, in] of one of ``linear_dtypes`` (or int8 with its float32 ``scales`` [out], multiplying
        ``dtype`` activations) in the GEMM's panel layout (a copy; the caller drops the original), run by
        ``tactics`` (one GEMM kernel name per row bucket; default FMA). ``share_onednn``: pack it by oneDNN
        where that gives the same bytes (default: when a bucket runs ``"onednn"``). A uint8 GGUF block weight
        (``gguf_type``) becomes a ``gguf_blocks.PackedGGUF``."""
        if weight.dtype == torch.uint8:
            return gguf_blocks.PackedGGUF(self, weight, gguf_type, tactics, dtype)
        return PackedLinear(self, weight, tactics, scales, dtype, share_onednn)

    def w8a8_quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 [rows, k], float32 scales [rows, ceil(k / 32)]): the activations W8A8 multiplies, as the kernel
        quantizes them (per row and 32-block of K, symmetric: round(x * (127 / max|x_b|)) in float32, scale
        max|x_b| / 127)."""
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        q = torch.empty(x2.shape, dtype=torch.int8)
        sx = torch.empty(x2.shape[0], -(-x2.shape[1] // 32), dtype=torch.float32)
        self._w8a8_quantize(x2.data_ptr(), q.data_ptr(), sx.data_ptr(), x2.shape[0], x2.shape[1], x2.stride(0), _bf16(x2))
        return q, sx

    def linear(self, x: torch.Tensor, packed: PackedLinear, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` for x [..., in] of the weight's dtype and the weight ``packed``, by the
        kernel its tactics name for this many rows (``kiln_gemm``; float32 accumulation, bf16 rounded once)."""
        n, k = packed.out_features, packed.in_features
        if x.dtype != packed.dtype:
            raise TypeError(f"kiln's CPU linear: input {x.dtype}, weight {packed.dtype}")
        x2 = x.reshape(-1, k)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        kernel = packed.tactics[row_bucket(x2.shape[0])]
        if kernel in PYTHON_KERNELS:  # oneDNN's GEMM on the same panels, or torch's W8A8 on its own copy
            start = time.perf_counter_ns() if self.timers.on else 0
            y = torch.ops.mkldnn._linear_pointwise(x2, packed.onednn, bias, "none", [], "") if kernel == "onednn" \
                else packed.qlinear(x2, bias)
            if start:
                self.timers.add(GEMM, start)
            return y.view(*x.shape[:-1], n)
        y = x2.new_empty((x2.shape[0], n))
        if x2.shape[0]:
            b = None if bias is None else bias.float().contiguous()
            if self._gemm(ctypes.byref(packed.weight), x2.data_ptr(), 0 if b is None else b.data_ptr(), y.data_ptr(),
                          x2.shape[0], x2.stride(0), n):
                raise MemoryError("kiln's int8 GEMM could not allocate its widened panel (or quantized activations)")
        return y.view(*x.shape[:-1], n)


class StackLayer(ctypes.Structure):
    """``struct kiln_layer``: one decoder layer's weights and KV cache, as addresses."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "input_norm", "post_norm", "qkv", "o", "gate_up", "down", "qkv_bias", "gate_up_bias", "o_bias", "down_bias",
        "k_cache", "v_cache", "q_norm", "k_norm")] + [("rope", ctypes.c_int64)]


class StackShape(ctypes.Structure):
    """``struct kiln_stack``: the layers' sizes, shared by every layer of the stack."""

    _fields_ = [(name, ctypes.c_int64) for name in (
        "hidden", "heads", "kv_heads", "head_dim", "inter", "num_blocks", "block_size", "mlp_rows",
        "attn_amx_queries")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("bf16", ctypes.c_int32)]


class DecoderStack:
    """A pipeline stage's decoder layers run by one C call per forward pass (``kiln_decoder_stack``): the
    kernels the per-module path calls, in its order, with its results; none of its Python in between.

    ``layers`` holds one dict per layer with the ``StackLayer`` fields: tensors (norm weights, biases, the
    KV caches) or ``PackedLinear`` (the four weights). The biases must already be in the dtype the C side
    reads (float32 for qkv / gate_up, the model dtype for o / down). Every tensor is kept referenced here,
    so the addresses stay valid for the stack's life."""

    def __init__(self, kernels: Kernels, shape: dict, layers: list[dict], dtype: torch.dtype) -> None:
        self._kernels, self.dtype = kernels, dtype
        self._keep: list = []

        def address(value) -> int | None:
            if value is None or isinstance(value, int):  # absent, or a flag (rope)
                return value
            self._keep.append(value)
            return ctypes.addressof(value.weight) if isinstance(value, PackedLinear) else value.data_ptr()

        self.shape = StackShape(**shape, attn_amx_queries=kernels.attention_amx_queries, bf16=kernels.kv_mode(dtype))
        self.layers = (StackLayer * len(layers))(*[StackLayer(**{k: address(v) for k, v in layer.items()})
                                                   for layer in layers])
        self.num_layers = len(layers)
        self._workspace = torch.empty(0, dtype=torch.uint8)
        # Row buckets some linear runs on oneDNN, which only Python can call: such a step takes the module path.
        self._python = {role: {b for layer in layers for b, t in enumerate(layer[role].tactics) if t in PYTHON_KERNELS}
                        for role in ("qkv", "o", "gate_up", "down")}

    def can_run(self, tokens: int) -> bool:
        """Whether every linear runs a step of ``tokens`` rows in C (the MLP sees them in slices of mlp_rows)."""
        mlp = row_bucket(min(tokens, self.shape.mlp_rows))
        return not ({row_bucket(tokens)} & (self._python["qkv"] | self._python["o"])
                    or {mlp} & (self._python["gate_up"] | self._python["down"]))

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 slots: torch.Tensor, block_tables: torch.Tensor, ctx_lens: torch.Tensor,
                 row_starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) after every layer, for x [tokens, hidden] and the running residual (None before
        the first layer). x and residual are the step's own activations: they are overwritten in place.
        cos/sin [tokens, 1, head_dim]; the rest as ``Kernels.cache_write`` / ``paged_attention`` take them."""
        tokens = x.shape[0]
        x = x.contiguous()
        first = residual is None
        residual = torch.empty_like(x) if first else residual.contiguous()
        need = self._kernels._stack_workspace(ctypes.byref(self.shape), tokens)
        if self._workspace.numel() < need:
            self._workspace = torch.empty(need, dtype=torch.uint8)
        rc = self._kernels._stack(ctypes.byref(self.shape), self.layers, self.num_layers, x.data_ptr(),
                                  residual.data_ptr(), int(first), tokens, cos.data_ptr(), sin.data_ptr(), cos.stride(0),
                                  slots.data_ptr(), block_tables.data_ptr(), block_tables.stride(0), ctx_lens.data_ptr(),
                                  row_starts.data_ptr(), row_starts.shape[0] - 1, self._workspace.data_ptr())
        if rc:
            raise MemoryError("kiln's CPU kernels could not allocate their scratch memory")
        return x, residual


def _bf16(t: torch.Tensor) -> int:
    return int(t.dtype == torch.bfloat16)


SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def supports(dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    return dtype == cache_dtype and dtype in SUPPORTED_DTYPES



_failed: list[str] = []  # why the library did not load, once logged


@functools.lru_cache(maxsize=1)
def _library(installs: int) -> Kernels | None:
    """The library for this host, loaded once per ``cpu_library.installs()`` (an artifact's copy installed
    later replaces one loaded before)."""
    where = cpu_library.locate()
    if isinstance(where, tuple) and where[0] == cpu_library._shipped.get(where[1]):
        try:
            return Kernels(*where)
        except (OSError, RuntimeError) as exc:
            log.warning("kiln CPU kernels: the artifact's %s library does not load (%s); compiling here", where[1], exc)
            where = cpu_library.locate(shipped=False)
    if isinstance(where, str):
        if where == "KILN_CPU_KERNELS=0":
            log.info("kiln CPU kernels off (KILN_CPU_KERNELS=0): attention runs on torch")
        else:
            log.warning("kiln CPU kernels unavailable (%s); attention runs on torch", where)
        return None
    try:
        return Kernels(*where)
    except (OSError, RuntimeError) as exc:
        log.warning("kiln CPU kernels unavailable (%s); attention runs on torch", exc)
        return None


def kernels() -> Kernels | None:
    """The CPU kernels for this host, or None (the engine then runs its torch path)."""
    return _library(cpu_library.installs())


def reset() -> None:
    """Forget the loaded library (after ``cpu_library.install_shipped``, or a test's change of environment)."""
    _library.cache_clear()
