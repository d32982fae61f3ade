"""The compute thread count of a serving engine, chosen from its own steps while it serves.

How many OpenMP threads a step should use beside a server's own threads (HTTP, tokenizer, detokenizer, the
engine loop's Python) depends on what else the host runs, and that changes while a pod lives: on a quiet
2-core Zen 4, two compute threads served llama-bench 1.27x faster than one (`bench/contention.py`), while the
same two beside a test run on both cores served 0.5x. No load-time measurement of the model alone can know
which; the serving path can. So a server starts on ``cpu_target``'s choice and :class:`ThreadGovernor` times
its busy steps in windows and, every so often, tries the other candidate counts interleaved with the current
one, A B A B (a neighbour's burst falls on both), switching where one makes output tokens faster by
``SWITCH_MARGIN``. A window's time is its steps and the loop's time between them while it stays busy (the
server's other threads compete there too: on llama-bench two threads made the steps 4-8 % faster and the
served tokens 13 %), not the time the loop idles, so quiet spells and bursts of arrivals do not read as a
slow thread count.

Thread counts do not change what kiln's kernels compute (each output is summed by one thread in one order);
``$OMP_NUM_THREADS`` or ``$KILN_CPU_THREADS`` pin the count and turn the governor off (``for_server``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

WINDOW_STEPS = 24  # busy steps per timed window
SETTLE_WINDOWS = 12  # windows on the chosen count between two trials
SWITCH_MARGIN = 1.05  # a trial count must make tokens this much faster to take over
FIRST_TRIAL_AFTER = 2  # windows served before the first trial: the first steps pay for lazy set-up


class ThreadGovernor:
    """Call :meth:`before_step` and :meth:`after_step` around each engine step on the thread that runs it.
    ``state`` is live: the server's ``/version`` shows it (``cpu_target.governor``)."""

    def __init__(self, choices: list[int], start: int, set_threads=None, window: int = WINDOW_STEPS,
                 settle: int = SETTLE_WINDOWS, first_trial_after: int = FIRST_TRIAL_AFTER) -> None:
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self.choices = sorted(set(choices) | {start})
        self.current, self._set, self.window, self.settle = start, set_threads, window, settle
        self._applied: int | None = None
        self._plan: list[int] = []  # the windows of a trial, in order (other, current, other, current, ...)
        self._rates: dict[int, list[float]] = {}
        self._settled = settle - first_trial_after
        self._steps = self._tokens = 0
        self._seconds = 0.0
        self._t0 = 0.0
        self._last_end: float | None = None  # when the previous busy step ended (None: the loop idled since)
        self.state: dict[str, Any] = {"threads": start, "choices": self.choices, "trials": 0, "last_trial": None}
        if first_trial_after <= 0:
            self._start_trial()

    def _threads_now(self) -> int:
        return self._plan[0] if self._plan else self.current

    def before_step(self) -> None:
        want = self._threads_now()
        if want != self._applied:
            self._set(want)
            self._applied = want
        self._t0 = time.perf_counter()
        if self._last_end is not None:  # the loop's own time between two busy steps counts too
            self._seconds += self._t0 - self._last_end

    def idle(self) -> None:
        """The loop had nothing to run: the wait until the next step is not the thread count's."""
        self._last_end = None

    def after_step(self, generated_tokens: int) -> None:
        """``generated_tokens``: the tokens the step just made (0: it only prefilled; still timed)."""
        self._last_end = time.perf_counter()
        self._seconds += self._last_end - self._t0
        self._tokens += generated_tokens
        self._steps += 1
        if self._steps >= self.window:
            self._end_window()

    def _end_window(self) -> None:
        rate = self._tokens / self._seconds if self._seconds > 0 else 0.0
        threads = self._threads_now()
        self._steps = self._tokens = 0
        self._seconds, self._last_end = 0.0, None  # the gap before the next window's first step is its own
        if not self._plan:
            self._settled += 1
            if self._settled >= self.settle:
                self._start_trial()
            return
        self._plan.pop(0)
        self._rates.setdefault(threads, []).append(rate)
        if not self._plan:
            self._decide()

    def _start_trial(self) -> None:
        others = [c for c in self.choices if c != self.current]
        self._settled = 0
        self._rates = {}
        self._plan = [t for other in others for t in (other, self.current, other, self.current)]

    def _decide(self) -> None:
        rates = {t: statistics.mean(r) for t, r in self._rates.items() if r}
        incumbent = rates.get(self.current, 0.0)
        best = max(rates, key=rates.get)
        switched = best != self.current and rates[best] > SWITCH_MARGIN * incumbent
        if switched:
            self.current = best
        self.state.update(threads=self.current, trials=self.state["trials"] + 1, last_trial={
            "tokens_per_s": {str(t): round(r, 1) for t, r in sorted(rates.items())},
            "kept" if not switched else "switched_to": self.current})


def for_server(threads: int) -> ThreadGovernor | None:
    """The governor of a CPU server that starts on ``threads``, trying it against every core it may use (the
    cgroup quota's, else the CPUs'); None where the count is pinned (``$OMP_NUM_THREADS``,
    ``$KILN_CPU_THREADS``) or there is nothing to choose."""
    from kiln.engine.cpu_target import pinned_threads, usable_cores

    if pinned_threads() is not None:
        return None
    choices = sorted({threads, usable_cores()})
    return ThreadGovernor(choices, threads) if len(choices) > 1 else None
