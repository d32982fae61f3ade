"""``pack_rows``: a decode step's rows packed from Python lists (``_pack_decodes``, the fast path) give exactly the
tensors the general tensor-op packing (``_pack_any``) gives; any longer row takes the general path."""

from __future__ import annotations

import random

import pytest
import torch
from kiln.engine import step_inputs
from kiln.engine.step_inputs import pack_rows


def _decode_rows(rng: random.Random, batch: int, block_size: int) -> list[tuple[list[int], int, list[int]]]:
    rows = []
    for _ in range(batch):
        width = rng.randint(1, 9)
        table = rng.sample(range(500), width)
        rows.append(([rng.randrange(32000)], rng.randrange(width * block_size), table))
    return rows


def _same(a: step_inputs.StepInputs, b: step_inputs.StepInputs) -> None:
    for field in ("input_ids", "positions", "slot_mapping", "decode_block_tables", "decode_ctx_lens", "logits_indices",
                  "token_lora_slots"):
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None) == (y is None), field
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), field
    assert a.num_decodes == b.num_decodes and a.prefills == b.prefills == []


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_a_decode_step_packs_the_same_tensors_either_way(block_size):
    rng = random.Random(block_size)
    for batch in (1, 2, 7, 64):
        rows = _decode_rows(rng, batch, block_size)
        logits = list(range(batch))
        for slots in (None, [-1] * batch, [rng.choice([-1, 0, 3]) for _ in range(batch)]):
            fast = step_inputs._pack_decodes(rows, block_size, logits, slots)
            _same(fast, step_inputs._pack_any(rows, block_size, logits, slots))
            _same(pack_rows(rows, block_size, logits, slots), fast)


def test_a_step_with_a_longer_row_takes_the_general_path(monkeypatch):
    monkeypatch.setattr(step_inputs, "_pack_decodes", lambda *a: pytest.fail("a prefill row took the decode path"))
    got = pack_rows([([5], 9, [1, 2, 3]), ([1, 2, 3], 0, [6])], 4, [0, 3])
    assert got.num_decodes == 1 and got.prefills[0][:3] == (1, 3, 3)
