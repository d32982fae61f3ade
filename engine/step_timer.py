"""Opt-in timing of an engine step's phases, for ``kiln bench --profile`` (kiln_bench.profile).

While ``ModelRunner.step_timer`` holds a ``StepTimer``, ``LLMEngine._step`` and the runner call ``lap`` at each
phase's end, so the laps cover the step from its start to its output without a gap: each lap's time goes to the
phase that just ended. With it None (always, but under the profiler) the step pays one ``is None`` test a phase.
The kernels' own timers (kernels/kernel_timers.py) split ``forward`` further.
"""

from __future__ import annotations

import time

# schedule: the scheduler's decision and the block manager's bookkeeping after the forward; prepare: the
# step's input tensors and attention metadata; forward: the model; sample: logits to tokens; output: tokens
# appended, detokenized, stop rules, the step's updates
PHASES = ("schedule", "prepare", "forward", "sample", "output")


class StepTimer:
    def __init__(self) -> None:
        self.ns = dict.fromkeys(PHASES, 0)
        self._last = 0

    def start(self) -> None:
        self._last = time.perf_counter_ns()

    def lap(self, phase: str) -> None:
        """The time since the last lap (or ``start``) was ``phase``'s."""
        now = time.perf_counter_ns()
        self.ns[phase] += now - self._last
        self._last = now

    def take(self) -> dict[str, int]:
        """phase -> ns since the last take; the totals start again from zero."""
        out, self.ns = self.ns, dict.fromkeys(PHASES, 0)
        return out
