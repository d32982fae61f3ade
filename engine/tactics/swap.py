"""Swapping in a table timed after /ready (``deferred.py``): the engine's side, which packs by it (``bind``).

``prepare_deferred`` takes the job a deferred ``resolve`` left on the default table and tells it which MLP to copy
for the prefill slice; ``tick`` runs on the engine thread between steps (``ModelRunner.swap_pending_tactics``,
from the engine's between-steps hook ``between_steps.TacticSwap``): it starts the job, and once the table is
timed packs the model by it (``swap``), so no step ever runs on half-packed weights.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any

import torch
from kiln.engine.models.llama import apply_mlp_rows, mlp_rows_at_load, sliced_mlps
from kiln.engine.tactics.bind import amx_queries, bind, invariance, linear_modules
from kiln.engine.tactics.deferred import Deferred
from kiln.engine.tactics.table import TacticTable
from kiln.engine.tactics.timing import time_mlp_slices

log = logging.getLogger("kiln.engine.tactics")


def time_mlp_copy(table: TacticTable, mlp, hidden: int, dtype: torch.dtype, rows: int,
                  choices: tuple[int, ...], native) -> dict[str, Any] | None:
    """The MLP's prefill slice, timed on a copy of one layer's MLP packed by ``table`` (the engine's own MLP
    keeps serving meanwhile); None when it cannot be copied or there is nothing to choose."""
    if len(choices) < 2:
        return None
    try:
        ops = mlp.__dict__.get("native_ops")
        clone = copy.deepcopy(mlp, {id(ops): ops} if ops is not None else None)
        bind(clone, linear_modules(clone, rows, rows, dtype), table, native, rows, stack=False)
    except Exception as exc:  # noqa: BLE001 - a module that does not copy keeps the default slice
        log.info("tactics: the MLP's prefill slice keeps its default (%s)", exc)
        return None
    us = {k: round(v * 1e6, 1) for k, v in time_mlp_slices(clone, hidden, dtype, rows, choices).items()}
    return {"winner": int(min(us, key=us.get)), "us": us, "how": f"one MLP (a copy), {rows} rows, in the background"}


def swap(model, config, native, stack: bool, job: Deferred) -> tuple[TacticTable, dict[str, Any]] | None:
    """Pack ``model`` by the job's table (on the engine thread, between steps); None if the job failed. Linears
    the default packed (weights only kiln reads) keep that packing: their plain weight is gone."""
    table = job.result
    if table is None:
        return None
    started = time.monotonic()
    modules = [(m, s) for m, s in linear_modules(model, config.max_num_tokens, config.max_batch_size,
                                                  config.torch_dtype) if getattr(m, "packed_weight", None) is None]
    if native is not None:
        native.attention_amx_queries = amx_queries(table, stack, config.batch_invariant)
    apply_mlp_rows(sliced_mlps(model), table)
    counts = bind(model, modules, table, native, config.max_batch_size, stack, config.tactics_exclude or (),
                  config.batch_invariant)
    stacked = "not bound"
    if native is not None and stack and (table.model.get("decoder_stack") or {}).get("winner") != "modules":
        why = model.bind_native_stack(native)
        stacked = why or "bound"
    seconds = round(time.monotonic() - (job.started_at or started), 2)
    how = ("timed meanwhile by another engine of this process (its cached table)" if job.reused else
           "timed in the background after /ready")
    info = {**job.info, "origin": "cache" if job.reused else "timed-here", "layouts": counts,
            "seconds": round(table.seconds, 2),
            "why": f"{job.info.get('why_timed', 'no table for this host')}: {how} "
                   f"({seconds}s from the start of timing), swapped in between steps "
                   f"(repacked {len(modules)} linears in {time.monotonic() - started:.2f}s; decoder stack {stacked})",
            "table": str(job.cache_path) if job.cache_path else None}
    info.pop("why_timed", None)
    if config.batch_invariant:
        info["batch_invariant"] = invariance(counts)
    log.warning("tactics: %s", info["why"])
    return table, info


def prepare_deferred(table: TacticTable, model, config, native) -> Deferred | None:
    """The job a deferred ``resolve`` left on ``table`` (None: nothing deferred), told which MLP to copy for the
    prefill slice and which kernels to pack with."""
    job = getattr(table, "pending", None)
    if job is None:
        return None
    table.pending = None
    job.native = native
    mlps = sliced_mlps(model)
    if mlps:
        tokens, choices = mlp_rows_at_load(config.max_num_tokens)
        args = (mlps[0], mlps[0].gate_up_proj.input_size, config.torch_dtype, tokens, choices, native)
        job.time_mlp = lambda table: time_mlp_copy(table, *args)
    return job


def tick(job: Deferred, table: TacticTable, config, model, stack: bool
         ) -> tuple[TacticTable, dict[str, Any], Deferred | None]:
    """One engine-loop tick: start the job (its first), or swap its table in once timed; returns the engine's
    (table, tactics_info, job still pending or None)."""
    info = config.tactics_info
    if job.thread is None:
        job.start(torch.get_num_threads())
        return table, info, job
    if not job.done.is_set():
        return table, info, job
    swapped = swap(model, config, job.native, stack, job)
    if swapped is None:
        swapped = table, {"why": f"{info.get('why')}; timing failed ({job.error!r}): the default stays"}
    # In place, one C-level update: /version holds this dict and may serialize it on another thread meanwhile.
    info.update(swapped[1])
    return swapped[0], info, None
