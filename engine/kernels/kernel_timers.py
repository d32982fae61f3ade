"""The kernel library's opt-in timers (``csrc/profile.c``): per component, the wall time and calls of its entry
points since the last ``take``. Off unless ``enable(True)``; off, each entry point pays one load and a branch.
``kiln bench --profile`` turns them on around the steps it profiles (kiln_bench.profile)."""

from __future__ import annotations

import ctypes
import time

# Python's own GEMMs into the "gemm" total (oneDNN's on kiln's panels: Kernels.linear), as the C side adds its own
GEMM = "gemm"


class KernelTimers:
    def __init__(self, lib: ctypes.CDLL) -> None:
        count = lib.kiln_profile_count()
        name = lib.kiln_profile_name
        name.restype, name.argtypes = ctypes.c_char_p, [ctypes.c_int]
        self.components = tuple(name(i).decode() for i in range(count))  # the C enum's names, in its order
        self._enable = lib.kiln_profile_enable
        self._enable.restype, self._enable.argtypes = None, [ctypes.c_int]
        self._add = lib.kiln_profile_add
        self._add.restype, self._add.argtypes = None, [ctypes.c_int, ctypes.c_int64]
        self._take = lib.kiln_profile_take
        self._take.restype, self._take.argtypes = None, [ctypes.c_void_p, ctypes.c_void_p]
        self.on = False

    def enable(self, on: bool) -> None:
        self.on = bool(on)
        self._enable(int(self.on))

    def add(self, component: str, start_ns: int) -> None:
        """One call of ``component`` that began at ``start_ns`` (``time.perf_counter_ns``) and ends now."""
        self._add(self.components.index(component), time.perf_counter_ns() - start_ns)

    def take(self) -> dict[str, tuple[int, int]]:
        """component -> (ns, calls) since the last take (or the load); the totals start again from zero."""
        ns, calls = (ctypes.c_int64 * len(self.components))(), (ctypes.c_int64 * len(self.components))()
        self._take(ns, calls)
        return {c: (ns[i], calls[i]) for i, c in enumerate(self.components)}
