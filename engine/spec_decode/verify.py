"""Verification of a row of drafts: what each position is sampled after, what is committed.

Every position of a verified row is sampled by the ordinary sampler, as if the drafts before it
were already output, giving targets ``t_0..t_k`` (``t_j`` follows draft ``j - 1``). The first
``a`` drafts that equal their targets are accepted and ``t_a`` is committed after them: the
correction at the first mismatch, or the bonus token when every draft held. With ``y ~ p`` and a
point-mass draft ``x``, ``P(y == x) = p(x)`` and ``y`` given ``y != x`` is ``p`` without ``x``,
renormalized: exactly the accept/residual rule of rejection sampling (Leviathan et al. 2023) for a
draft distribution that is a point mass, so committed tokens follow the target distribution.

A seeded request draws one uniform per sampled position from its own generator; after a
verification it is rewound to the state before the step and advanced by one draw per committed
token, so its n-th output token always comes from its n-th draw (the same draw as without
speculation).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def position_outputs(output_token_ids: list[int], drafts: Sequence[int]) -> list[list[int]]:
    """The output each of the ``len(drafts) + 1`` positions is sampled after."""
    return [output_token_ids + list(drafts[:j]) for j in range(len(drafts) + 1)]


def num_accepted(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """How many leading drafts equal their targets (``targets`` has one more entry than ``drafts``)."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return a


def save_generator(req) -> None:
    """Remember a seeded, sampled request's generator before its row of drafts draws from it."""
    req.spec_generator_state = None
    if req.spec_token_ids and req.generator is not None and not req.params.is_greedy:
        req.spec_generator_state = req.generator.get_state()


def rewind_generator(req, num_committed: int) -> None:
    """Leave the request's generator ``num_committed`` draws past its state before the step (as the
    sampler draws them: one float64 uniform per row)."""
    state, req.spec_generator_state = req.spec_generator_state, None
    if state is None:
        return
    req.generator.set_state(state)
    for _ in range(num_committed):
        torch.rand(1, dtype=torch.float64, generator=req.generator, device=req.generator.device)
