"""Plan the KV pool for the target device.

A serving pod preallocates one pool of ``num_kv_blocks`` blocks. The builder sizes it once, for the
target:

    budget      = device memory x kv.memoryFraction
    num_kv_blocks = (budget - weights of the largest rank - activation reserve
                     - CUDA-graph reserve - LoRA slots) // bytes per block
    CUDA-graph reserve = measured graph memory x (1 + CUDA_GRAPH_MEMORY_MARGIN), 0 without graphs

where the LoRA slots are what the runtime allocates for ``spec.lora`` before it plans its pool
(``kiln.engine.lora.config.LoRAConfig.slot_bytes``, the one term both use), and a block holds ``blockSize`` tokens of K and V for every layer and the KV
heads of one rank. On a GPU the pool takes all of that (spare blocks keep
prefixes cached). The graphs' memory is what loading the artifact with the
chosen CUDA graphs takes on the build GPU beyond loading it eagerly (device
memory in use, ``mem_get_info``, right after each load; :func:`kiln.builder.stages.tune.tune`), so
the plan is made twice: in the ``plan`` stage without it (the build's own loads use a small
pool), and in the ``tune`` stage, with it, for serving (:func:`plan_with_cuda_graphs`). Where no
graphs run (CPU engines, or the tuner chose eager) the measurement is ``None`` and the reserve 0; a
pool that cannot hold one ``maxSeqLen`` request next to the graphs falls back to eager.
For ``gpu: cpu`` the device memory is a documented budget —
:data:`kiln.builder.sizing.CPU_MEMORY_BUDGET_GIB` GiB, or ``$KILN_CPU_MEMORY_GIB`` — and the pool is
capped at what ``maxBatchSize`` requests of ``maxSeqLen`` can ever hold, because
host RAM is shared with everything else on the machine.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from kiln.builder.errors import InvalidSpec
from kiln.builder.model_facts import ModelFacts
from kiln.builder.sizing import (
    activation_reserve_bytes,
    device_memory_bytes,
    kv_bytes_per_token,
    kv_dtype_name,
    layers_per_stage,
)
from kiln.engine.lora.config import LoRAConfig

log = logging.getLogger("kiln.build.tune")

# Graphs captured on a serving GPU of the same SKU may take a little more than on the build GPU
# (allocator segment rounding, driver versions): the plan keeps this fraction above the measurement.
CUDA_GRAPH_MEMORY_MARGIN = 0.2


def cuda_graph_reserve_bytes(cuda_graph_bytes: int | None) -> int:
    """What the plan sets aside for measured CUDA graphs (0 where none run)."""
    return 0 if cuda_graph_bytes is None else math.ceil(cuda_graph_bytes * (1 + CUDA_GRAPH_MEMORY_MARGIN))


def lora_slot_bytes(spec, facts: ModelFacts) -> int:
    """The largest rank's LoRA slots for ``spec.lora`` (0 without), by the runtime's own term."""
    lora = getattr(spec, "lora", None)
    if lora is None:
        return 0
    view = LoRAConfig(lora.max_loras, lora.max_lora_rank, lora.max_loras, getattr(torch, spec.dtype))
    return view.slot_bytes("cpu" if spec.gpu_spec.is_cpu else "cuda", facts.hidden_size, facts.intermediate_size,
                           facts.num_attention_heads, facts.num_key_value_heads, facts.head_dim,
                           layers_per_stage(facts, spec), spec.tensor_parallel)


def plan_kv(spec, facts: ModelFacts, weight_bytes_per_rank: int, cuda_graph_bytes: int | None = None,
            extra_kv_bytes_per_token: int = 0) -> dict[str, Any]:
    """The KV pool for the target; :class:`InvalidSpec` if not even one ``maxSeqLen`` request fits.

    ``cuda_graph_bytes``: the graphs' memory measured by :func:`kiln.builder.stages.tune.tune`; ``None``
    where no graphs run. ``extra_kv_bytes_per_token``: a draft model's K/V (its pool has as many blocks:
    :mod:`kiln.builder.draft_model`), whose weights the caller counts in ``weight_bytes_per_rank``.
    """
    total = device_memory_bytes(spec)
    budget = int(total * spec.kv.memory_fraction)
    activations = activation_reserve_bytes(facts, spec)
    graphs = cuda_graph_reserve_bytes(cuda_graph_bytes)
    slots = lora_slot_bytes(spec, facts)
    per_token = kv_bytes_per_token(facts, spec) + extra_kv_bytes_per_token
    block_bytes = per_token * spec.kv.block_size
    free = budget - weight_bytes_per_rank - activations - graphs - slots
    num_blocks = max(0, free // block_bytes)
    blocks_per_seq = math.ceil(spec.max_seq_len / spec.kv.block_size)
    useful = spec.max_batch_size * blocks_per_seq
    capped = False
    if spec.gpu_spec.is_cpu and num_blocks > useful:
        num_blocks, capped = useful, True
    if num_blocks < blocks_per_seq:
        raise InvalidSpec(
            f"spec.gpu: after {weight_bytes_per_rank / 2**30:.2f} GiB of weights per rank"
            + (f" and {graphs / 2**30:.2f} GiB for CUDA graphs" if graphs else "") + f" the KV pool on {spec.gpu} "
            f"has {num_blocks} blocks, fewer than one maxSeqLen ({spec.max_seq_len}) request needs "
            f"({blocks_per_seq}); lower maxSeqLen, raise kv.memoryFraction or use a larger GPU"
        )
    return {
        "device_memory_bytes": total,
        "memory_fraction": spec.kv.memory_fraction,
        "budget_bytes": budget,
        "weight_bytes_per_rank": weight_bytes_per_rank,
        "activation_reserve_bytes": activations,
        "cuda_graph_memory_bytes": cuda_graph_bytes,
        "cuda_graph_reserve_bytes": graphs,
        "lora_slot_bytes": slots,
        "kv_dtype": kv_dtype_name(spec),
        "kv_bytes_per_token": per_token,
        "block_size": spec.kv.block_size,
        "block_bytes": block_bytes,
        "num_kv_blocks": int(num_blocks),
        "kv_pool_bytes": int(num_blocks * block_bytes),
        "max_tokens_in_pool": int(num_blocks * spec.kv.block_size),
        "full_length_requests": int(num_blocks // blocks_per_seq),
        "capped_at_max_batch": capped,
    }


def kv_plan_summary(plan: dict[str, Any]) -> str:
    graphs = plan.get("cuda_graph_reserve_bytes")
    return (f"{plan['num_kv_blocks']} blocks x {plan['block_size']} tokens ({plan['kv_pool_bytes'] / 2**20:.1f} MiB "
            f"{plan['kv_dtype']}), {plan['full_length_requests']} full-length requests"
            + (f", {graphs / 2**20:.1f} MiB kept for CUDA graphs" if graphs else ""))


def plan_with_cuda_graphs(spec, facts: ModelFacts, weight_bytes_per_rank: int, tuning: dict[str, Any],
                          overrides: dict[str, Any], extra_kv_bytes_per_token: int = 0
                          ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The serving KV plan after :func:`kiln.builder.stages.tune.tune`: less the graphs' measured memory
    when graphs were chosen.

    Returns (plan, overrides). A pool too small for one ``maxSeqLen`` request next to the graphs
    drops the graphs (``enforce_eager``; ``tuning["cuda_graphs_dropped"]`` says why) rather than fail.
    """
    graph_bytes = tuning.get("cuda_graph_memory_bytes") if tuning.get("use_cuda_graphs") else None
    extra = extra_kv_bytes_per_token
    if graph_bytes is None:
        return plan_kv(spec, facts, weight_bytes_per_rank, extra_kv_bytes_per_token=extra), overrides
    try:
        return plan_kv(spec, facts, weight_bytes_per_rank, graph_bytes, extra), overrides
    except InvalidSpec as exc:
        log.warning("CUDA graphs dropped: %s", exc)
        tuning.update(use_cuda_graphs=False, cuda_graphs_dropped=str(exc))
        rest = {k: v for k, v in overrides.items() if k != "cuda_graph_batch_sizes"}
        return plan_kv(spec, facts, weight_bytes_per_rank, extra_kv_bytes_per_token=extra), {**rest, "enforce_eager": True}
