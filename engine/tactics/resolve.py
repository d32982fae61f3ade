"""Which tactic table a CPU engine runs at load, and how its linears are packed by it.

``EngineConfig.tactics`` says where the table comes from:

- a path (an artifact's ``tactics.json``, set by ``from_artifact``): used as is when this host's
  signature (``host_signature.py``) is the one it was measured on. On another kind of host the linears are timed
  again here (bounded by ``$KILN_TACTICS_BUDGET_S``), the result cached in ``EngineConfig.tactics_cache``
  (beside the artifact's copy) for the next start, and the log says what differed. Model-level choices
  measured by the build (the decoder stack, the attention backend) are kept: they hold across CPU kinds
  far better than a kernel's crossover does, and timing them needs the whole model.
- ``"auto"``: measured here on first use, then reused from memory and from ``~/.cache/kiln/tactics``.
- a candidate name (``candidates.LINEAR``: ``kiln-fma``, ``kiln-amx``, ``onednn-panels``, ``onednn``,
  ``aten``): every linear runs it wherever it can run, untimed; the rest are timed.

Where a table would be timed at load and ``deferred.wanted`` (``kiln serve``), the untimed default is returned
instead, with the job that times the real one after ``/ready`` (``deferred.py``, ``swap.py``). ``/version``'s
``origin`` says which (``artifact``, ``cache``, ``default-until-timed``, ``timed-here``, ``forced``), ``why`` why.

A table that covers none of the model's linear shapes is another model's and is refused (``TacticsError``);
one that lacks some (a later pipeline stage's, which the build did not load) has just those timed here.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from kiln.engine.host_cache import host_cache_dir
from kiln.engine.kernels import candidates
from kiln.engine.kernels.native import ROW_BUCKETS
from kiln.engine.tactics import deferred, host_signature
from kiln.engine.tactics.table import (
    LinearChoice,
    TacticsError,
    TacticTable,
    both_copies,
    choose,
    second_copy,
)
from kiln.engine.tactics.timing import (
    SETTLE_S,
    TIMED_COLUMNS,
    LinearSite,
    bucket_rows,
    settle,
    time_attention,
    time_site,
)

log = logging.getLogger("kiln.engine.tactics")

BUDGET_ENV = "KILN_TACTICS_BUDGET_S"
LOAD_BUDGET_S = 20.0  # most a load spends timing linears (a build's tune stage gives more)
_memo: dict[tuple[str, tuple], TacticTable] = {}


ATTENTION_TILE_QUERIES = 16  # a group fills AMX tiles from this many query vectors (16 rows per tile)


def measure_attention(native, attention: dict[str, Any] | None) -> dict[str, Any] | None:
    """Prefill attention on AMX tiles or on vdpbf16ps, timed for the model's heads, where both can run: a
    bf16 cache in kiln's pair layout (16-token blocks, head size a multiple of 32) on an AMX host, and prefill
    groups (8 rows x the GQA group) that fill a tile."""
    if not attention or native is None or native.kv_mode(attention["dtype"]) != 2 or attention["block_size"] != 16:
        return None
    heads, kv_heads, d = attention["heads"], attention["kv_heads"], attention["head_dim"]
    if native.gemm_kernels[torch.bfloat16]["amx"] or d % 32 or 8 * heads // kv_heads < ATTENTION_TILE_QUERIES:
        return None
    us = {k: round(v * 1e6, 2) for k, v in time_attention(native, heads, kv_heads, d).items()}
    winner = min(us, key=us.get)
    return {"winner": winner, "us": us, "min_queries": ATTENTION_TILE_QUERIES if winner == "amx" else 0}


def measure(sites: list[LinearSite], native, budget_s: float, only: str | None = None,
            attention: dict[str, Any] | None = None, exclude=()) -> TacticTable:
    """Time every runnable candidate for every site; the table of choices. ``only``: that candidate runs
    every site it can run, untimed (the rest are timed). ``attention`` (heads, kv_heads, head_dim,
    block_size, dtype of the KV cache): also how a prefill group attends (``measure_attention``); ``exclude``:
    the engine's ``tactics_exclude``."""
    started = time.monotonic()
    deadline = started + budget_s
    table = TacticTable(host=host_signature.cpu_signature(exclude=exclude))
    gen = torch.Generator().manual_seed(0)
    settled = False
    with torch.inference_mode():
        for site in sorted(sites, key=lambda s: s.n * s.k):
            names = [n for n in candidates.LINEAR
                     if candidates.why_not(n, site.dtype, native, site.quant, exclude) is None]
            if only in names:  # forced: nothing to time
                table.linear[site.key] = LinearChoice(site.key, candidates.LINEAR[only].layout, [
                    {"rows": rows, "runs": only, "winner": only, "runner_up": None, "us": {}, "pruned": [],
                     "inferred_from": None} for rows in bucket_rows(site.max_rows)])
                continue
            if not settled:  # once, before the first shape that is timed (a forced table times none)
                _settle(budget_s)
                settled = True
            timings = time_site(site, names, native, deadline, gen)
            table.linear[site.key] = choose(site.key, timings, min(site.n, TIMED_COLUMNS))
        tiles = measure_attention(native, attention)
        if tiles:
            table.model["attention_tiles"] = tiles
    table.seconds = time.monotonic() - started
    return table


def _settle(budget_s: float) -> None:
    """``timing.settle`` within a quarter of the budget, logged where it waited."""
    waited = settle(min(SETTLE_S, budget_s / 4))
    if waited > 0.1:
        log.info("tactics: waited %.2fs for the timing thread to keep the CPU before timing", waited)


def budget(default: float = LOAD_BUDGET_S) -> float:
    raw = os.environ.get(BUDGET_ENV, "").strip()
    try:
        return float(raw) if raw else default
    except ValueError:
        log.warning("$%s=%r is not a number of seconds; using %.0f", BUDGET_ENV, raw, default)
        return default


def _cache_dir() -> Path:
    return host_cache_dir("tactics")


def _sites_key(sites: list[LinearSite]) -> tuple:
    return tuple(sorted((s.key, s.max_rows) for s in sites))


# model-level choices a re-timing host measures anew (attention_tiles here, mlp_rows at bind); the rest are the build's
HOST_MODEL_OPS = ("attention_tiles", "mlp_rows")


def _host_model(table: TacticTable) -> dict[str, Any]:
    return {k: v for k, v in table.model.items() if k in HOST_MODEL_OPS}


def _sites_hash(sites: list[LinearSite]) -> str:
    """Names a cached table: one per host signature and model shapes."""
    return host_signature.signature_key({"sites": [list(k) for k in _sites_key(sites)]})


def _check_covers(table: TacticTable, sites: list[LinearSite], what: str) -> None:
    missing = [s.key for s in sites if s.key not in table.linear]
    if missing:
        raise TacticsError(f"{what} is refused: it has no entry for the model's linear(s) {', '.join(missing[:4])} "
                           f"(another model's table?); rebuild the engine, or delete it so that it is measured again")


def _load_cached(path: Path, sites: list[LinearSite], native, exclude=()) -> TacticTable | None:
    """The table cached at ``path`` where it covers ``sites`` and this host can run it, else None."""
    if not path.is_file():
        return None
    try:
        table = TacticTable.load(path)
        _check_covers(table, sites, f"tactic table {path}")
    except TacticsError as exc:
        log.warning("%s; measuring again", exc)
        return None
    return table if runnable(table, sites, native, exclude) is None else None


def _save(table: TacticTable, path: Path) -> Path | None:
    try:
        return table.save(path)
    except OSError as exc:
        log.warning("could not cache the tactic table at %s (%s)", path, exc)
        return None


def resolve(source: str, sites: list[LinearSite], native, cache_dir: str | None = None,
            attention: dict[str, Any] | None = None, exclude=(),
            background: bool = False) -> tuple[TacticTable, dict[str, Any]]:
    """The table to run ``sites`` with, and what ``/version`` and the log say about where it came from
    (``attention``, ``exclude``: as ``measure`` takes them; ``background``: a table timed here is timed after
    load, ``deferred.wanted``)."""
    here = host_signature.cpu_signature(exclude=exclude)
    key = host_signature.signature_key(here)
    info: dict[str, Any] = {"host": host_signature.describe(here), "host_key": key}
    if source in candidates.LINEAR:
        table = measure(sites, native, budget(), only=source, attention=attention, exclude=exclude)
        return table, {**info, "source": f"forced {source}", "origin": "forced", "seconds": round(table.seconds, 2),
                       "why": f"the engine's tactics setting names {source}"}
    if source != "auto":
        return _from_artifact(source, sites, native, cache_dir, attention, info, here, exclude, background)
    return _this_hosts(sites, native, attention, info, exclude, background)


def _from_artifact(source: str, sites: list[LinearSite], native, cache_dir: str | None,
                   attention: dict[str, Any] | None, info: dict[str, Any], here,
                   exclude=(), background: bool = False) -> tuple[TacticTable, dict[str, Any]]:
    """The artifact's table at ``source``: as built on the host it was measured on, else re-timed here."""
    key = info["host_key"]
    built = TacticTable.load(Path(source))
    missing = [s for s in sites if s.key not in built.linear]
    if len(missing) == len(sites):
        _check_covers(built, sites, f"tactic table {source}")
    cannot = runnable(built, [s for s in sites if s not in missing], native, exclude)
    if host_signature.signature_key(built.host) == key and cannot is None:
        if not missing:
            return built, {**info, "source": "artifact", "origin": "artifact", "table": source,
                           "why": "this host's signature is the one the table was measured on"}
        # a pipeline stage's own linears (the build timed the first stage's): timed here, the rest as built
        extra = measure(missing, native, budget(), exclude=exclude)
        built.linear.update(extra.linear)
        log.info("tactics: %s has no entry for %d linear shape(s) of this stage; timed them here in %.1fs",
                 source, len(missing), extra.seconds)
        return built, {**info, "source": f"artifact (+{len(missing)} shape(s) timed here)", "origin": "artifact",
                       "table": source, "why": f"this host's signature matches; {len(missing)} linear shape(s) "
                                               "the build did not load were timed here"}
    diffs = host_signature.differences(built.host, here) + ([cannot] if cannot else [])
    cached_path = Path(cache_dir or _cache_dir()) / f"{key}-{_sites_hash(sites)}.json"
    cached = _load_cached(cached_path, sites, native, exclude)
    if cached is not None:
        cached.model = {**built.model, **_host_model(cached)}
        log.info("tactics: this host differs from the build's (%s): using the table re-timed here before, %s",
                 "; ".join(diffs), cached_path)
        return cached, {**info, "source": "re-timed (cached)", "origin": "cache", "table": str(cached_path),
                        "differs": diffs, "why": "this host differs from the build's: the table re-timed here "
                                                 "at an earlier start"}
    return _retime(source, built, sites, native, attention, info, here, diffs, cached_path, exclude, background)


def _retime(source: str, built: TacticTable, sites: list[LinearSite], native, attention: dict[str, Any] | None,
            info: dict[str, Any], here, diffs: list[str], cached_path: Path,
            exclude=(), background: bool = False) -> tuple[TacticTable, dict[str, Any]]:
    """The artifact's table measured on another host: re-timed here (in the background when wanted), the
    build's model entries that are not host-bound kept."""
    why = "this host differs from the build's"
    if deferred.wanted(background):
        def retime() -> TacticTable:
            table = measure(sites, native, budget(), attention=attention, exclude=exclude)
            table.model = {**{k: v for k, v in built.model.items() if k not in HOST_MODEL_OPS}, **table.model}
            return table
        log.warning("tactics: %s was measured on %s; this host is %s (%s): serving on the default table while "
                    "its linears are re-timed in the background", source, host_signature.describe(built.host),
                    host_signature.describe(here), "; ".join(diffs))
        return _defer(sites, native, retime, {**info, "source": "re-timed", "differs": diffs, "why_timed": why},
                      cached_path, exclude)
    log.warning("tactics: %s was measured on %s; this host is %s (%s): re-timing its linears here",
                source, host_signature.describe(built.host), host_signature.describe(here), "; ".join(diffs))
    table = measure(sites, native, budget(), attention=attention, exclude=exclude)
    table.model = {**{k: v for k, v in built.model.items() if k not in HOST_MODEL_OPS}, **table.model}
    saved = _save(table, cached_path)
    log.warning("tactics: re-timed %d linear shapes in %.1fs%s", len(table.linear), table.seconds,
                f", cached in {saved}" if saved else "")
    return table, {**info, "source": "re-timed", "origin": "timed-here", "seconds": round(table.seconds, 2),
                   "differs": diffs, "table": str(saved) if saved else None, "why": f"{why}: re-timed at load"}


def _this_hosts(sites: list[LinearSite], native, attention: dict[str, Any] | None,
                info: dict[str, Any], exclude=(), background: bool = False) -> tuple[TacticTable, dict[str, Any]]:
    """No table came with the model: this process's, this host's cached one, or timed now (or in the
    background)."""
    key = info["host_key"]
    memo_key = (key, _sites_key(sites))
    if memo_key in _memo:
        return _memo[memo_key], {**info, "source": "measured (this process)", "origin": "cache",
                                 "why": "timed by an earlier engine of this process"}
    path = _cache_dir() / f"{key}-{_sites_hash(sites)}.json"
    table = _load_cached(path, sites, native, exclude)
    if table is not None:
        _memo[memo_key] = table
        return table, {**info, "source": "measured (cached)", "origin": "cache", "table": str(path),
                       "why": "no table came with the model: the one timed on this host at an earlier start"}
    if deferred.wanted(background):
        def timed() -> TacticTable:
            table = measure(sites, native, budget(), attention=attention, exclude=exclude)
            _memo[memo_key] = table
            return table
        return _defer(sites, native, timed, {**info, "source": "measured", "why_timed": "no table for this host"},
                      path, exclude)
    table = measure(sites, native, budget(), attention=attention, exclude=exclude)
    _memo[memo_key] = table
    saved = _save(table, path)
    log.info("tactics: timed %d linear shapes in %.1fs on %s", len(table.linear), table.seconds, info["host"])
    return table, {**info, "source": "measured", "origin": "timed-here", "seconds": round(table.seconds, 2),
                   "table": str(saved) if saved else None, "why": "no table for this host: timed at load"}


def _defer(sites: list[LinearSite], native, timed, final: dict[str, Any], path: Path,
           exclude=()) -> tuple[TacticTable, dict]:
    """The default table now, with the job that times the real one (``deferred.py``) on it as ``pending``."""
    table = deferred.default_table(sites, native, exclude)
    table.pending = deferred.Deferred(timed, final, path, reuse=lambda: _load_cached(path, sites, native, exclude))
    names = sorted({c.buckets[0]["runs"] for c in table.linear.values()})
    return table, {**{k: v for k, v in final.items() if k != "why_timed"}, "source": "default-until-timed",
                   "origin": "default-until-timed", "table": None,
                   "why": f"{final['why_timed']}: serving on the default ({', '.join(names)}, untimed) until this "
                          f"host's table is timed in the background (budget {budget():g}s) and swapped in"}


def persist(table: TacticTable, info: dict[str, Any]) -> None:
    """Save again a table this host timed or cached, once the load added model-level choices to it (the MLP's
    prefill slice): the next start then times nothing. Never an artifact's own table."""
    path = info.get("table")
    if path and info.get("origin") in ("timed-here", "cache"):
        _save(table, Path(path))


def packing(choice: LinearChoice, site: LinearSite, native, layout: str | None = None,
            python_margin: float | None = None, exclude=(), one_kernel: bool = False) -> tuple[str, list[str] | None]:
    """(layout, kiln GEMM kernel per row bucket or None) for ``site``, which the table chose ``choice`` for (in
    ``layout`` when given: the decoder stack needs kiln's; ``python_margin``: see ``LinearChoice.kernels``;
    ``one_kernel``: every bucket runs :func:`one_for_all_rows`); ``TacticsError`` if a bucket names a candidate
    this host cannot run. A weight in kiln's layout may run a ``candidates.SECOND_COPY`` candidate in the buckets
    where it is that much faster, from a second copy (``table.both_copies``)."""
    both = None if layout not in (None, "kiln") else \
        both_copies(choice, second_copy(choice, site, native, exclude, one_kernel), python_margin, site.stacked)
    layout = "kiln" if both else layout or choice.layout
    runs = both or choice.kernels(layout, python_margin)
    if one_kernel:
        runs = [one_for_all_rows(runs, choice.buckets)] * len(runs)
    for name in set(runs):
        why = candidates.why_not(name, site.dtype, native, site.quant, exclude)
        if why:
            raise TacticsError(f"tactic table entry {choice.key} runs {name}, which cannot run here ({why}); "
                               f"delete the table so that this host measures its own")
    if layout != "kiln":
        return layout, None
    names = (runs + [runs[-1]] * ROW_BUCKETS)[:ROW_BUCKETS]
    return "kiln", [candidates.LINEAR[n].gemm_kernel or candidates.SECOND_COPY[n] for n in names]


def one_for_all_rows(runs: list[str], buckets: list[dict[str, Any]]) -> str:
    """Of the candidates ``runs`` names (one per row bucket), the one to run at every row count (batch
    invariance: candidates round differently, e.g. a GGUF kernel quantizing its activations against the
    dequantized float32 one): the least summed time over the buckets where each was timed at all of them, else
    the one running the most buckets (a tie: the one at the most rows)."""
    names = list(dict.fromkeys(reversed(runs)))  # the most rows' first
    timed = {n: sum(b["us"][n] for b in buckets) for n in names
             if len(buckets) == len(runs) and all(n in (b.get("us") or {}) for b in buckets)}
    if timed:
        return min(names, key=lambda n: timed.get(n, float("inf")))
    return max(names, key=runs.count)


def runnable(table: TacticTable, sites: list[LinearSite], native, exclude=()) -> str | None:
    """Why some entry of ``table`` cannot run here (None: every one can)."""
    for site in sites:
        try:
            packing(table.linear[site.key], site, native, exclude=exclude)
        except TacticsError as exc:
            return str(exc)
    return None
