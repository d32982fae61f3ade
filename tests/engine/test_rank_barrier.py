"""A rank that loads (or times its tactics) far longer than the step timeout does not break the group:
the first collective after the load is a barrier under the join timeout (parallel.wait_for_ranks)."""

from __future__ import annotations

import time

import torch
import torch.multiprocessing as mp
from kiln.engine import parallel
from netutil import free_port

STEP_TIMEOUT_S = 2.0  # what every later collective waits at most


def _rank(rank: int, port: int, slow_s: float, join_timeout_s: float, barrier: bool, results) -> None:
    torch.set_num_threads(1)
    parallel.init_distributed(rank, 2, 1, "cpu", init_method=f"tcp://127.0.0.1:{port}", timeout_s=STEP_TIMEOUT_S)
    try:
        if rank == 1:
            time.sleep(slow_s)  # this rank's weights load, or its tactics are timed, slowly
        if barrier:
            parallel.wait_for_ranks(join_timeout_s, "loading its weights")
        total = parallel.min_over_ranks(rank + 1)
        results.put((rank, f"ok {total}"))
    except Exception as exc:  # reported to the test
        results.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        parallel.destroy_distributed()


def _run(slow_s: float, join_timeout_s: float, barrier: bool) -> dict[int, str]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, slow_s, join_timeout_s, barrier, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    out = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return out


def test_a_slow_rank_is_waited_for_under_the_join_timeout():
    assert _run(slow_s=3 * STEP_TIMEOUT_S, join_timeout_s=60, barrier=True) == {0: "ok 1", 1: "ok 1"}


def test_without_the_barrier_the_step_timeout_breaks_the_group():
    out = _run(slow_s=3 * STEP_TIMEOUT_S, join_timeout_s=60, barrier=False)
    assert not out[0].startswith("ok")  # what happened before the barrier existed


def test_a_rank_that_never_comes_is_named_within_the_join_timeout():
    started = time.monotonic()
    out = _run(slow_s=8.0, join_timeout_s=3.0, barrier=True)
    assert out[0].startswith("TimeoutError: not every rank finished loading its weights within join_timeout_s (3s)")
    assert "1" in out[0] and time.monotonic() - started < 60
