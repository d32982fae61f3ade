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

Windows are compared like with like: a step's tokens follow its batch (a decode step of 8 sequences makes 8
tokens in about the time one of 1 makes 1), so a trial whose windows met a bigger batch would read as a faster
thread count. Each window is keyed by its mean batch, rounded to a power of two (``batch_bucket``), and a count
is compared with the incumbent only at the batches both were timed at; with none in common the trial keeps
the incumbent.

Thread counts do not change what kiln's kernels compute (each output is summed by one thread in one order);
``$OMP_NUM_THREADS`` or ``$KILN_CPU_THREADS`` pin the count and turn the governor off (``for_server``).
"""

from __future__ import annotations

import math
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
        self._steps = self._tokens = self._batch = 0
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

    def after_step(self, generated_tokens: int, batch: int = 1) -> None:
        """``generated_tokens``: the tokens the step just made (0: it only prefilled; still timed); ``batch``:
        the sequences it ran."""
        self._last_end = time.perf_counter()
        self._seconds += self._last_end - self._t0
        self._tokens += generated_tokens
        self._batch += batch
        self._steps += 1
        if self._steps >= self.window:
            self._end_window()

    def _end_window(self) -> None:
        rate = self._tokens / self._seconds if self._seconds > 0 else 0.0
        threads, bucket = self._threads_now(), batch_bucket(self._batch / self._steps)
        self._steps = self._tokens = self._batch = 0
        self._seconds, self._last_end = 0.0, None  # the gap before the next window's first step is its own
        if not self._plan:
            self._settled += 1
            if self._settled >= self.settle:
                self._start_trial()
            return
        self._plan.pop(0)
        self._rates.setdefault((threads, bucket), []).append(rate)
        if not self._plan:
            self._decide()

    def _start_trial(self) -> None:
        others = [c for c in self.choices if c != self.current]
        self._settled = 0
        self._rates = {}
        self._plan = [t for other in others for t in (other, self.current, other, self.current)]

    def _decide(self) -> None:
        mean = {key: statistics.mean(r) for key, r in self._rates.items() if r}
        speedup = {}  # each count's rate over the incumbent's, at the batches both were timed at
        for t in self.choices:
            ratios = [r / mean[self.current, b] for (tt, b), r in mean.items()
                      if tt == t and mean.get((self.current, b), 0.0) > 0]
            if ratios:
                speedup[t] = statistics.mean(ratios)
        best = max(speedup, key=speedup.get, default=self.current)
        switched = best != self.current and speedup[best] > SWITCH_MARGIN
        if switched:
            self.current = best
        shown = {t: statistics.mean(r for (tt, _), r in mean.items() if tt == t) for t in {t for t, _ in mean}}
        trial = {"tokens_per_s": {str(t): round(r, 1) for t, r in sorted(shown.items())},
                 "kept" if not switched else "switched_to": self.current}
        if len(speedup) < 2:
            trial["why"] = "no window of another count at a batch the incumbent was timed at"
        self.state.update(threads=self.current, trials=self.state["trials"] + 1, last_trial=trial)


def batch_bucket(mean_batch: float) -> int:
    """A window's batch for comparisons: its mean sequences per step, rounded to a power of two."""
    return 1 << max(0, round(math.log2(max(mean_batch, 1.0))))


def for_server(threads: int) -> ThreadGovernor | None:
    """The governor of a CPU server that starts on ``threads``, trying it against every core it may use (the
    cgroup quota's, else the CPUs'); None where the count is pinned (``$OMP_NUM_THREADS``,
    ``$KILN_CPU_THREADS``) or there is nothing to choose."""
    from kiln.engine.cpu_target import pinned_threads, usable_cores

    if pinned_threads() is not None:
        return None
    choices = sorted({threads, usable_cores()})
    return ThreadGovernor(choices, threads) if len(choices) > 1 else None
