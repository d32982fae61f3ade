"""The signature of the machine a tactic table was measured on: a table is used as is only where it matches.

Everything that changes which kernel is fastest is in it: the CPU model and the flags that decide the
matmul kernels (``cpu_target.RELEVANT_FLAGS``), the thread count the timings ran at, the ISA caps in the
environment, the kiln kernel library (level, source, and the instruction its W8A8 runs on), torch's version
(oneDNN comes with it) and the candidates the engine's ``tactics_exclude`` and ``$KILN_TACTICS_EXCLUDE`` take out (``kernels.candidates.excluded``;
only when set). The CPU count
is not: a pod with the same CPU type and the same threads times the same.
"""

from __future__ import annotations

import hashlib
import json
import platform
from typing import Any

import torch
from kiln.engine import cpu_target
from kiln.engine.kernels import candidates, native
from kiln.engine.kernels.cpu_library import source_digest
from kiln.engine.kernels.isa import caps_in_effect


def cpu_signature(threads: int | None = None, exclude=()) -> dict[str, Any]:
    """This host's signature for timings at ``threads`` without the candidates ``exclude`` names."""
    kernels = native.kernels()
    flags = cpu_target.cpu_flags()
    excluded = candidates.excluded(exclude)  # a table measured without some candidates is not one measured with them
    return {**({"excluded": sorted(excluded)} if excluded else {}), "device": "cpu", "machine": platform.machine(), "model": cpu_target.cpu_model(),
            "flags": sorted(f for f in cpu_target.RELEVANT_FLAGS if f in flags),
            "threads": int(threads or torch.get_num_threads()), "caps": caps_in_effect(),
            "torch": torch.__version__,
            "kernels": None if kernels is None else {"level": kernels.level, "source": source_digest()[:16],
                                                     "w8a8": kernels.w8a8_isa}}


def signature_key(signature: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(signature, sort_keys=True).encode()).hexdigest()[:16]


def describe(signature: dict[str, Any]) -> str:
    """One line for logs and reports: CPU model, flags, threads, kernel level, caps."""
    kernels = signature.get("kernels") or {}
    caps = signature.get("caps") or {}
    return (f"{signature.get('model')} [{' '.join(signature.get('flags') or [])}], {signature.get('threads')} "
            f"thread(s), kiln kernels {kernels.get('level', 'none')}"
            + (f" (W8A8 on {kernels['w8a8']})" if kernels.get("w8a8") else "")
            + (f", capped {' '.join(f'{k}={v}' for k, v in sorted(caps.items()))}" if caps else ""))


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """What differs between two signatures, one 'field: a -> b' each."""
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
