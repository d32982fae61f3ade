"""The CPU KV pool (``kv_cache._zeroed``): zero pages handed out on first touch, 4 KiB at a time, so a first token
that writes one block per layer and KV head pays for a few pages, not for a 2 MiB huge page each."""

from __future__ import annotations

import torch
from engine_testlib import mapping_fields as memory_of
from kiln.engine.kv_cache import _zeroed


def test_a_pool_costs_only_the_pages_its_first_writes_touch():
    shape = (2, 30, 3, 1024, 16, 64)  # SmolLM2's pool: [K/V, layers, kv_heads, blocks, block_size, head_dim]
    pool = _zeroed(shape, torch.float32, "cpu")
    assert pool.shape == shape and pool.dtype == torch.float32
    assert memory_of(pool).get("Rss", 0) < 1024  # nothing touched at allocation (kB)
    pool[:, :, :, 0, :9] = 1.0  # a 9-token prompt's K and V: block 0 of every layer and KV head
    touched = memory_of(pool)
    assert touched["Rss"] <= 2 * 30 * 3 * 4 + 64, touched  # 180 pages of 4 KiB (numpy's zeros: 180 x 2 MiB)
    assert touched.get("AnonHugePages", 0) == 0
    assert float(pool[:, :, :, 1:].abs().sum()) == 0.0 and float(pool[:, :, :, 0, 9:].abs().sum()) == 0.0
    lo, hi = pool.data_ptr(), pool.data_ptr() + pool.numel() * pool.element_size()
    del pool  # its pages go with it (an engine unloaded from a pool)
    still = [line for line in open("/proc/self/maps")
             if (lambda a, b: a < hi and lo < b)(*(int(x, 16) for x in line.split()[0].split("-")))]
    assert still == [], "the pool's pages are still mapped"
