"""What kiln's CPU kernels may use on this host: ISA levels, the features past them, and the caps that hold
every library below an ISA so that one host can run what another kind runs.

A library is compiled per ISA level (the x86-64 micro-architecture levels: ``x86-64-v4`` = AVX-512
F/BW/CD/DQ/VL, ``x86-64-v3`` = AVX2 + FMA + ...; ``armv8-a`` on aarch64), and a host runs a level only if
its ``/proc/cpuinfo`` flags include every flag of it (``LEVEL_FLAGS``), so a kernel built for AVX-512 never
dies on an illegal instruction on an AVX2-only host. Past the level, GEMM kernels need features of their own
(``FEATURE_FLAGS``): W8A8 on vpdpbusd (AVX512-VNNI in the x86-64-v4 library; AVX-VNNI in the x86-64-v3 one,
whose W8A8 otherwise runs on AVX2), the vdpbf16ps tiles (AVX512-BF16) and the AMX tiles (bf16; W8A8 on
AMX-INT8). Which one *runs* is
not read from these flags: the tactic table (``kiln.engine.tactics``) times the ones the host can run. The
W8A8 kernels are told here which of their instructions they may use (``w8a8_units``, ``w8a8_amx_units``).

``$KILN_CPU_ISA`` caps what kiln's kernels use, in ``CAP_ORDER`` (e.g. ``x86-64-v3`` on an AVX-512 host
runs what an AVX2-only host runs; ``avx_vnni`` what an Intel client part from Alder Lake on runs; ``x86-64-v4``
keeps VNNI, vdpbf16ps and AMX off, as on a Skylake-SP;
``avx512_bf16`` keeps AMX off). ``ISA_CAPS`` is the environment that
holds torch's libraries at the same point (oneDNN, ATen, MKL): ``kiln bench --max-isa`` and the tests'
capped runs set it before torch starts.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

from kiln.engine import cpu_target

log = logging.getLogger("kiln.engine.kernels.native")

_V3 = ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "abm", "xsave")
# level -> the /proc/cpuinfo flags a host needs to run code compiled with -march=<level>, best first
LEVEL_FLAGS: dict[str, tuple[str, ...]] = {
    "x86-64-v4": (*_V3, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
    "x86-64-v3": _V3,
    "armv8-a": ("asimd",),
}
ARCH_LEVELS = {"x86_64": ("x86-64-v4", "x86-64-v3"), "aarch64": ("armv8-a",)}
# feature -> (the library level it is compiled into, the flags a host needs to run it)
FEATURE_FLAGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "avx_vnni": ("x86-64-v3", ("avx_vnni",)),
    "avx512_vnni": ("x86-64-v4", ("avx512_vnni",)),
    "avx512_bf16": ("x86-64-v4", ("avx512_bf16",)),
    "amx": ("x86-64-v4", ("amx_tile", "amx_bf16")),
    "amx_int8": ("x86-64-v4", ("amx_tile", "amx_int8")),
}
# features that ``$KILN_CPU_ISA`` caps as another of CAP_ORDER's names: AMX-INT8 goes with AMX
CAPPED_AS = {"amx_int8": "amx"}
ISA_ENV = "KILN_CPU_ISA"
# What $KILN_CPU_ISA may name, lowest first: a cap allows everything at or below it.
CAP_ORDER = {"x86_64": ("x86-64-v3", "avx_vnni", "x86-64-v4", "avx512_vnni", "avx512_bf16", "amx"),
             "aarch64": ("armv8-a",)}
# --max-isa name -> the environment that holds every library at or below it (set before torch starts).
ISA_CAPS: dict[str, dict[str, str]] = {
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2", ISA_ENV: "x86-64-v3"},
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI", "DNNL_MAX_CPU_ISA": "AVX512_CORE_VNNI",
               "ATEN_CPU_CAPABILITY": "avx512", "MKL_ENABLE_INSTRUCTIONS": "AVX512", ISA_ENV: "avx512_vnni"},
    "avx512_bf16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "DNNL_MAX_CPU_ISA": "AVX512_CORE_BF16",
                    "ATEN_CPU_CAPABILITY": "avx512", "MKL_ENABLE_INSTRUCTIONS": "AVX512", ISA_ENV: "avx512_bf16"},
}
CAP_ENV_VARS = tuple(sorted({k for env in ISA_CAPS.values() for k in env}))


def _cap_index() -> int | None:
    """Position of ``$KILN_CPU_ISA`` in this architecture's CAP_ORDER; None when unset or not one of them."""
    cap = os.environ.get(ISA_ENV, "").strip()
    if not cap:
        return None
    known = CAP_ORDER.get(platform.machine(), ())
    if cap not in known:
        log.warning("$%s=%s is not an ISA level of %s (%s); ignored", ISA_ENV, cap, platform.machine(),
                    ", ".join(known) or "none")
        return None
    return known.index(cap)


def _allowed(name: str) -> bool:
    name = CAPPED_AS.get(name, name)
    cap = _cap_index()
    order = CAP_ORDER.get(platform.machine(), ())
    return cap is None or (name in order and order.index(name) <= cap)


def host_levels(flags: frozenset[str] | None = None) -> list[str]:
    """The ISA levels this host can run, best first, none above ``$KILN_CPU_ISA`` where it is set."""
    flags = cpu_target.cpu_flags() if flags is None else flags
    return [lvl for lvl in ARCH_LEVELS.get(platform.machine(), ())
            if set(LEVEL_FLAGS[lvl]) <= flags and _allowed(lvl)]


def feature_missing(feature: str, level: str, flags: frozenset[str] | None = None) -> str | None:
    """Why a library of ``level`` may not run ``feature`` here (None: it may)."""
    flags = cpu_target.cpu_flags() if flags is None else flags
    needs_level, needs_flags = FEATURE_FLAGS[feature]
    if level != needs_level:
        return f"needs the {needs_level} library (this host loaded {level})"
    missing = [f for f in needs_flags if f not in flags]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    if not _allowed(feature):
        return f"${ISA_ENV}={os.environ.get(ISA_ENV)} caps it off"
    return None


def caps_in_effect() -> dict[str, str]:
    """The ISA caps set in this process's environment (they change what runs, so tactic tables record them)."""
    return {k: os.environ[k] for k in CAP_ENV_VARS if os.environ.get(k)}


def w8a8_units(declare, level: str) -> tuple[str | None, str | None]:
    """W8A8 (int8 weights x int8 activations, ``csrc/gemm_w8a8.c``) in a library of ``level``: (why it may not
    run here, or None; the instruction its tiles use). The x86-64-v4 library's tiles are vpdpbusd on zmm where
    the CPU's flags and ``$KILN_CPU_ISA`` allow AVX512-VNNI, else AVX512BW's vpmaddubsw (Skylake-SP); the
    x86-64-v3 library's vpdpbusd on ymm where they allow AVX-VNNI, else AVX2's (the same integer sums each way,
    so the choice within a library is not a timing question)."""
    if not declare("kiln_w8a8_available", ctypes.c_int)():
        return f"the {level} library has no W8A8 kernel", None
    flag = vnni_flag(level)
    vnni = feature_missing(flag, level) is None
    declare("kiln_w8a8_allow_vnni", None, ctypes.c_int)(int(vnni))
    return None, flag if vnni else ("avx512bw" if flag == "avx512_vnni" else "avx2")


def vnni_flag(level: str) -> str:
    """The vpdpbusd a library of ``level`` has: AVX512-VNNI (zmm) in the x86-64-v4 library, AVX-VNNI (ymm) in the
    others; what its W8A8 tiles and its GGUF groups are told they may run."""
    return "avx512_vnni" if level == FEATURE_FLAGS["avx512_vnni"][0] else "avx_vnni"


def w8a8_amx_units(declare, level: str, w8a8: str | None) -> str | None:
    """Why W8A8's sums may not run on AMX-INT8 tiles here (``csrc/gemm_w8a8_amx.c``; None: they may), told to the
    library, which runs its vector tiles instead wherever this is not None."""
    why = w8a8 or (None if declare("kiln_w8a8_amx_available", ctypes.c_int)() else f"not in the {level} library")
    why = why or feature_missing("amx_int8", level) or amx_tile_state(declare)
    declare("kiln_w8a8_allow_amx", None, ctypes.c_int)(int(why is None))
    return why


def amx_tile_state(declare) -> str | None:
    """Why the library's AMX tiles may not run in this process although the CPU has them (None: they may): Linux
    grants the tile state only to a process that asks (``kiln_amx_ready``). Ask only where the CPU has AMX."""
    if declare("kiln_amx_ready", ctypes.c_int)():
        return None
    return "the kernel refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
