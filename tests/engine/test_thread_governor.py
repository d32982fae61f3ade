"""The serving engine's thread governor (engine/thread_governor.py): trials A B A B against the current count,
switching only for a clear win, and off where the count is pinned; wired into `kiln serve`'s engine loop."""

from __future__ import annotations

import pytest
from kiln.engine import thread_governor
from kiln.engine.thread_governor import ThreadGovernor


class Clock:
    """A step costs ``cost[threads]`` seconds per generated token, the threads being the last ones set."""

    def __init__(self, cost: dict[int, float]) -> None:
        self.now, self.cost, self.threads, self.sets = 0.0, cost, None, []

    def set(self, n: int) -> None:
        self.threads = n
        self.sets.append(n)

    def __call__(self) -> float:
        return self.now


def drive(gov: ThreadGovernor, clock: Clock, steps: int, tokens: int = 4, gap: dict | None = None,
          idle_every: int = 0) -> list[int]:
    """``gap``: seconds the loop spends between two busy steps, per thread count; every ``idle_every`` steps
    the loop idles for 100 s (a quiet spell)."""
    used = []
    for i in range(steps):
        gov.before_step()
        used.append(clock.threads)
        clock.now += clock.cost[clock.threads] * tokens
        gov.after_step(tokens)
        clock.now += (gap or {}).get(clock.threads, 0.0)
        if idle_every and i % idle_every == idle_every - 1:
            gov.idle()
            clock.now += 100.0
    return used


@pytest.fixture
def clock(monkeypatch):
    def make(cost):
        c = Clock(cost)
        monkeypatch.setattr(thread_governor.time, "perf_counter", c)
        return c
    return make


def test_it_switches_to_the_count_that_makes_tokens_faster(clock):
    c = clock({1: 1.0, 2: 0.7})  # two threads: 1.43x the tokens
    gov = ThreadGovernor([1, 2], start=1, set_threads=c.set, window=4, settle=3)
    used = drive(gov, c, 8 + 16)  # two windows of set-up, then the trial: 2 1 2 1, one window each
    assert used == [1] * 8 + [2] * 4 + [1] * 4 + [2] * 4 + [1] * 4
    assert gov.current == 2 and gov.state["threads"] == 2 and gov.state["trials"] == 1
    assert gov.state["last_trial"]["switched_to"] == 2
    assert gov.state["last_trial"]["tokens_per_s"] == {"1": 1.0, "2": round(1 / 0.7, 1)}
    assert drive(gov, c, 12) == [2] * 12  # settled on it, the next trial after `settle` windows
    assert drive(gov, c, 4) == [1] * 4  # the next trial tries the other again, the new incumbent second
    assert c.sets.count(2) >= 3  # set on each change only, not per step


@pytest.mark.parametrize("cost", [{1: 1.0, 2: 1.3}, {1: 1.0, 2: 0.98}])
def test_it_keeps_the_count_where_the_other_is_slower_or_not_clearly_faster(clock, cost):
    c = clock(cost)
    gov = ThreadGovernor([1, 2], start=1, set_threads=c.set, window=4, settle=3, first_trial_after=0)
    drive(gov, c, 16)
    assert gov.current == 1 and gov.state["last_trial"]["kept"] == 1
    assert drive(gov, c, 12) == [1] * 12


def test_a_neighbour_that_arrives_later_moves_it_back(clock):
    c = clock({1: 1.0, 2: 0.7})
    gov = ThreadGovernor([1, 2], start=1, set_threads=c.set, window=4, settle=2, first_trial_after=0)
    drive(gov, c, 16)
    assert gov.current == 2
    c.cost = {1: 1.0, 2: 3.0}  # a busy neighbour: the second thread waits on a descheduled peer
    drive(gov, c, 8 + 16)  # settle, then the trial
    assert gov.current == 1 and gov.state["trials"] == 2


def test_pinned_counts_and_single_cores_have_no_governor(monkeypatch):
    from kiln.engine import cpu_target

    monkeypatch.setattr(cpu_target, "available_cpus", lambda: 4)
    monkeypatch.setattr(cpu_target, "cgroup_cpu_quota", lambda: None)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(cpu_target.THREADS_ENV, raising=False)
    gov = thread_governor.for_server(3)
    assert gov is not None and gov.choices == [3, 4]
    monkeypatch.setattr(cpu_target, "cgroup_cpu_quota", lambda: 2.5)  # a pod limited to 2.5 CPUs
    assert thread_governor.for_server(1).choices == [1, 2]
    assert thread_governor.for_server(2) is None  # nothing else to try
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert thread_governor.for_server(1) is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv(cpu_target.THREADS_ENV, "1")
    assert thread_governor.for_server(1) is None


def test_the_loops_time_between_busy_steps_counts_and_idle_time_does_not(clock):
    """Equal steps, but with two threads the loop's time between steps is shorter (the server's own threads
    get their core back sooner): two win. Long idle spells between requests change nothing."""
    c = clock({1: 1.0, 2: 1.0})
    gov = ThreadGovernor([1, 2], start=1, set_threads=c.set, window=4, settle=3, first_trial_after=0)
    drive(gov, c, 16, gap={1: 2.0, 2: 1.0}, idle_every=3)
    assert gov.current == 2
    rates = gov.state["last_trial"]["tokens_per_s"]
    assert rates["2"] > 1.1 * rates["1"] and max(rates.values()) < 1.0  # never diluted by the 100 s spells


def test_a_batch_change_alone_does_not_flip_the_count(clock):
    """Issue 38: a step's tokens follow its batch. Every step costs the same time whatever the thread count;
    the trial's windows of 2 threads happen to meet a batch of 8 while 1 thread's meet a batch of 1: 8x the
    tokens per second, none of it the threads'. Compared at equal batch, nothing is comparable: it keeps 1."""
    c = clock({1: 1.0, 2: 1.0})
    gov = ThreadGovernor([1, 2], start=1, set_threads=c.set, window=4, settle=3, first_trial_after=0)
    for _ in range(16):
        gov.before_step()
        batch = 8 if c.threads == 2 else 1
        c.now += 1.0  # one step: the same seconds at either count
        gov.after_step(batch, batch)
    assert gov.current == 1 and gov.state["last_trial"]["kept"] == 1 and "batch" in gov.state["last_trial"]["why"]


def test_at_equal_batch_a_faster_count_still_wins(clock):
    """The same batches for both counts (8 sequences a step): 2 threads make the steps 1.4x faster."""
    c = clock({1: 1.0, 2: 0.7})
    gov = ThreadGovernor([1, 2], start=1, set_threads=c.set, window=4, settle=3, first_trial_after=0)
    for _ in range(16):
        gov.before_step()
        c.now += c.cost[c.threads]
        gov.after_step(8, 8)
    assert gov.current == 2 and gov.state["last_trial"]["switched_to"] == 2
