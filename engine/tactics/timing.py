"""Time every candidate a linear can run, at each row bucket its calls can reach, on this machine.

Candidates are timed interleaved (one sample of each in turn, the order rotating every round), so a
neighbour's burst on a shared host slows them all alike; each sample is enough calls to last
``MIN_SAMPLE_S``; the figure is the median of the samples. A candidate more than ``PRUNE_RATIO`` times
slower than the best on its first call after a warm-up, or after ``MIN_ROUNDS`` rounds, cannot win and is not timed
further (its time so far is kept, marked pruned). The whole measurement keeps to a time budget: buckets
are measured smallest first (decode-sized calls are the common ones), and a bucket the budget did not
reach takes the choice of the largest one measured (``inferred_from``).

A sample during which the timing thread was off the CPU for more than ``OFF_CPU_SHARE`` of it (preempted, or
blocked: the thread's CPU clock against the wall clock) is taken again, up to ``RETAKES`` times, keeping the
least disturbed. Before the first shape, :func:`settle` waits (at most ``SETTLE_S``) for ``SETTLE_CLEAN``
undisturbed samples in a row, so the load's own work beside it ends first: the tokenizer's import, on its own
thread, holds the GIL, which every candidate leaves and must take back. On a 2-core VM the first shape timed
after a load lost up to 99 % of a sample so; the cached table ran o_proj on ATen and took the decoder stack
away at every later start (float32 decode 1.19-1.27x slower on the bench model).

Wide weights are timed on their first ``TIMED_COLUMNS`` output columns: every candidate's time grows
linearly in the columns past a few hundred, and a full LM head packed three ways would cost gigabytes.
"""

from __future__ import annotations

import ctypes
import math
import sys
import time
from dataclasses import dataclass, field

import torch
from kiln.engine import parallel
from kiln.engine.kernels import candidates, formats
from kiln.engine.kernels.native import ROW_BUCKETS

MIN_SAMPLE_S = 2e-3
MIN_ROUNDS, MAX_ROUNDS = 3, 7
PRUNE_RATIO = 2.0
OFF_CPU_SHARE, RETAKES = 0.05, 3
SETTLE_S, SETTLE_CLEAN = 2.0, 3
TIMED_COLUMNS = 8192


@dataclass(frozen=True)
class LinearSite:
    """A linear shape the model runs and the most rows one call of it sees."""

    dtype: torch.dtype  # of the activations (and, unquantized, the weight)
    n: int
    k: int
    max_rows: int
    stacked: bool = False  # a decoder layer's linear (the stack runs it in kiln's layout, bind.stack_layout)
    quant: str | None = None  # the weight's format key (kernels.formats: int8, a GGUF block type), None: float

    @property
    def key(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{'+' + self.quant if self.quant else ''}:{self.n}x{self.k}"


@dataclass
class BucketTiming:
    rows: int  # the rows timed: the bucket's top, or the site's max_rows where that is lower
    seconds: dict[str, float] = field(default_factory=dict)  # candidate -> median seconds per call
    pruned: list[str] = field(default_factory=list)
    inferred_from: int | None = None  # not measured (budget): the rows whose timings stand in


def bucket_rows(max_rows: int) -> list[int]:
    """The rows timed for each row bucket a call of up to ``max_rows`` rows falls in (bucket b: 2^b)."""
    out = []
    for b in range(ROW_BUCKETS):
        out.append(min(1 << b, max_rows))
        if 1 << b >= max_rows:
            break
    return out


def _run(fn, inner: int) -> tuple[float, float]:
    """(seconds off the CPU, wall seconds) of ``inner`` calls: the thread's CPU clock against the wall's."""
    cpu, t0 = time.thread_time(), time.perf_counter()
    for _ in range(inner):
        fn()
    wall = time.perf_counter() - t0
    return wall - (time.thread_time() - cpu), wall


def _undisturbed(off: float, wall: float) -> bool:
    return off <= OFF_CPU_SHARE * wall


def _sample(fn, inner: int) -> float:
    """Seconds per call of ``inner`` calls, the least disturbed of up to ``1 + RETAKES`` tries (see above)."""
    best = (math.inf, math.inf)
    for _ in range(1 + RETAKES):
        best = min(best, _run(fn, inner))
        if _undisturbed(*best):
            break
    return best[1] / inner


def settle(limit_s: float = SETTLE_S) -> float:
    """Fill a buffer through ctypes (it leaves the GIL and takes it back, as kiln's kernels do) until
    ``SETTLE_CLEAN`` samples in a row keep the thread on the CPU, or ``limit_s`` passes; the seconds it took.
    Each sample spans two of the interpreter's switch intervals, so a thread holding the GIL gets a turn in it."""
    buf = ctypes.create_string_buffer(1 << 16)
    span = 2 * sys.getswitchinterval()
    started, clean = time.monotonic(), 0
    while clean < SETTLE_CLEAN and time.monotonic() - started < limit_s:
        cpu, t0 = time.thread_time(), time.perf_counter()
        while (wall := time.perf_counter() - t0) < span:
            ctypes.memset(buf, 0, len(buf))
        clean = clean + 1 if _undisturbed(wall - (time.thread_time() - cpu), wall) else 0
    return time.monotonic() - started


def time_bucket(fns: dict[str, callable]) -> tuple[dict[str, float], list[str]]:
    """Median seconds per call of each function, interleaved; and which were pruned."""
    for fn in fns.values():  # warm-up: first-call costs (oneDNN creates its primitive for the shape)
        fn()
    first = {name: _sample(fn, 1) for name, fn in fns.items()}
    best = min(first.values())
    alive = [n for n in fns if first[n] <= PRUNE_RATIO * 2 * best]
    pruned = [n for n in fns if n not in alive]
    samples: dict[str, list[float]] = {n: [] for n in fns}
    for n in pruned:
        samples[n].append(first[n])
    inner = {n: max(1, math.ceil(MIN_SAMPLE_S / max(first[n], 1e-7))) for n in alive}
    for r in range(MAX_ROUNDS):
        order = alive[r % len(alive):] + alive[:r % len(alive)]
        for n in order:
            samples[n].append(_sample(fns[n], inner[n]))
        if r + 1 == MIN_ROUNDS and len(alive) > 1:
            med = {n: sorted(samples[n])[len(samples[n]) // 2] for n in alive}
            top = min(med.values())
            pruned += [n for n in alive if med[n] > PRUNE_RATIO * top]
            alive = [n for n in alive if med[n] <= PRUNE_RATIO * top]
        if r + 1 >= MIN_ROUNDS and len(alive) == 1:
            break
    return {n: sorted(s)[len(s) // 2] for n, s in samples.items()}, pruned


def time_site(site: LinearSite, names: list[str], native, deadline: float,
              generator: torch.Generator) -> list[BucketTiming]:
    """Every bucket of ``site`` for the candidates ``names`` (each runnable here), until ``deadline``."""
    n = min(site.n, TIMED_COLUMNS)
    weight, scale = (torch.randn(n, site.k, generator=generator) * 0.02).to(site.dtype), None
    weight, scale = formats.of(site.quant).quantize(weight)  # a GGUF block weight carries its type
    packed = {}
    for name in names:
        layout = candidates.LINEAR[name].layout
        if layout not in packed:  # kiln's panels shared with oneDNN where its packing is the same bytes
            share = layout == "kiln" and "onednn-panels" in names
            packed[layout] = candidates.pack(layout, weight, native, scale=scale, dtype=site.dtype, share_onednn=share)
    if "onednn-panels" in names and packed["kiln"].onednn is None:
        names = [n for n in names if n != "onednn-panels"]  # oneDNN packs this shape otherwise: not a candidate
    out: list[BucketTiming] = []
    for rows in bucket_rows(site.max_rows):
        if out and time.monotonic() > deadline:
            out.append(BucketTiming(rows, dict(out[-1].seconds), list(out[-1].pruned),
                                    inferred_from=out[-1].inferred_from or out[-1].rows))
            continue
        x = torch.randn(rows, site.k, generator=generator).to(site.dtype)
        fns = {}
        for name in names:
            cand = candidates.LINEAR[name]
            p = packed[cand.layout]
            if cand.gemm_kernel is not None:  # kiln's kernels share one packed copy: each call sets its own
                def fn(p=p, kernel=cand.gemm_kernel, x=x):
                    if p.tactics[0] != kernel:
                        p.set_tactics([kernel] * ROW_BUCKETS)
                    return p(x)
            else:
                def fn(p=p, x=x, plain=cand.layout == "plain"):
                    return candidates.run(p, x, None, plain, scale)
            fns[name] = fn
        seconds, pruned = time_bucket(fns)
        out.append(BucketTiming(rows, seconds, pruned))
    return out


def time_attention(native, heads: int, kv_heads: int, head_dim: int, rows: int = 8, context: int = 256
                   ) -> dict[str, float]:
    """Median seconds of one prefill group's attention (``rows`` tokens sharing a 16-token-block table, causal up
    to ``context``) on kiln's bf16 pair-layout cache, with its scores and values on vdpbf16ps or AMX tiles."""
    gen = torch.Generator().manual_seed(1)
    blocks = -(-context // 16)
    keys, values = (torch.randn(kv_heads, blocks, 16, head_dim, generator=gen).bfloat16() for _ in range(2))
    k_cache, v_cache = torch.empty_like(keys), torch.empty_like(values)
    native.store_cache(keys, values, k_cache, v_cache)
    q = torch.randn(rows, heads, head_dim, generator=gen).bfloat16()
    tables = torch.arange(blocks, dtype=torch.int32).repeat(rows, 1)
    lens = torch.arange(context - rows + 1, context + 1, dtype=torch.int32)
    starts = torch.tensor([0, rows], dtype=torch.int32)
    out = torch.empty_like(q)
    before = native.attention_amx_queries
    fns = {}
    for name, queries in (("vdpbf16ps", 0), ("amx", 16)):
        def fn(queries=queries):
            native.attention_amx_queries = queries
            native.paged_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5, out, starts)
        fns[name] = fn
    try:
        seconds, _ = time_bucket(fns)
    finally:
        native.attention_amx_queries = before
    return seconds


def time_mlp_slices(mlp, hidden: int, dtype: torch.dtype, rows: int, choices: tuple[int, ...]) -> dict[str, float]:
    """Median seconds of one ``rows``-row MLP pass (``mlp``: a model's own, weights as packed) sliced at each
    of ``choices`` rows, interleaved."""
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(2)).to(dtype)
    before = mlp.mlp_rows
    fns = {}
    for choice in choices:
        def fn(choice=choice):
            mlp.mlp_rows = choice
            mlp(x)
        fns[str(choice)] = fn
    try:
        with torch.inference_mode(), parallel.no_collectives():  # ranks time apart; bind agrees on one choice
            seconds, _ = time_bucket(fns)
    finally:
        mlp.mlp_rows = before
    return seconds
