"""The bytes an envelope needs on one device: weights per rank, K/V per token, activations, the device.

Shared by the ``check`` stage's estimate (does the envelope fit at all?) and the KV plan
(:mod:`kiln.builder.kv_plan`, how many blocks the pool gets). A rank holds its tensor-parallel share
of the quantizable linears of its (largest) pipeline stage; everything else (embeddings, lm_head,
norms) is counted whole on every rank, which over-estimates. For ``gpu: cpu`` the device memory is a
documented budget: ``$KILN_CPU_MEMORY_GIB``, default :data:`CPU_MEMORY_BUDGET_GIB` GiB.
"""

from __future__ import annotations

import math
import os

from kiln.builder.model_facts import ModelFacts

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CPU_MEMORY_ENV = "KILN_CPU_MEMORY_GIB"
CPU_MEMORY_BUDGET_GIB = 8.0
# Headroom for activations, logits and allocator slack, per token of the step budget.
ACTIVATION_BYTES_PER_TOKEN_FACTOR = 24


def parallel_degree(value) -> int:
    """A parallelism degree as the runtime takes it: unset (None, 0) is 1."""
    return int(value or 1)


def pipeline_parallel(spec) -> int:
    """The spec's pipeline-parallel degree (1 where the spec does not carry ``pipeline_parallel``)."""
    return parallel_degree(getattr(spec, "pipeline_parallel", None))


def layers_per_stage(facts: ModelFacts, spec) -> int:
    """Layers of the largest pipeline stage (the runtime's split: the first ``L % P`` stages get one more)."""
    return math.ceil(facts.num_layers / pipeline_parallel(spec))


def kv_dtype_name(spec) -> str:
    return spec.dtype if spec.kv_cache_dtype in (None, "auto") else spec.kv_cache_dtype


def kv_bytes_per_token(facts: ModelFacts, spec) -> int:
    """K and V for every layer of the rank's (largest) stage, for the KV heads one rank holds."""
    kv_heads_per_rank = facts.num_key_value_heads // spec.tensor_parallel
    return 2 * layers_per_stage(facts, spec) * kv_heads_per_rank * facts.head_dim * DTYPE_BYTES[kv_dtype_name(spec)]


def weight_bytes_per_rank(facts: ModelFacts, spec) -> int:
    """Estimated bytes of one rank's weights: quantizable linears split across TP ranks and, by layer,
    across pipeline stages (the largest stage's share; 1 byte per weight + a float32 scale per output
    channel when quantized), the rest (embeddings, lm_head, norms) counted whole on every rank, which
    over-estimates."""
    tp = spec.tensor_parallel
    dtype_bytes = DTYPE_BYTES[spec.dtype]
    rest = (facts.num_params - facts.num_quantizable_params) * dtype_bytes
    if spec.quantization in ("int8", "fp8"):
        linear = facts.num_quantizable_params + 4 * facts.num_quantizable_rows
    else:
        linear = facts.num_quantizable_params * dtype_bytes
    stage_share = layers_per_stage(facts, spec) / max(1, facts.num_layers)
    return int(linear * stage_share) // tp + rest


def device_memory_bytes(spec) -> int:
    """Memory of one device of the spec's GPU SKU. For ``gpu: cpu`` (no fixed size) a documented
    budget: ``$KILN_CPU_MEMORY_GIB``, default :data:`CPU_MEMORY_BUDGET_GIB` GiB."""
    gib = spec.gpu_spec.memory_gib
    if gib is None:
        gib = float(os.environ.get(CPU_MEMORY_ENV) or CPU_MEMORY_BUDGET_GIB)
    return int(float(gib) * 2**30)


def activation_reserve_bytes(facts: ModelFacts, spec) -> int:
    """Room for one step's activations and logits (float32), outside the KV pool."""
    per_token = ACTIVATION_BYTES_PER_TOKEN_FACTOR * max(facts.hidden_size, facts.intermediate_size // spec.tensor_parallel)
    return spec.max_num_tokens * per_token + spec.max_batch_size * facts.vocab_size * 4


def typical_request_len(spec) -> int:
    return max(spec.kv.block_size, spec.max_seq_len // 4)
