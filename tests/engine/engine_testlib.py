"""Helpers shared by the engine tests (imported by name: tests/ is not a package)."""

from __future__ import annotations

import torch


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 1024, prefix: list[int] | None = None):
    """Token-id prompts starting with BOS (1), avoiding special ids 0..4."""
    g = torch.Generator().manual_seed(seed)
    prefix = prefix or []
    return [[1, *prefix, *torch.randint(5, vocab, (n - 1 - len(prefix),), generator=g).tolist()] for n in lengths]
