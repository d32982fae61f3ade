"""kiln's CPU kernels (``cpu_kernels.c``): compiled for the host's ISA level, loaded with ctypes.

The C source has no torch headers, so compiling it takes about a second with the system C compiler
(``$CC``, else ``cc``). Where the compiled library comes from, first match wins:

1. an artifact's shipped copy (``kernels/cpu/<level>.so``, made by the build's ``kernels`` stage),
   for the best ISA level this host's CPU flags allow (``install_shipped``);
2. ``$KILN_CPU_KERNELS_DIR`` (default ``~/.cache/kiln/cpu-kernels``), keyed by a hash of the source
   and the compile command, compiled there on first use (atomic rename: concurrent processes are safe);
3. none: no compiler, no ISA level the host supports, or ``KILN_CPU_KERNELS=0`` -- the engine runs its
   torch path (same results), and the reason is logged once.

ISA levels are the x86-64 micro-architecture levels (``x86-64-v4`` = AVX-512 F/BW/CD/DQ/VL,
``x86-64-v3`` = AVX2 + FMA + ...) and ``armv8-a`` on aarch64; a host runs a library only if its
``/proc/cpuinfo`` flags include every flag of the level (``LEVEL_FLAGS``), so a kernel built for
AVX-512 never dies on an illegal instruction on an AVX2-only host.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("kiln.engine.kernels.native")

SOURCE = Path(__file__).with_name("cpu_kernels.c")
ABI_VERSION = 6  # = KILN_ABI_VERSION in cpu_kernels.c
_V3 = ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "abm", "xsave")
# level -> the /proc/cpuinfo flags a host needs to run code compiled with -march=<level>, best first
LEVEL_FLAGS: dict[str, tuple[str, ...]] = {
    "x86-64-v4": (*_V3, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
    "x86-64-v3": _V3,
    "armv8-a": ("asimd",),
}
_ARCH_LEVELS = {"x86_64": ("x86-64-v4", "x86-64-v3"), "aarch64": ("armv8-a",)}
# The best level the kernels may use (e.g. x86-64-v3 on an AVX-512 host, to run what an AVX2-only host runs).
ISA_ENV = "KILN_CPU_ISA"
_EXTRA = {"x86-64-v4": ("-mprefer-vector-width=512",)}
CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared")


def host_levels(flags: frozenset[str] | None = None) -> list[str]:
    """The ISA levels this host can run, best first, none above ``$KILN_CPU_ISA`` where it is set."""
    from kiln.engine import cpu_target

    flags = cpu_target.cpu_flags() if flags is None else flags
    levels = [lvl for lvl in _ARCH_LEVELS.get(platform.machine(), ()) if set(LEVEL_FLAGS[lvl]) <= flags]
    cap = os.environ.get(ISA_ENV, "").strip()
    if not cap:
        return levels
    known = _ARCH_LEVELS.get(platform.machine(), ())
    if cap not in known:
        log.warning("$%s=%s is not an ISA level of %s (%s); ignored", ISA_ENV, cap, platform.machine(),
                    ", ".join(known) or "none")
        return levels
    return [lvl for lvl in levels if known.index(lvl) >= known.index(cap)]


def compile_command(level: str, out: Path) -> list[str]:
    return [os.environ.get("CC", "cc"), f"-march={level}", *_EXTRA.get(level, ()), *CFLAGS, "-o", str(out), str(SOURCE)]


def library_name(level: str) -> str:
    """A file name that changes whenever the source or the compile flags do."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(compile_command(level, Path("x"))[1:]).encode())
    return f"kiln-cpu-kernels-{level}-{digest.hexdigest()[:12]}.so"


def compile_library(level: str, dest_dir: Path) -> Path:
    """Compile for ``level`` into ``dest_dir`` (atomically); raises RuntimeError naming the compiler's error."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / library_name(level)
    if dest.exists():
        return dest
    cmd = compile_command(level, dest)
    if shutil.which(cmd[0]) is None:
        raise RuntimeError(f"no C compiler: {cmd[0]!r} is not on PATH (set $CC)")
    fd, tmp = tempfile.mkstemp(dir=dest_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        cmd[cmd.index("-o") + 1] = tmp
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, dest)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return dest


def default_dir() -> Path:
    return Path(os.environ.get("KILN_CPU_KERNELS_DIR") or Path.home() / ".cache" / "kiln" / "cpu-kernels")


_shipped: dict[str, Path] = {}  # level -> an artifact's library, set by install_shipped
CPU_DIR = "kernels/cpu"  # where an artifact holds its compiled libraries, one <level>.so per ISA level


def source_digest() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()


def build_for_artifact(artifact_dir: Path) -> dict:
    """Compile for every ISA level of this machine's architecture (not only the ones this CPU runs: the
    serving hosts pick theirs) into ``artifact_dir/CPU_DIR``; returns the ``engine.json["kernels"]`` record."""
    levels = _ARCH_LEVELS.get(platform.machine(), ())
    if not levels:
        return {"packed": False, "reason": f"kiln's CPU kernels are not built for {platform.machine()}"}
    dest = Path(artifact_dir) / CPU_DIR
    libraries = {}
    try:
        for level in levels:
            os.replace(compile_library(level, dest), dest / f"{level}.so")
            libraries[level] = {"file": f"{level}.so", "cpu_flags": list(LEVEL_FLAGS[level])}
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        shutil.rmtree(dest, ignore_errors=True)
        return {"packed": False, "reason": f"kiln's CPU kernels did not compile in the build image ({exc}): "
                                           f"serving hosts with a C compiler compile them at load"}
    return {"packed": True, "device": "cpu", "path": CPU_DIR, "abi": ABI_VERSION, "source_sha256": source_digest(),
            "libraries": libraries}


def install_from_artifact(artifact_dir: str | Path, doc: dict) -> list[str]:
    """Use an artifact's shipped libraries (``build_for_artifact``) when they are this kiln's kernels;
    returns the levels installed."""
    from kiln.engine.kernels.cache import RECORD_KEY

    record = doc.get(RECORD_KEY) or {}
    if record.get("device") != "cpu" or not record.get("packed"):
        return []
    if record.get("source_sha256") != source_digest() or record.get("abi") != ABI_VERSION:
        log.warning("the artifact's CPU kernels were built from another kiln's source: compiling this kiln's here")
        return []
    root = Path(artifact_dir) / record.get("path", CPU_DIR)
    libraries = {level: root / info["file"] for level, info in (record.get("libraries") or {}).items()
                 if level in LEVEL_FLAGS and (root / info["file"]).is_file()}
    install_shipped(libraries)
    return sorted(libraries)


def install_shipped(libraries: dict[str, Path]) -> None:
    """Prefer an artifact's compiled libraries (level -> path) to compiling here; call before first use."""
    _shipped.update(libraries)
    _library.cache_clear()


class Kernels:
    """The loaded library, with argument types declared once."""

    def __init__(self, path: Path, level: str) -> None:
        self.path, self.level = path, level
        lib = ctypes.CDLL(str(path))
        if lib.kiln_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{path} has ABI {lib.kiln_abi_version()}, this kiln needs {ABI_VERSION}")
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
        self._linear = {torch.float32: declare("kiln_linear_f32", None, *[ptr] * 4, *[i64] * 5),
                        torch.bfloat16: declare("kiln_linear_bf16", None, *[ptr] * 4, *[i64] * 5)}
        self.linear_panel = declare("kiln_linear_panel", i64)()
        self._stack = declare("kiln_decoder_stack", ctypes.c_int, ptr, ptr, i64, ptr, ptr, flag, i64, ptr, ptr, i64,
                              ptr, ptr, i64, ptr, ptr, i64, ptr)
        self._stack_workspace = declare("kiln_stack_workspace", i64, ptr, i64)
        from kiln.engine import cpu_target

        # bf16 needs vdpbf16ps: compiled into the x86-64-v4 library, run where the CPU has AVX512-BF16
        self.linear_dtypes = (torch.float32,) + (
            (torch.bfloat16,) if declare("kiln_linear_bf16_available", ctypes.c_int)()
            and "avx512_bf16" in cpu_target.cpu_flags() else ())

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

    def pack_linear(self, weight: torch.Tensor) -> PackedLinear:
        """A weight [out, in] of one of ``linear_dtypes`` in the GEMM's panel layout (a copy; the caller
        drops the original)."""
        return PackedLinear(self, weight)

    def linear(self, x: torch.Tensor, packed: PackedLinear, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` for x [..., in] of the weight's dtype and the weight ``packed``
        (float32: ``kiln_linear_f32``; bfloat16: ``kiln_linear_bf16``, float32 accumulation)."""
        n, k = packed.out_features, packed.in_features
        if x.dtype != packed.dtype:
            raise TypeError(f"kiln's CPU linear: input {x.dtype}, weight {packed.dtype}")
        x2 = x.reshape(-1, k)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = x2.new_empty((x2.shape[0], n))
        if x2.shape[0]:
            b = None if bias is None else bias.float().contiguous()
            self._linear[packed.dtype](x2.data_ptr(), packed.panels.data_ptr(), 0 if b is None else b.data_ptr(),
                                       y.data_ptr(), x2.shape[0], n, k, x2.stride(0), n)
        return y.view(*x.shape[:-1], n)


class PackedLinear:
    """A weight [out, in] packed for kiln's CPU GEMM: panels of P output columns (P = the library's
    ``kiln_linear_panel``, the last panel zero-padded), [ceil(out / P), in, P] in float32 and
    [ceil(out / P), ceil(in / 2), P, 2] (K in pairs, for vdpbf16ps) in bfloat16, so a decode step streams
    each panel once; calling it is ``F.linear(x, weight, bias)``."""

    def __init__(self, kernels: Kernels, weight: torch.Tensor) -> None:
        if weight.dtype not in kernels.linear_dtypes or weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"kiln's CPU linear packs 2-D CPU weights of {', '.join(map(str, kernels.linear_dtypes))} "
                             f"on this host, not {weight.dtype} {tuple(weight.shape)}")
        if weight.stride(1) != 1:
            weight = weight.contiguous()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        panel, k = kernels.linear_panel, self.in_features
        per_panel = (k, panel) if self.dtype == torch.float32 else (-(-k // 2), panel, 2)
        self.panels = weight.new_empty((-(-self.out_features // panel), *per_panel))
        kernels._pack_linear[self.dtype](weight.data_ptr(), self.panels.data_ptr(), self.out_features, k,
                                         weight.stride(0))
        self._kernels = kernels

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
            return (value.panels if isinstance(value, PackedLinear) else value).data_ptr()

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


@functools.cache
def _library() -> Kernels | None:
    if os.environ.get("KILN_CPU_KERNELS", "1") == "0":
        log.info("kiln CPU kernels off (KILN_CPU_KERNELS=0): attention runs on torch")
        return None
    levels = host_levels()
    if not levels:
        log.warning("kiln CPU kernels: this CPU (%s) has none of the ISA levels they are built for (%s); "
                    "attention runs on torch", platform.machine(), ", ".join(LEVEL_FLAGS))
        return None
    for level in levels:
        if level in _shipped:
            try:
                return Kernels(_shipped[level], level)
            except (OSError, RuntimeError) as exc:
                log.warning("kiln CPU kernels: the artifact's %s library does not load (%s); compiling here", level, exc)
            break
    try:
        return Kernels(compile_library(levels[0], default_dir()), levels[0])
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("kiln CPU kernels unavailable (%s); attention runs on torch", exc)
        return None


def kernels() -> Kernels | None:
    """The CPU kernels for this host, or None (the engine then runs its torch path)."""
    return _library()
