"""A table timed after ``/ready``: serve on a default table at once, time this host's own in the background.

``kiln serve``'s loader builds its engine inside :func:`in_background` (``$KILN_TACTICS_AT_LOAD``: ``background`` or
``sync`` overrides; the library's default is ``sync``: ``LLM()`` times at load, as before). Where
``resolve.resolve`` would time linears at load (no table for this host: a checkpoint directory, or an artifact
on another kind of host, with nothing cached) it then returns :func:`default_table` instead, untimed, with a
:class:`Deferred` job on it (``table.pending``):

- the default: every linear runs the first candidate of :data:`FALLBACK` that can run it (``aten``, torch's
  own linear on the plain weight: correct on every host, MKL's sgemm for float32; a weight only kiln's
  kernels read, GGUF blocks, takes the first kiln candidate that can). Nothing is packed, nothing is timed;
  the decoder stack and the MLP's prefill slice keep the model's defaults. No CPU flag picks it;
- the job (a daemon thread the engine thread starts at its first tick) times the linears within the usual
  budget (``resolve.measure``) at the engine's thread count, and the MLP's prefill slice on a private copy
  of one layer's MLP (``swap.time_mlp_copy``), keeps the build's model-level choices where there was a build,
  and saves the table where the next start looks first (the artifact's re-timed cache, or
  ``~/.cache/kiln/tactics``);
- ``swap.py`` packs the model by it, on the engine thread between steps: the loop never runs a step on
  half-packed weights.

Only a single-rank engine defers (ranks would have to swap at the same step).
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
from kiln.engine import parallel
from kiln.engine.kernels import candidates
from kiln.engine.tactics import host_signature
from kiln.engine.tactics.table import LinearChoice, TacticTable
from kiln.engine.tactics.timing import LinearSite, bucket_rows

log = logging.getLogger("kiln.engine.tactics")

MODE_ENV = "KILN_TACTICS_AT_LOAD"
FALLBACK = ("aten", "kiln-fma", "kiln-gguf", "kiln-gguf-f32")  # in order: the first that can run a linear
DEFAULT_MODEL = {"decoder_stack": {"winner": "modules", "how": "default until timed"},
                 "mlp_rows": {"winner": None, "how": "default until timed"}}


def wanted(background: bool) -> bool:
    """Defer timing to after ``/ready`` where one rank serves: ``background`` (``EngineConfig.tactics_background``,
    on in ``kiln serve``) unless ``$KILN_TACTICS_AT_LOAD`` says ``sync`` or ``background``."""
    mode = os.environ.get(MODE_ENV, "").strip().lower() or ("background" if background else "sync")
    return mode == "background" and parallel.world_size() == 1


def fallback(site: LinearSite, native, exclude=()) -> str:
    runs = [n for n in candidates.LINEAR if candidates.why_not(n, site.dtype, native, site.quant, exclude) is None]
    return next((n for n in FALLBACK if n in runs), runs[0])


def default_table(sites: list[LinearSite], native, exclude=()) -> TacticTable:
    """Every site on its :func:`fallback`, untimed (``exclude``: the engine's ``tactics_exclude``)."""
    table = TacticTable(host=host_signature.cpu_signature(exclude=exclude), model=copy.deepcopy(DEFAULT_MODEL))
    for site in sites:
        name = fallback(site, native, exclude)
        table.linear[site.key] = LinearChoice(site.key, candidates.LINEAR[name].layout, [
            {"rows": rows, "runs": name, "winner": name, "runner_up": None, "us": {}, "pruned": [],
             "inferred_from": None} for rows in bucket_rows(site.max_rows)])
    return table


# One background timing at a time in a process: two would time each other's load, and a pool's reload of a model
# waits for the table its last engine is still timing (Deferred.reuse) rather than time it again.
_TIMING = threading.Lock()


class Deferred:
    """The background measurement of one engine's table. ``measure()`` returns the table (``resolve``'s);
    ``done`` says the result (or the failure) is in."""

    def __init__(self, measure, info: dict[str, Any], cache_path: Path | None, reuse=None) -> None:
        self.measure, self.info, self.cache_path = measure, info, cache_path
        self.reuse = reuse  # () -> the table another engine of this process timed meanwhile (cached), or None
        self.reused = False
        self.result: TacticTable | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread: threading.Thread | None = None
        self.started_at: float | None = None
        self.time_mlp = None  # table -> the MLP's prefill slice timed on a copy packed by it (tactics.swap)
        self.native = None  # the kernels the table packs for

    def start(self, threads: int) -> None:
        if self.thread is None:
            self.started_at = time.monotonic()
            self.thread = threading.Thread(target=self._run, args=(threads,), name="kiln-tactics", daemon=True)
            self.thread.start()

    def _measured(self) -> TacticTable:
        table = self.measure()
        time_mlp = self.time_mlp  # None once the engine let go (let_go)
        if time_mlp is not None and "mlp_rows" not in table.model:
            slices = time_mlp(table)
            if slices:
                table.model["mlp_rows"] = slices
        if self.cache_path is not None:
            try:
                table.save(self.cache_path)
            except OSError as exc:
                log.warning("could not cache the tactic table at %s (%s)", self.cache_path, exc)
        return table

    def let_go(self) -> None:
        """The engine shut down (a pool's unload): drop the MLP the prefill slice would be timed on, the one
        thing of the engine's model the job holds (through it, the panels its weights share), so a timing still
        under way keeps shapes only and the engine's memory goes with it. The linears it times are still cached
        for the model's next engine."""
        self.time_mlp = None

    def _run(self, threads: int) -> None:
        try:
            with _TIMING:
                torch.set_num_threads(threads)  # this thread's OpenMP team: the engine's count (the signature's)
                table = self.reuse() if self.reuse is not None else None
                self.reused = table is not None
                self.result = table if table is not None else self._measured()
            if self.reused:
                log.info("tactics: %s was timed meanwhile by another engine of this process", self.cache_path)
        except BaseException as exc:  # noqa: BLE001 - the engine keeps serving on the default
            log.exception("tactics: timing this host's table in the background failed; the default stays")
            self.error = exc
        finally:
            self.done.set()
