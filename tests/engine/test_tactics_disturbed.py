"""Tactic timing that the process's own work beside it cannot mislead (engine/tactics/timing.py).

On a 2-core VM the first linear shape timed after a model load lost up to 99 % of a sample to the tokenizer's
import on its own thread (it holds the GIL; every candidate leaves it and must wait to get it back), and the
cached table ran o_proj on ATen, which took the decoder stack away from every later start on that host."""

from __future__ import annotations

import ctypes
import threading
import time

from kiln.engine.tactics import timing


def _busy(seconds: float) -> None:
    end = time.thread_time() + seconds  # on the CPU for this long, however long the wall clock takes
    while time.thread_time() < end:
        pass


def test_a_sample_spent_off_the_cpu_is_taken_again():
    calls = []

    def fn():
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.05)  # the first try waits, as a thread waiting for the GIL does
        _busy(0.002)

    seconds = timing._sample(fn, 1)
    assert len(calls) >= 2, "the disturbed try was kept"
    assert seconds < 0.04, f"{seconds * 1e3:.1f} ms: the sample still holds the 50 ms the thread spent waiting"


def test_a_sample_always_disturbed_keeps_the_least_disturbed_try():
    waits = iter([0.08, 0.02, 0.06, 0.07, 0.09])

    def fn():
        time.sleep(next(waits))

    seconds = timing._sample(fn, 1)
    assert 0.015 < seconds < 0.05, f"{seconds * 1e3:.1f} ms: not the 20 ms try"


def _hold_gil(seconds: float) -> None:
    """Sleep holding the GIL (a PyDLL call keeps it), as an import's file reads and C work do."""
    ctypes.PyDLL(None).usleep(int(seconds * 1e6))


def test_timing_waits_while_a_thread_of_its_own_process_holds_the_gil(monkeypatch):
    done = threading.Event()

    def hog():  # 2 ms at a time with the GIL held, for 0.4 s; Python between (the interpreter may switch)
        end = time.monotonic() + 0.4
        while time.monotonic() < end:
            _hold_gil(0.002)
        done.set()

    thread = threading.Thread(target=hog)
    thread.start()
    try:
        waited = timing.settle(limit_s=10.0)
        assert done.is_set(), f"settled after {waited:.2f}s while the GIL hog still ran"
    finally:
        thread.join()
    # Undisturbed samples end it at once. (Not timed on the host as it is: on a busy machine other processes take
    # the CPU from it too, which the settling rightly waits out, so a "quiet" wall time is the host's, not kiln's.)
    monkeypatch.setattr(timing, "_undisturbed", lambda off, wall: True)
    assert timing.settle(limit_s=10.0) < 1.0, "undisturbed samples did not end the settling"


def test_settling_gives_up_at_its_limit():
    stop = threading.Event()

    def hog():
        while not stop.is_set():
            _hold_gil(0.002)

    thread = threading.Thread(target=hog)
    thread.start()
    try:
        started = time.monotonic()
        timing.settle(limit_s=0.3)
        assert time.monotonic() - started < 3.0
    finally:
        stop.set()
        thread.join()
