"""Apply a tactic table to a loaded CPU model: each linear's weight packed once, in the layout its table
entry chose, with the kernel per row bucket (``kernels.native.PackedLinear.set_tactics``).

One choice spans linears: the decoder stack (``kernels.native.DecoderStack``, a stage's layers in one C
call) runs only when every linear of the layers is in kiln's layout. The table's model-level
``decoder_stack`` entry, timed end to end by a build, decides: ``fused`` packs the layers' linears in
kiln's layout (each bucket by the fastest kiln kernel timed), ``modules`` leaves each shape its own
best. A table without it (measured at load) fuses when kiln's layout costs at most ``STACK_MARGIN``
times the best layout's per-token time for every layer shape: the stack saves what the Python between
the kernels costs (3-11 % of a step measured on the bench model), more than a few percent of GEMM time.
In the stack's layout a bucket runs oneDNN's GEMM on kiln's panels (``onednn-panels``, called from
Python, so such a step runs module by module) only where it is ``STACK_MARGIN`` times faster than kiln's
C kernels: prefill-sized steps, where the GEMMs dwarf the Python.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from kiln.engine import host_pages, parallel
from kiln.engine.kernels import candidates, formats
from kiln.engine.layers.attention import Attention
from kiln.engine.layers.embedding import ParallelLMHead
from kiln.engine.layers.linear import LinearBase
from kiln.engine.layers.quant import quantize_weight
from kiln.engine.models.llama import apply_mlp_rows, mlp_rows_at_load, sliced_mlps
from kiln.engine.tactics.resolve import packing, persist, resolve
from kiln.engine.tactics.table import TacticsError, TacticTable, both_copies, second_copy
from kiln.engine.tactics.timing import LinearSite, time_mlp_slices
from torch import nn

log = logging.getLogger("kiln.engine.tactics")

STACK_MARGIN = 1.10


def linear_modules(model: nn.Module, max_num_tokens: int, max_batch_size: int,
                   dtype: torch.dtype) -> list[tuple[nn.Module, LinearSite]]:
    """Every linear a CPU engine may pack (linears, int8 ones included, and the LM head) with its site, for
    ``dtype`` activations. A module with ``rows_per_call`` (the MLP when prefill steps run in slices) caps
    the rows of the linears inside it; the LM head sees at most ``max_batch_size`` rows (the step's sampled
    rows). fp8 linears keep torch's path (quant.py) and are not sites."""
    caps: dict[int, int] = {}
    for m in model.modules():
        cap = getattr(m, "rows_per_call", None)
        if cap:
            for child in m.modules():
                caps[id(child)] = min(cap, caps.get(id(child), cap))
    stacked = {id(child) for m in model.modules() if getattr(m, "stack_member", False) for child in m.modules()}
    out = []
    for m in model.modules():
        if not isinstance(m, (LinearBase, ParallelLMHead)) or m.weight.dim() != 2:
            continue
        fmt = formats.of_weight(m.weight, getattr(m, "weight_scale", None))
        if isinstance(m, LinearBase):
            rows = min(max_num_tokens, caps.get(id(m), max_num_tokens))
        else:  # the head: an int8 engine's may have a quantized copy to be packed (quantize_head)
            rows = max_batch_size
            copy = getattr(m, "weight_int8", None)
            fmt = formats.of_weight(copy, m.weight_scale) if copy is not None and fmt.key is None else fmt
        if not fmt.tactic_site:
            continue
        out.append((m, LinearSite(dtype if fmt.key else m.weight.dtype, m.weight.shape[0], fmt.in_features(m.weight),
                                  max(1, rows), stacked=id(m) in stacked, quant=fmt.key)))
    return out


def linear_sites(modules: list[tuple[nn.Module, LinearSite]]) -> list[LinearSite]:
    """One site per distinct shape, with the most rows any of its linears sees."""
    by_key: dict[str, LinearSite] = {}
    for _, site in modules:
        seen = by_key.get(site.key)
        if seen is None or site.max_rows > seen.max_rows:
            by_key[site.key] = site
    return list(by_key.values())


def stack_layout(table: TacticTable, modules: list[tuple[nn.Module, LinearSite]], native,
                 exclude=(), one_kernel: bool = False) -> tuple[bool, str]:
    """(pack the layers' linears in kiln's layout, why) by the table's ``decoder_stack`` entry or the margin (a
    shape holding a second copy beside kiln's panels, ``table.both_copies``, costs the faster side's time)."""
    layer_sites = {site.key: site for _, site in modules if site.stacked}
    if native is None or not layer_sites:
        return False, "no decoder stack: kiln's attention kernels do not run here"
    kiln_ok = all(candidates.why_not(candidates.stack_candidate(s.quant), s.dtype, native, s.quant, exclude) is None
                  for s in layer_sites.values())
    entry = (table.model.get("decoder_stack") or {}).get("winner")
    if entry is not None:
        return entry == "fused" and kiln_ok, f"the table's decoder_stack: {entry}"
    for key, site in layer_sites.items():
        choice = table.linear[key]
        scores = choice.scores
        both = both_copies(choice, second_copy(choice, site, native, exclude, one_kernel), STACK_MARGIN, True)
        if not kiln_ok or "kiln" not in scores or (scores["kiln"] > STACK_MARGIN * min(scores.values()) and not both):
            return False, f"{key}: kiln's layout is not within {STACK_MARGIN:g}x of the best"
    return True, (f"kiln's layout (or its panels beside a second copy) within {STACK_MARGIN:g}x of the best for "
                  "every layer shape")


def amx_queries(table: TacticTable, stack: bool, batch_invariant: bool) -> int:
    """From how many queries a prefill group's attention runs on AMX tiles (0: never): the table's timing, off
    the decoder stack never, and never with ``batch_invariant`` (a tile sums in another order than a decode's)."""
    if not stack or batch_invariant:
        return 0
    return int((table.model.get("attention_tiles") or {}).get("min_queries", 0))


def bind(model: nn.Module, modules: list[tuple[nn.Module, LinearSite]], table: TacticTable, native,
         batch_hint: int, stack: bool = True, exclude=(), one_kernel: bool = False) -> dict[str, int]:
    """Pack every module of ``model`` by its table entry; returns how many linears went to each layout.
    ``stack``: the decoder stack can run here (kiln's attention kernels serve the model); ``exclude``: the
    engine's ``tactics_exclude``; ``one_kernel``: one kernel per linear at every row count (``batch_invariant``)."""
    fuse, why = stack_layout(table, modules, native if stack else None, exclude, one_kernel)
    log.info("tactics: decoder layers %s (%s)", "in kiln's layout for the stack" if fuse else "per shape", why)
    counts: dict[str, int] = {}
    with host_pages.arena():  # the model's weights side by side in huge pages (host_pages.py says why)
        for m, site in modules:
            _bind_one(model, m, site, table, native, fuse, exclude, one_kernel, batch_hint, counts)
    return counts


def _bind_one(model: nn.Module, m: nn.Module, site: LinearSite, table: TacticTable, native, fuse: bool, exclude,
              one_kernel: bool, batch_hint: int, counts: dict[str, int]) -> None:
    """Pack one module by its table entry (``bind``), counted into ``counts`` by layout."""
    stacked = fuse and site.stacked  # kiln's layout; oneDNN (from Python) only where it beats the stack's saving
    layout, kernels = _packing(table.linear[site.key], site, native, stacked, exclude, one_kernel)
    key = layout + "".join(f"+{k}" for k in sorted(set(kernels or ())) if k in candidates.SECOND_COPY.values())
    counts[key] = counts.get(key, 0) + 1  # "kiln+qlinear": kiln's panels and a second copy (candidates.SECOND_COPY)
    if layout == "plain":
        return
    scale = getattr(m, "weight_scale", None) if site.quant else None
    weight = m.weight if getattr(m, "weight_int8", None) is None else m.weight_int8  # an int8 engine's head
    try:
        packed = candidates.pack(layout, weight, native, batch_hint, kernels, scale, site.dtype)
    except ValueError as exc:  # oneDNN packed this weight otherwise than the timed one of its shape
        if "onednn" not in (kernels or []):
            raise
        log.warning("tactics: %s (%s); its buckets run kiln's C kernels instead", exc, site.key)
        _, kernels = packing(table.linear[site.key], site, native, "kiln", float("inf"), exclude, one_kernel)
        packed = candidates.pack(layout, weight, native, batch_hint, kernels, scale, site.dtype)
    m.packed_weight = packed
    tied = isinstance(m, ParallelLMHead) and any(
        p is m.weight for other in model.modules() if other is not m for p in other.parameters(recurse=False))
    if not tied:  # a tied head's weight is the embedding's, which keeps it for lookups
        m.weight.data = torch.empty(0, dtype=m.weight.dtype, device=m.weight.device)
    if isinstance(m, ParallelLMHead):  # its int8 copy lives in the packing now (a head left plain keeps
        m.weight_int8 = m.weight_scale = None  # the copy for a later swap, its float weight running meanwhile)


def invariance(counts: dict[str, int]) -> str:
    """What ``/version`` says of ``batch_invariant`` for a model bound into ``counts`` (layout -> linears): whether
    every linear runs kiln's C kernels (one kernel at every row count), or how many could not (no kiln candidate
    timed for them here, e.g. bfloat16 on a host without AVX512-BF16) and so may still differ by batch."""
    total = sum(counts.values())
    other = {k: n for k, n in sorted(counts.items()) if k != "kiln"}
    if not other:
        return f"every linear ({total}) on one kiln kernel at every row count"
    runs = ", ".join(f"{n} {'ATen' if k == 'plain' else k}" for k, n in other.items())
    return (f"partial: {sum(other.values())} of {total} linear(s) have no kiln kernel timed here and run {runs}, "
            f"whose kernel may differ by rows (their answers may depend on the batch)")


def _packing(choice, site: LinearSite, native, stacked: bool, exclude, one_kernel: bool
             ) -> tuple[str, list[str] | None]:
    """``resolve.packing`` for a module; with ``one_kernel`` on kiln's C kernels where the table timed one for it:
    they sum each output row alike at every row count, while ATen and oneDNN (``onednn-panels`` too) pick their
    own kernel by shape (ATen's float32 576x576 row at 1 row differed from the same row among 37 by 3e-6)."""
    margin = float("inf") if one_kernel else STACK_MARGIN if stacked else None  # inf: never a Python candidate
    if one_kernel and not stacked and choice.layout != "kiln":
        try:
            return packing(choice, site, native, "kiln", margin, exclude, True)
        except TacticsError:
            log.warning("tactics: batch_invariant: %s has no kiln candidate timed; it runs %s, whose kernel may "
                        "differ by rows", site.key, choice.layout)
            margin = None
    return packing(choice, site, native, "kiln" if stacked else None, margin, exclude, one_kernel)


def quantize_head(model: nn.Module, dtype: torch.dtype, native, exclude=()) -> str:
    """An int8 engine's LM head gets an int8 copy (per vocabulary row, as its linears) where a W8A8
    candidate may run here: at batch 1 the head is a third of a small model's weight bytes (SmolLM2: 28 M
    of 134 M parameters), so keeping it in bf16 keeps a third of the step at bf16's speed. Only where W8A8
    may run, because that is what the build's quality gate measured with the head quantized (W8A8 forced),
    and where its verdict excluded W8A8 the head stays as it was built. The table then times the head's
    int8 candidates like any int8 linear. Returns what ``/version`` says about the head."""
    head = next((m for m in model.modules() if isinstance(m, ParallelLMHead)), None)
    if head is None or head.weight.dim() != 2 or head.weight.dtype not in (torch.float32, torch.bfloat16):
        return "as built"
    quant = {m.weight_format for m in model.modules() if isinstance(m, LinearBase)}
    fmt = next((f for f in quant if any(f.name in candidates.LINEAR[n].accepts for n in candidates.ACTIVATION_QUANT)),
               None)
    if fmt is None:
        return "as built"
    runs = [n for n in candidates.ACTIVATION_QUANT if candidates.why_not(n, dtype, native, fmt.key, exclude) is None]
    if not runs:
        return "as built: no W8A8 candidate may run here"
    head.weight_int8, head.weight_scale = quantize_weight(head.weight.detach(), fmt.quantization)
    return f"int8 (W8A8 may run here: {', '.join(runs)})"


def take_rank0s(table: TacticTable, join_timeout_s: float) -> TacticTable:
    """Every rank of a group runs the kernels rank 0 chose (issue 38: ranks timing their own could pick
    different kernels, whose last bits differ, and the MLP's slice sets how many all-reduces a step makes):
    rank 0 sends its table over the group's authenticated rank channel (``parallel.broadcast_json``, typed
    JSON checked by its digest as a table file is), and each other rank takes rank 0's entry for every
    linear shape both have (a stage's own shapes, such as the last stage's LM head, stay its own) and rank
    0's model-level choices, all of them and only them."""
    parallel.wait_for_ranks(join_timeout_s, "loading its weights and timing its tactics")
    doc = parallel.broadcast_json(table.to_json() if parallel.rank() == 0 else None)
    if parallel.rank() == 0:
        return table
    theirs = TacticTable.from_json(doc, "rank 0's tactic table", "restart the group")
    table.linear.update({key: choice for key, choice in theirs.linear.items() if key in table.linear})
    table.model = dict(theirs.model)  # rank 0's whole: a key only this rank has (mlp_rows) would split the group
    return table


def attention_shape(model: nn.Module, config) -> dict[str, Any] | None:
    """What ``resolve.measure_attention`` times for this model: its heads and KV cache."""
    attn = next((m for m in model.modules() if isinstance(m, Attention)), None)
    return None if attn is None else {"heads": attn.num_heads, "kv_heads": attn.num_kv_heads,
                                      "head_dim": attn.head_dim, "block_size": config.block_size,
                                      "dtype": config.kv_torch_dtype}


def apply(model: nn.Module, config, native, stack: bool = True
          ) -> tuple[TacticTable, dict[str, Any], list[LinearSite]]:
    """Resolve the table for this model and host (``resolve.resolve``) and pack the model by it; returns the
    table, what ``/version`` says of it, and the model's linear sites (what a build times)."""
    exclude = config.tactics_exclude or ()
    head = quantize_head(model, config.torch_dtype, native, exclude) if config.lm_head_int8 == "auto" else \
        "as built (lm_head_int8: off)"
    modules = linear_modules(model, config.max_num_tokens, config.max_batch_size, config.torch_dtype)
    sites = linear_sites(modules)
    table, info = resolve(config.tactics, sites, native, config.tactics_cache,
                          attention_shape(model, config) if stack else None, exclude, config.tactics_background)
    if native is not None:  # prefill groups on AMX tiles where the table timed that faster (a decode never)
        native.attention_amx_queries = amx_queries(table, stack, config.batch_invariant)
    mlps = sliced_mlps(model)
    # Not the build's (end to end): timed on one layer's MLP here, unless this is the artifact's table as built
    # on this kind of host: its build timed the slice where it had a choice, and where it recorded none the
    # default it ran stands (timing it at every load cost SmolLM2 GGUF 0.9 s of a 1.3 s cold load).
    if mlps and "mlp_rows" not in table.model and info.get("origin") != "artifact":
        tokens, choices = mlp_rows_at_load(config.max_num_tokens)
        if len(choices) > 1:
            us = {k: round(v * 1e6, 1) for k, v in time_mlp_slices(
                mlps[0], mlps[0].gate_up_proj.input_size, config.torch_dtype, tokens, choices).items()}
            table.model["mlp_rows"] = {"winner": int(min(us, key=us.get)), "us": us, "how": f"one MLP, {tokens} rows"}
            persist(table, info)  # with it, so that the next start on this host times nothing
    if parallel.world_size() > 1 and torch.distributed.is_initialized():  # none to agree with offline
        table = take_rank0s(table, config.join_timeout_s)
    apply_mlp_rows(mlps, table)  # the MLP's prefill slice timed fastest
    counts = bind(model, modules, table, native, config.max_batch_size, stack, exclude, config.batch_invariant)
    info["layouts"], info["lm_head"] = counts, head
    if config.batch_invariant:
        info["batch_invariant"] = invariance(counts)
    log.info("tactics (%s): %s", info["source"], ", ".join(f"{n} linear(s) {k}" for k, n in sorted(counts.items())))
    return table, info, sites
