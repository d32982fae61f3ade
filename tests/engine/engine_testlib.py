"""Helpers shared by the engine tests (imported by name: tests/ is not a package)."""

from __future__ import annotations

import torch


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 1024, prefix: list[int] | None = None):
    """Token-id prompts starting with BOS (1), avoiding special ids 0..4."""
    g = torch.Generator().manual_seed(seed)
    prefix = prefix or []
    return [[1, *prefix, *torch.randint(5, vocab, (n - 1 - len(prefix),), generator=g).tolist()] for n in lengths]


def mapping_fields(t: torch.Tensor) -> dict[str, int]:
    """The /proc/self/smaps fields (kB) summed over the mappings that hold ``t``'s bytes (an madvise splits one),
    and ``VmFlags`` as the set of flags they all have (``hg``: asked for huge pages, ``nh``: never)."""
    lo_t, hi_t = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    fields: dict = {}
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < hi_t and lo_t < hi
        elif inside and head == "VmFlags:":
            flags = set(line.split()[1:])
            fields["VmFlags"] = fields.get("VmFlags", flags) & flags
        elif inside and head.endswith(":") and line.split()[1].isdigit():
            fields[head[:-1]] = fields.get(head[:-1], 0) + int(line.split()[1])
    return fields
