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
from collections.abc import Sequence
from pathlib import Path

import torch
from kiln.engine.kernels import cpu_library
from kiln.engine.kernels.isa import feature_missing, log

ROW_BUCKETS = 16  # = KILN_ROW_BUCKETS: bucket b holds calls of (2^(b-1), 2^b] rows
GEMM_KERNELS = {"fma": 0, "amx": 1}  # = enum kiln_gemm_kernel


def row_bucket(rows: int) -> int:
    """The tactic bucket of a call with ``rows`` rows (as ``row_bucket`` in csrc/gemm.c)."""
    return min(ROW_BUCKETS - 1, max(0, (int(rows) - 1).bit_length()))


class KilnWeight(ctypes.Structure):
    """``struct kiln_weight``: a packed weight and, per row bucket, the GEMM kernel that multiplies it."""

    _fields_ = [("panels", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("bf16", ctypes.c_int32),
                ("kernel", ctypes.c_uint8 * ROW_BUCKETS)]


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

        self._attention = declare("kiln_paged_attention", ctypes.c_int, *[ptr] * 7, *[i64] * 9, f32, flag)
        self._silu_mul = declare("kiln_silu_mul", None, *[ptr] * 2, *[i64] * 4, flag)
        self._rms_norm = declare("kiln_add_rms_norm", None, *[ptr] * 5, *[i64] * 2, f32, flag)
        self._rotary = declare("kiln_rotary", None, *[ptr] * 3, *[i64] * 5, flag)
        self._cache_write = declare("kiln_cache_write", None, *[ptr] * 5, *[i64] * 7, flag)
        self._pack_linear = {torch.float32: declare("kiln_pack_linear_f32", None, *[ptr] * 2, *[i64] * 3),
                             torch.bfloat16: declare("kiln_pack_linear_bf16", None, *[ptr] * 2, *[i64] * 3)}
        self._gemm = declare("kiln_gemm", None, ctypes.POINTER(KilnWeight), *[ptr] * 3, *[i64] * 3)
        self.linear_panel = declare("kiln_linear_panel", i64)()
        self.bf16_panel_pairs = declare("kiln_bf16_panel_pairs", i64, i64)
        self._stack = declare("kiln_decoder_stack", ctypes.c_int, ptr, ptr, i64, ptr, ptr, flag, i64, ptr, ptr, i64,
                              ptr, ptr, i64, ptr, ptr, i64, ptr)
        self._stack_workspace = declare("kiln_stack_workspace", i64, ptr, i64)
        # dtype -> GEMM kernel -> None (runs here) or why not. bf16 needs vdpbf16ps (the x86-64-v4 library on a
        # CPU with AVX512-BF16) to pack and to run at all; AMX tiles also need the kernel's leave to use them.
        bf16_fma = None if declare("kiln_linear_bf16_available", ctypes.c_int)() else f"not in the {level} library"
        bf16_fma = bf16_fma or feature_missing("avx512_bf16", level)
        amx = feature_missing("amx", level) or bf16_fma
        if amx is None and not declare("kiln_amx_ready", ctypes.c_int)():
            amx = "the kernel refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
        self.gemm_kernels: dict[torch.dtype, dict[str, str | None]] = {
            torch.float32: {"fma": None, "amx": "AMX multiplies bf16, not float32"},
            torch.bfloat16: {"fma": bf16_fma, "amx": amx}}
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
                             scale, _bf16(q))
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
        [kv_heads, blocks, block_size, d]: V as torch lays it out, K blocks transposed (``keys_view``)."""
        kvh, num_blocks, block_size, d = k_cache.shape
        self._cache_write(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
                          k.shape[0], kvh, d, k.stride(0), v.stride(0), num_blocks, block_size, _bf16(k))

    def pack_linear(self, weight: torch.Tensor, tactics: Sequence[str] | None = None) -> PackedLinear:
        """A weight [out, in] of one of ``linear_dtypes`` in the GEMM's panel layout (a copy; the caller
        drops the original), run by ``tactics`` (one GEMM kernel name per row bucket; default FMA)."""
        return PackedLinear(self, weight, tactics)

    def linear(self, x: torch.Tensor, packed: PackedLinear, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` for x [..., in] of the weight's dtype and the weight ``packed``, by the
        kernel its tactics name for this many rows (``kiln_gemm``; float32 accumulation, bf16 rounded once)."""
        n, k = packed.out_features, packed.in_features
        if x.dtype != packed.dtype:
            raise TypeError(f"kiln's CPU linear: input {x.dtype}, weight {packed.dtype}")
        x2 = x.reshape(-1, k)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = x2.new_empty((x2.shape[0], n))
        if x2.shape[0]:
            b = None if bias is None else bias.float().contiguous()
            self._gemm(ctypes.byref(packed.weight), x2.data_ptr(), 0 if b is None else b.data_ptr(), y.data_ptr(),
                       x2.shape[0], x2.stride(0), n)
        return y.view(*x.shape[:-1], n)


class PackedLinear:
    """A weight [out, in] packed for kiln's CPU GEMM: panels of P output columns (P = the library's
    ``kiln_linear_panel``, the last panel zero-padded), [ceil(out / P), in, P] in float32 and
    [ceil(out / P), pairs, P, 2] in bfloat16 (K in pairs, padded to whole AMX tiles: ``kiln_bf16_panel_pairs``;
    one copy serves the vdpbf16ps and AMX kernels), so a
    decode step streams each panel once; calling it is ``F.linear(x, weight, bias)``. ``weight`` is the C
    side's record of it, with the GEMM kernel per row bucket (``set_tactics``)."""

    def __init__(self, kernels: Kernels, weight: torch.Tensor, tactics: Sequence[str] | None = None) -> None:
        if weight.dtype not in kernels.linear_dtypes or weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"kiln's CPU linear packs 2-D CPU weights of {', '.join(map(str, kernels.linear_dtypes))} "
                             f"on this host, not {weight.dtype} {tuple(weight.shape)}")
        if weight.stride(1) != 1:
            weight = weight.contiguous()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        panel, k = kernels.linear_panel, self.in_features
        per_panel = (k, panel) if self.dtype == torch.float32 else (kernels.bf16_panel_pairs(k), panel, 2)
        self.panels = weight.new_empty((-(-self.out_features // panel), *per_panel))
        kernels._pack_linear[self.dtype](weight.data_ptr(), self.panels.data_ptr(), self.out_features, k,
                                         weight.stride(0))
        self._kernels = kernels
        self.weight = KilnWeight(self.panels.data_ptr(), self.out_features, k, int(self.dtype == torch.bfloat16))
        self.set_tactics(tactics or ["fma"] * ROW_BUCKETS)

    def set_tactics(self, tactics: Sequence[str]) -> None:
        """The GEMM kernel (a ``GEMM_KERNELS`` name) for each row bucket; one that cannot run here is refused."""
        if len(tactics) != ROW_BUCKETS:
            raise ValueError(f"tactics name a kernel for each of the {ROW_BUCKETS} row buckets, got {len(tactics)}")
        for name in set(tactics):
            why = self._kernels.gemm_kernels[self.dtype].get(name, f"not one of {', '.join(GEMM_KERNELS)}")
            if why:
                raise ValueError(f"GEMM kernel {name!r} cannot run {self.dtype} here: {why}")
        self.tactics = tuple(tactics)
        self.weight.kernel[:] = [GEMM_KERNELS[t] for t in tactics]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._kernels.linear(x, self, bias)


class StackLayer(ctypes.Structure):
    """``struct kiln_layer``: one decoder layer's weights and KV cache, as addresses."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "input_norm", "post_norm", "qkv", "o", "gate_up", "down", "qkv_bias", "gate_up_bias", "o_bias", "down_bias",
        "k_cache", "v_cache")]


class StackShape(ctypes.Structure):
    """``struct kiln_stack``: the layers' sizes, shared by every layer of the stack."""

    _fields_ = [(name, ctypes.c_int64) for name in (
        "hidden", "heads", "kv_heads", "head_dim", "inter", "num_blocks", "block_size", "mlp_rows")] + [
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
            if value is None:
                return None
            self._keep.append(value)
            return ctypes.addressof(value.weight) if isinstance(value, PackedLinear) else value.data_ptr()

        self.shape = StackShape(**shape, bf16=_bf16(torch.empty(0, dtype=dtype)))
        self.layers = (StackLayer * len(layers))(*[StackLayer(**{k: address(v) for k, v in layer.items()})
                                                   for layer in layers])
        self.num_layers = len(layers)
        self._workspace = torch.empty(0, dtype=torch.uint8)

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
            raise MemoryError("kiln CPU attention could not allocate its scratch memory")
        return x, residual


def keys_view(k_cache: torch.Tensor) -> torch.Tensor:
    """The keys of a cache the kernels wrote, indexed as torch's layout [kv_heads, blocks, block_size, d]
    (a strided view): ``cache_write`` stores each K block transposed, [d, block_size], so decode scores a
    block with block_size-wide multiply-adds."""
    kvh, num_blocks, block_size, d = k_cache.shape
    return k_cache.view(kvh, num_blocks, d, block_size).transpose(-1, -2)


def _bf16(t: torch.Tensor) -> int:
    return int(t.dtype == torch.bfloat16)


SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def supports(dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    return dtype == cache_dtype and dtype in SUPPORTED_DTYPES



_failed: list[str] = []  # why the library did not load, once logged


@functools.cache
def _library() -> Kernels | None:
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
    return _library()


def reset() -> None:
    """Forget the loaded library (after ``cpu_library.install_shipped``, or a test's change of environment)."""
    _library.cache_clear()
