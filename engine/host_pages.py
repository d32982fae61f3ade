"""Host memory straight from the OS: private anonymous mappings, zero pages until first touched and returned to the
system the moment the last tensor over them goes (no malloc arena keeps them, no ``malloc_trim`` needed).

Two uses, two page sizes (the host's transparent-huge-page setting is overridden either way):
- the KV pool (:mod:`kiln.engine.kv_cache`) in 4 KiB pages: a first token touches a page per layer and KV head,
  and 2 MiB huge pages would zero 2 MiB for each;
- packed weight panels (:mod:`kiln.engine.kernels.packed`, ``gguf_blocks``) in 2 MiB huge pages where the kernel
  gives them: every byte is written once by the pack and read by every step, so the pack takes one page fault per
  2 MiB instead of 512, and the GEMMs stream them with fewer TLB misses. Measured on SmolLM2 in float32 (91
  weights, 540 MB, AMD EPYC avx2, one thread): the pack from 0.60 to 0.31 s of a 1.2 s reload.
  ``KILN_HUGE_PAGES=0`` asks for none (where the kernel's compaction for them stalls a host).

Most linears of a small model are under 2 MiB (SmolLM2's 576x576 in int8: 324 KiB), and a weight of 3 MiB fills
one huge page and a tail of small ones; alone, each would stream from 4 KiB pages. Inside :func:`arena` (the
tactics' ``bind`` packs a model in one) every huge-page request of the thread is carved from shared chunks of
``ARENA_CHUNK`` in huge pages, one after another, so a model's weights lie in huge pages almost whole. Measured
(Zen 4, one thread, 60 int8 2048x768 weights read in turn, W8A8 at one row): 83.9 -> 59.9 us a linear on the
x86-64-v3 library, 98.3 -> 67.3 on the x86-64-v4 one. A chunk is unmapped with the last weight over it: an
arena lives as long as its model's weights (an engine pool's unload frees them).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Iterator

import torch

HUGE_PAGE = 2 << 20
ARENA_CHUNK = 64 << 20  # address space only: the pages no weight was carved from are never touched
ARENA_ALIGN = 4096
_arenas = threading.local()


def anonymous(nbytes: int, huge: bool) -> torch.Tensor:
    """``nbytes`` of zero pages as a uint8 tensor; ``huge``: the whole 2 MiB pages inside it in huge pages
    (aligned to 2 MiB: the mapping is a huge page larger, its head and tail never touched, so never resident)."""
    if nbytes <= 0:
        return torch.zeros(0, dtype=torch.uint8)
    carve = getattr(_arenas, "current", None)
    if huge and carve is not None and _huge_pages() and nbytes <= ARENA_CHUNK // 2:
        return carve.take(nbytes)
    huge = huge and nbytes >= HUGE_PAGE and _huge_pages()
    pages = mmap.mmap(-1, nbytes + (HUGE_PAGE if huge else 0), flags=mmap.MAP_PRIVATE)
    if not huge:
        if hasattr(mmap, "MADV_NOHUGEPAGE"):  # even where the host's THP setting is "always"
            _advise(pages, mmap.MADV_NOHUGEPAGE, 0, nbytes)
        return torch.frombuffer(pages, dtype=torch.uint8)
    whole = torch.frombuffer(pages, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    _advise(pages, mmap.MADV_HUGEPAGE, start, nbytes)
    return whole[start:start + nbytes]  # the view keeps the mapping alive; it is unmapped with the last view


def _huge_pages() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("KILN_HUGE_PAGES") != "0"


class _Arena:
    """Chunks in huge pages, each carved front to back (``ARENA_ALIGN``-aligned pieces)."""

    def __init__(self) -> None:
        self.chunk: torch.Tensor | None = None
        self.used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        if self.chunk is None or self.used + nbytes > self.chunk.numel():
            self.chunk, self.used = anonymous(ARENA_CHUNK, huge=True), 0  # over half a chunk: not carved
        piece = self.chunk[self.used:self.used + nbytes]
        self.used += -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN
        return piece


@contextlib.contextmanager
def arena() -> Iterator[None]:
    """Within, this thread's huge-page requests (packed weights) of up to half a chunk share chunks; a piece
    keeps its chunk mapped, so the chunk goes with the last weight carved from it."""
    previous, _arenas.current = getattr(_arenas, "current", None), _Arena()
    try:
        yield
    finally:
        _arenas.current = previous


def _advise(pages: mmap.mmap, advice: int, start: int, length: int) -> None:
    """A page-size hint, dropped where the kernel has no transparent huge pages (EINVAL): the pages are the same."""
    try:
        pages.madvise(advice, start, length)
    except OSError:
        pass
