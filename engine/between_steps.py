"""The one place for work between engine steps.

An engine runs its hooks, in order, around every step (``before_step``, ``after_step``) and whenever its loop
has nothing to run (``idle``): ``LLMEngine.step`` and ``LLMEngine.idle`` call them, so every loop over the
engine (``AsyncLLM``'s, ``LLM.generate``'s, the bench's) runs them without knowing what they are. Today's:

- ``TacticSwap``: starts timing this host's tactic table in the background and, once it is timed, packs the
  model by it (``tactics.deferred``, ``tactics.swap``; ``EngineConfig.tactics_background``);
- the thread governor (``thread_governor.ThreadGovernor``; ``EngineConfig.thread_governor``): re-chooses the
  compute thread count from the steps' timings.

A new between-steps task is one class with these three methods, added in ``hooks_for``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from kiln.engine.thread_governor import for_server


class StepHook(Protocol):
    def before_step(self) -> None: ...

    def after_step(self, generated_tokens: int, batch: int) -> None:
        """``generated_tokens``: the tokens the step made; ``batch``: the sequences it ran."""

    def idle(self) -> None:
        """The loop had nothing to run."""


class TacticSwap:
    """Background tactic timing's engine-thread half (``ModelRunner.swap_pending_tactics``)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def before_step(self) -> None:
        self.runner.swap_pending_tactics()

    def after_step(self, generated_tokens: int, batch: int) -> None:
        pass

    def idle(self) -> None:
        self.runner.swap_pending_tactics()


class BetweenSteps:
    """The hooks an engine runs between its steps, in order."""

    def __init__(self, hooks: list[StepHook]) -> None:
        self.hooks = hooks

    def before_step(self) -> None:
        for hook in self.hooks:
            hook.before_step()

    def after_step(self, generated_tokens: int, batch: int) -> None:
        for hook in self.hooks:
            hook.after_step(generated_tokens, batch)

    def idle(self) -> None:
        for hook in self.hooks:
            hook.idle()

    def run(self, step: Callable[[], list[Any]]) -> list[Any]:
        """``step()`` (the engine's; it returns one update per sequence that gained tokens) between
        ``before_step`` and ``after_step``."""
        self.before_step()
        updates = step()
        self.after_step(sum(len(u.new_token_ids) for u in updates), len(updates))
        return updates

    def find(self, kind: type) -> Any:
        """The hook of ``kind``, or None."""
        return next((h for h in self.hooks if isinstance(h, kind)), None)


def hooks_for(config: Any, runner: Any) -> BetweenSteps:
    """The between-steps hooks ``config`` asks for: the tactic swap always (it does nothing without a table
    being timed), the thread governor where ``thread_governor`` is on for a single-rank CPU engine whose
    thread count is not pinned."""
    hooks: list[StepHook] = [TacticSwap(runner)]
    if config.thread_governor and config.device == "cpu" and config.world_size == 1:
        governor = for_server(torch.get_num_threads())
        if governor is not None:
            hooks.append(governor)
    return BetweenSteps(hooks)
