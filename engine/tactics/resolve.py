"""Which tactic table a CPU engine runs at load, and how its linears are packed by it.

``EngineConfig.tactics`` says where the table comes from:

- a path (an artifact's ``tactics.json``, set by ``from_artifact``): used as is when this host's
  signature (``host.py``) is the one it was measured on. On another kind of host the linears are timed
  again here (bounded by ``$KILN_TACTICS_BUDGET_S``), the result cached in ``EngineConfig.tactics_cache``
  (beside the artifact's copy) for the next start, and the log says what differed. Model-level choices
  measured by the build (the decoder stack, the attention backend) are kept: they hold across CPU kinds
  far better than a kernel's crossover does, and timing them needs the whole model.
- ``"auto"``: measured here on first use, then reused from memory and from ``~/.cache/kiln/tactics``.
- a candidate name (``kiln-fma``, ``kiln-amx``, ``onednn``, ``aten``): every linear runs it wherever it
  can run; the rest are measured as for ``"auto"``.

A table that does not cover the model's linears is another model's and is refused (``TacticsError``).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from kiln.engine.tactics import candidates, host
from kiln.engine.tactics.table import LinearChoice, TacticsError, TacticTable, choose
from kiln.engine.tactics.timing import TIMED_COLUMNS, LinearSite, bucket_rows, time_site

log = logging.getLogger("kiln.engine.tactics")

BUDGET_ENV = "KILN_TACTICS_BUDGET_S"
LOAD_BUDGET_S = 20.0  # most a load spends timing linears (a build's tune stage gives more)
_memo: dict[tuple[str, tuple], TacticTable] = {}


def measure(sites: list[LinearSite], native, budget_s: float, only: str | None = None) -> TacticTable:
    """Time every runnable candidate for every site; the table of choices. ``only``: that candidate runs
    every site it can run, untimed (the rest are timed)."""
    started = time.monotonic()
    deadline = started + budget_s
    table = TacticTable(host=host.cpu_signature())
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for site in sorted(sites, key=lambda s: s.n * s.k):
            names = [n for n in candidates.LINEAR if candidates.why_not(n, site.dtype, native, site.quant) is None]
            if only in names:  # forced: nothing to time
                table.linear[site.key] = LinearChoice(site.key, candidates.LINEAR[only].layout, [
                    {"rows": rows, "runs": only, "winner": only, "runner_up": None, "us": {}, "pruned": [],
                     "inferred_from": None} for rows in bucket_rows(site.max_rows)])
                continue
            timings = time_site(site, names, native, deadline, gen)
            table.linear[site.key] = choose(site.key, timings, min(site.n, TIMED_COLUMNS))
    table.seconds = time.monotonic() - started
    return table


def budget(default: float = LOAD_BUDGET_S) -> float:
    raw = os.environ.get(BUDGET_ENV, "").strip()
    try:
        return float(raw) if raw else default
    except ValueError:
        log.warning("$%s=%r is not a number of seconds; using %.0f", BUDGET_ENV, raw, default)
        return default


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kiln" / "tactics"


def _sites_key(sites: list[LinearSite]) -> tuple:
    return tuple(sorted((s.key, s.max_rows) for s in sites))


def _check_covers(table: TacticTable, sites: list[LinearSite], what: str) -> None:
    missing = [s.key for s in sites if s.key not in table.linear]
    if missing:
        raise TacticsError(f"{what} is refused: it has no entry for the model's linear(s) {', '.join(missing[:4])} "
                           f"(another model's table?); rebuild the engine, or delete it so that it is measured again")


def _load_cached(path: Path, sites: list[LinearSite]) -> TacticTable | None:
    if not path.is_file():
        return None
    try:
        table = TacticTable.load(path)
        _check_covers(table, sites, f"tactic table {path}")
        return table
    except TacticsError as exc:
        log.warning("%s; measuring again", exc)
        return None


def _save(table: TacticTable, path: Path) -> Path | None:
    try:
        return table.save(path)
    except OSError as exc:
        log.warning("could not cache the tactic table at %s (%s)", path, exc)
        return None


def resolve(source: str, sites: list[LinearSite], native, cache_dir: str | None = None
            ) -> tuple[TacticTable, dict[str, Any]]:
    """The table to run ``sites`` with, and what ``/version`` and the log say about where it came from."""
    here = host.cpu_signature()
    key = host.signature_key(here)
    info: dict[str, Any] = {"host": host.describe(here), "host_key": key}
    if source in candidates.LINEAR:
        table = measure(sites, native, budget(), only=source)
        return table, {**info, "source": f"forced {source}", "seconds": round(table.seconds, 2)}
    if source != "auto":
        built = TacticTable.load(Path(source))
        _check_covers(built, sites, f"tactic table {source}")
        cannot = runnable(built, sites, native)
        if host.signature_key(built.host) == key and cannot is None:
            return built, {**info, "source": "artifact", "table": source}
        diffs = host.differences(built.host, here) + ([cannot] if cannot else [])
        cached_path = Path(cache_dir or _cache_dir()) / f"{key}.json"
        cached = _load_cached(cached_path, sites)
        if cached is not None and runnable(cached, sites, native) is None:
            cached.model = built.model
            log.info("tactics: this host differs from the build's (%s): using the table re-timed here before, %s",
                     "; ".join(diffs), cached_path)
            return cached, {**info, "source": "re-timed (cached)", "table": str(cached_path), "differs": diffs}
        log.warning("tactics: %s was measured on %s; this host is %s (%s): re-timing its linears here",
                    source, host.describe(built.host), host.describe(here), "; ".join(diffs))
        table = measure(sites, native, budget())
        table.model = built.model
        saved = _save(table, cached_path)
        log.warning("tactics: re-timed %d linear shapes in %.1fs%s", len(table.linear), table.seconds,
                    f", cached in {saved}" if saved else "")
        return table, {**info, "source": "re-timed", "seconds": round(table.seconds, 2), "differs": diffs,
                       "table": str(saved) if saved else None}
    memo_key = (key, _sites_key(sites))
    if memo_key in _memo:
        return _memo[memo_key], {**info, "source": "measured (this process)"}
    path = _cache_dir() / f"{key}-{host.signature_key({'sites': list(memo_key[1])})}.json"
    table = _load_cached(path, sites)
    if table is not None and runnable(table, sites, native) is None:
        _memo[memo_key] = table
        return table, {**info, "source": "measured (cached)", "table": str(path)}
    table = measure(sites, native, budget())
    _memo[memo_key] = table
    saved = _save(table, path)
    log.info("tactics: timed %d linear shapes in %.1fs on %s", len(table.linear), table.seconds, info["host"])
    return table, {**info, "source": "measured", "seconds": round(table.seconds, 2),
                   "table": str(saved) if saved else None}


def packing(choice: LinearChoice, site: LinearSite, native, layout: str | None = None,
            python_margin: float | None = None) -> tuple[str, list[str] | None]:
    """(layout, kiln GEMM kernel per row bucket or None) for ``site``, which the table chose ``choice`` for (in
    ``layout`` when given: the decoder stack needs kiln's; ``python_margin``: see ``LinearChoice.kernels``);
    ``TacticsError`` if a bucket names a candidate this host cannot run."""
    from kiln.engine.kernels.native import ROW_BUCKETS

    layout = layout or choice.layout
    runs = choice.kernels(layout, python_margin)
    for name in set(runs):
        why = candidates.why_not(name, site.dtype, native, site.quant)
        if why:
            raise TacticsError(f"tactic table entry {choice.key} runs {name}, which cannot run here ({why}); "
                               f"delete the table so that this host measures its own")
    if layout != "kiln":
        return layout, None
    names = (runs + [runs[-1]] * ROW_BUCKETS)[:ROW_BUCKETS]
    return "kiln", [candidates.LINEAR[n].gemm_kernel for n in names]


def runnable(table: TacticTable, sites: list[LinearSite], native) -> str | None:
    """Why some entry of ``table`` cannot run here (None: every one can)."""
    for site in sites:
        try:
            packing(table.linear[site.key], site, native)
        except TacticsError as exc:
            return str(exc)
    return None
