"""The build's ``check`` stage: that a spec's envelope can work for this checkpoint on this GPU, before
converting.

Everything here reads only ``config.json`` and the safetensors headers (:mod:`kiln.builder.model_facts`;
the sizes: :mod:`kiln.builder.sizing`; no torch),
so a spec that can never work fails in seconds with the field and the numbers:

- the architecture is one the runtime implements;
- ``tensorParallel`` divides the attention heads, the KV heads and the MLP width;
- ``pipelineParallel`` is at most the number of layers (every stage gets at least one; stage
  ``s`` runs ``L // P`` layers, the first ``L % P`` one more), and a rank's weights and KV
  cover only the layers of its stage (the largest stage is what must fit);
- ``quantization: gguf``: the source is a GGUF whose decoder linears are all Q8_0 / Q4_0 / Q4_1
  (:func:`kiln.builder.gguf_artifact.refuse_unrunnable` names the first tensor that is not);
- ``maxSeqLen`` is within the model's positions (times the rope scaling factor for
  rope types that extend the context, ``kiln.engine.rope_config``; llama3-type
  configs already state the extended ``max_position_embeddings``);
- the GPU SKU's memory (× ``kv.memoryFraction``) holds the weights of one rank plus
  a KV pool for ``maxBatchSize`` requests of a typical length (a quarter of
  ``maxSeqLen``, at least one block) and one request of ``maxSeqLen``.

For ``gpu: cpu`` with ``dtype`` bfloat16/float16 it also measures whether this build host
multiplies that dtype natively (:func:`kiln.engine.cpu_target.probe`, a small timed
matmul against float32; the only part that touches torch) and records it with the CPU's
flags as ``cpu_dtype`` in the estimate. A host without it still builds the engine, but
warns: such a host (this one included, for the gate and the tuning) computes it in float32.
"""

from __future__ import annotations

import logging
from typing import Any

from kiln.builder.context import BuildContext
from kiln.builder.errors import InvalidSpec
from kiln.builder.gguf_artifact import refuse_unrunnable
from kiln.builder.model_facts import ModelFacts, model_facts, supported_architectures
from kiln.builder.sizing import (
    activation_reserve_bytes,
    device_memory_bytes,
    kv_bytes_per_token,
    pipeline_parallel,
    typical_request_len,
    weight_bytes_per_rank,
)
from kiln.engine.cpu_target import cpu_flags, probe
from kiln.engine.rope_config import SUPPORTED_ROPE_TYPES

log = logging.getLogger("kiln.build.check")


def run(ctx: BuildContext) -> None:
    """The target's facts and memory estimate into the report; InvalidSpec for an envelope that can't work."""
    ctx.facts = model_facts(ctx.checkpoint.path)
    ctx.report.record("model", ctx.facts.to_dict())
    if ctx.spec.quantization == "gguf":  # every decoder linear in a type kiln runs, or the tensor named
        ctx.report.record("gguf_blocks", refuse_unrunnable(ctx.checkpoint.path, bool(ctx.checkpoint.gguf)))
    ctx.report.record("memory_estimate", check_envelope(ctx.spec, ctx.facts))


def cpu_dtype_check(dtype: str) -> dict[str, Any]:
    """Does this build host multiply ``dtype`` natively? Warns when it does not (see the module doc)."""
    result = {**probe(dtype), "flags": sorted(f for f in cpu_flags() if "avx" in f or "amx" in f or f == "fma")}
    if not result["native"]:
        measured = (f"{result['gflops']} vs {result['float32_gflops']} GFLOP/s float32, one thread"
                    if result["how"] == "measured" else result["how"])
        log.warning("spec.dtype: this build host has no native %s matmul (%s; CPU flags: %s): CPU hosts like it "
                    "run this engine in float32 (weights upcast at load); on CPU fleets without AVX512-BF16/AMX "
                    "prefer dtype: float32", dtype, measured, " ".join(result["flags"]) or "none")
    return result


def check_envelope(spec, facts: ModelFacts) -> dict[str, Any]:
    """Raise :class:`InvalidSpec` naming the field and numbers; return the memory estimate."""
    archs = supported_architectures()
    if facts.architecture not in archs:
        raise InvalidSpec(f"spec.model.source: architecture {facts.architecture} is not supported by the kiln "
                          f"runtime (supported: {', '.join(archs)})")
    if facts.rope_type not in SUPPORTED_ROPE_TYPES:
        raise InvalidSpec(f"spec.model.source: rope type {facts.rope_type!r} is not supported by the kiln runtime "
                          f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)}); choose a checkpoint without it")
    tp = spec.tensor_parallel
    for name, value in (("num_attention_heads", facts.num_attention_heads),
                        ("num_key_value_heads", facts.num_key_value_heads),
                        ("intermediate_size", facts.intermediate_size)):
        if value % tp:
            raise InvalidSpec(f"spec.tensorParallel: {tp} does not divide the model's {name} ({value}); "
                              f"choose a tensorParallel that divides {value}")
    pp = pipeline_parallel(spec)
    if pp > facts.num_layers:
        raise InvalidSpec(f"spec.pipelineParallel: {pp} stages exceed the model's {facts.num_layers} layers "
                          f"(num_hidden_layers); set pipelineParallel <= {facts.num_layers}")
    if spec.max_seq_len > facts.max_positions:
        how = (f"max_position_embeddings {facts.max_position_embeddings} with {facts.rope_type} rope scaling"
               if facts.max_positions != facts.max_position_embeddings
               else f"max_position_embeddings {facts.max_position_embeddings}, rope type {facts.rope_type}")
        raise InvalidSpec(f"spec.maxSeqLen: {spec.max_seq_len} exceeds the model's {facts.max_positions} positions "
                          f"({how}); set maxSeqLen <= {facts.max_positions}")
    total = device_memory_bytes(spec)
    budget = int(total * spec.kv.memory_fraction)
    weights = weight_bytes_per_rank(facts, spec)
    activations = activation_reserve_bytes(facts, spec)
    per_token = kv_bytes_per_token(facts, spec)
    needed_tokens = max(spec.max_batch_size * typical_request_len(spec), spec.max_seq_len)
    kv_needed = needed_tokens * per_token
    estimate = {
        "device_memory_bytes": total, "budget_bytes": budget, "weight_bytes_per_rank": weights,
        "activation_reserve_bytes": activations, "kv_bytes_per_token": per_token,
        "kv_tokens_needed": needed_tokens, "kv_bytes_needed": kv_needed,
    }
    if spec.gpu_spec.is_cpu:
        estimate["cpu_dtype"] = cpu_dtype_check(spec.dtype)
    if weights + activations + kv_needed > budget:
        gib = 2**30
        raise InvalidSpec(
            f"spec.gpu: {spec.gpu} ({total / gib:.1f} GiB x kv.memoryFraction {spec.kv.memory_fraction} = "
            f"{budget / gib:.2f} GiB) cannot hold this model's weights per rank ({weights / gib:.2f} GiB, "
            f"{spec.dtype}, quantization {spec.quantization}, tensorParallel {tp}, pipelineParallel {pp}) + activations "
            f"({activations / gib:.2f} GiB) + KV for maxBatchSize {spec.max_batch_size} requests of "
            f"{typical_request_len(spec)} tokens ({kv_needed / gib:.2f} GiB); use a larger GPU, more "
            "tensorParallel or pipelineParallel, quantization, or a smaller maxBatchSize/maxSeqLen"
        )
    return estimate
