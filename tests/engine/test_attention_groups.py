"""CPU decode attention in groups of rows of similar context equals attending all rows at once."""

from __future__ import annotations

import random

import torch
from kiln.engine.layers import attention as att
from kiln.engine.layers.attention import Attention, decode_groups


def test_grouped_decode_equals_one_group(monkeypatch):
    torch.manual_seed(0)
    rng = random.Random(0)
    kvh, heads, d, bs, nblocks = 2, 6, 16, 8, 256
    layer = Attention(heads, kvh, d, d ** -0.5)
    layer.k_cache, layer.v_cache = torch.randn(kvh, nblocks, bs, d), torch.randn(kvh, nblocks, bs, d)
    for rows in (1, 3, 17, 40):
        ctx = [rng.choice([1, 5, 8, 9, 60, 120, 200]) for _ in range(rows)]
        width = -(-max(ctx) // bs)
        tables = torch.tensor([rng.sample(range(nblocks), width) for _ in range(rows)])
        pad = ~(torch.arange(width * bs)[None, :] < torch.tensor(ctx)[:, None]).view(1, rows, 1, -1)
        q = torch.randn(rows, heads, d)
        groups = decode_groups(tables, pad, bs)
        assert sorted(torch.cat([g.rows for g in groups]).tolist()) == list(range(rows))
        for g in groups:  # each group gathers only what its longest row needs
            assert g.block_tables.shape[1] == -(-max(ctx[i] for i in g.rows.tolist()) // bs)
        grouped = torch.empty_like(q)
        for g in groups:
            grouped.index_copy_(0, g.rows, layer._decode_cpu(q.index_select(0, g.rows), g.block_tables, g.pad, {}))
        whole = layer._decode_cpu(q, tables, pad, {})
        torch.testing.assert_close(grouped, whole, rtol=1e-5, atol=1e-6)
    # Spread contexts split into several groups; equal ones stay one group.
    wide = torch.zeros(1, 16, 1, 512, dtype=torch.bool)
    for i in range(16):
        wide[0, i, 0, (i + 1) * 32:] = True
    assert len(decode_groups(torch.zeros(16, 64, dtype=torch.long), wide, 8)) > 1
    same = torch.zeros(1, 16, 1, 64, dtype=torch.bool)
    assert len(decode_groups(torch.zeros(16, 8, dtype=torch.long), same, 8)) == 1
    monkeypatch.setattr(att, "_MAX_GROUPS", 1)
    assert len(decode_groups(torch.zeros(16, 64, dtype=torch.long), wide, 8)) == 1
