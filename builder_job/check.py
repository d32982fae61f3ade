"""Check that a spec's envelope can work for this checkpoint on this GPU, before converting.

Everything here reads only ``config.json`` and the safetensors headers (no torch),
so a spec that can never work fails in seconds with the field and the numbers:

- the architecture is one the runtime implements;
- ``tensorParallel`` divides the attention heads, the KV heads and the MLP width;
- ``pipelineParallel`` is at most the number of layers (every stage gets at least one; stage
  ``s`` runs ``L // P`` layers, the first ``L % P`` one more), and a rank's weights and KV
  cover only the layers of its stage (the largest stage is what must fit);
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

import json
import logging
import math
import os
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kiln.builder.errors import InvalidSpec
from kiln.engine.rope_config import SUPPORTED_ROPE_TYPES, max_positions, rope_parameters

log = logging.getLogger("kiln.build.check")

# Used only when the engine's own registry cannot be imported.
FALLBACK_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CPU_MEMORY_ENV = "KILN_CPU_MEMORY_GIB"
CPU_MEMORY_BUDGET_GIB = 8.0
# Headroom for activations, logits and allocator slack, per token of the step budget.
ACTIVATION_BYTES_PER_TOKEN_FACTOR = 24


def supported_architectures() -> tuple[str, ...]:
    """The runtime's registry; the fallback only matters for a runtime without one."""
    try:
        from kiln.engine.models.registry import MODEL_REGISTRY
    except ImportError:
        return FALLBACK_ARCHITECTURES
    return tuple(sorted(MODEL_REGISTRY))


def read_safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """Tensor name -> {"dtype", "shape"} from a safetensors file, without loading it."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def is_quantizable(name: str, shape: list[int]) -> bool:
    """Linear projection weights inside decoder layers; embeddings, lm_head and norms stay in dtype."""
    return len(shape) == 2 and ".layers." in name and name.endswith(".weight")


@dataclass
class ModelFacts:
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    max_positions: int  # with rope scaling
    rope_type: str
    num_params: int
    num_quantizable_params: int
    num_quantizable_rows: int  # output channels of quantizable linears (one scale each)

    def to_dict(self) -> dict:
        return asdict(self)


def model_facts(checkpoint_dir: Path) -> ModelFacts:
    config = json.loads((checkpoint_dir / "config.json").read_text())
    archs = config.get("architectures") or [config.get("model_type", "?")]
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    rope_type = rope_parameters(config)["rope_type"]
    mpe = int(config.get("max_position_embeddings", 2048))
    num_params = num_q = num_rows = 0
    for f in sorted(checkpoint_dir.glob("*.safetensors")):
        for name, t in read_safetensors_header(f).items():
            numel = 1
            for d in t["shape"]:
                numel *= d
            num_params += numel
            if is_quantizable(name, t["shape"]):
                num_q += numel
                num_rows += t["shape"][0]
    return ModelFacts(
        architecture=archs[0], num_layers=int(config["num_hidden_layers"]), hidden_size=hidden,
        intermediate_size=int(config.get("intermediate_size", 4 * hidden)), num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads), vocab_size=int(config["vocab_size"]),
        max_position_embeddings=mpe, max_positions=max_positions(config), rope_type=rope_type, num_params=num_params,
        num_quantizable_params=num_q, num_quantizable_rows=num_rows,
    )


def pipeline_parallel(spec) -> int:
    return int(getattr(spec, "pipeline_parallel", None) or 1)


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


def cpu_dtype_check(dtype: str) -> dict[str, Any]:
    """Does this build host multiply ``dtype`` natively? Warns when it does not (see the module doc)."""
    from kiln.engine.cpu_target import cpu_flags, probe

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
