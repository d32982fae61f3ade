"""A step's LoRA work: its tokens in runs of one adapter slot (see ``layers.py``'s module docstring), built
once per step by the runner and carried by the step's ``ForwardContext`` (``kiln.engine.forward_context``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# A step with several runs takes the slot-dense path when tokens x max_loras is at most this (it multiplies
# every slot for every token; the crossover measured ~16 tokens at 3 slots on a Zen 4 core, bf16).
DENSE_WORK = 64


@dataclass
class LoRAStep:
    """The step's runs ``(slot, start, end)`` of adapter tokens, and for the slot-dense path the mask."""

    runs: list[tuple[int, int, int]]
    tokens: int
    mask: torch.Tensor | None = None  # [tokens, max_loras], 1 at each token's slot; None: run by run

    @functools.cached_property
    def others(self) -> torch.Tensor:
        """``[tokens, max_loras, 1]``, True at the slots a token does not use (their columns are zeroed)."""
        return (self.mask == 0).unsqueeze(2)


def make_lora_step(token_slots: torch.Tensor | None, device: torch.device, max_loras: int) -> LoRAStep | None:
    """Split a step's tokens into runs of one slot; None when no token has one (the base path, no LoRA work)."""
    if token_slots is None or token_slots.numel() == 0:
        return None
    slots = token_slots.tolist()
    runs, start, n = [], 0, len(slots)
    for i in range(1, n + 1):
        if i == n or slots[i] != slots[start]:
            if slots[start] >= 0:
                runs.append((slots[start], start, i))
            start = i
    if not runs:
        return None
    step = LoRAStep(runs, n)
    if len(runs) > 1 and n * max_loras <= DENSE_WORK:
        mask = torch.zeros(n, max_loras + 1)  # column max_loras: the base tokens' (dropped)
        mask[torch.arange(n), token_slots.long().where(token_slots >= 0, max_loras)] = 1
        step.mask = mask[:, :max_loras].to(device)
    return step
