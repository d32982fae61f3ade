"""The ``LLMEngine`` API: pydantic types for ``serving.kiln.dev/v1alpha1``.

These types are the single source of truth: the CRD (``kiln crd``) is generated from them, the
build envelope (:mod:`kiln.envelope`) reads them, and the operator validates what the API server
hands it with them. The spec's parts have modules of their own: ``spec.model`` in
:mod:`kiln.model_source`, ``spec.serving`` in :mod:`kiln.serving_options`, ``spec.speculative`` in
:mod:`kiln.speculative_options`, the GPU table and the
replica layout rule in :mod:`kiln.skus`, ``status`` in :mod:`kiln.engine_status`. YAML uses camelCase
(``maxSeqLen``); Python uses snake_case (``spec.max_seq_len``); both are accepted.

Cross-field rules live in :data:`CROSS_FIELD_RULES` twice over: as a Python check
(``LLMEngineSpec._check_cross_field``) and as the CEL expression the CRD carries,
so ``kubectl apply`` and ``kiln plan`` reject the same specs. Decisions:

- ``maxInputLen < maxSeqLen``: a prompt must leave room for at least one new token.
- ``maxNumTokens >= maxBatchSize``: every running sequence must be able to decode in
  one step. ``maxNumTokens >= maxInputLen`` is *not* required: prefill is chunked,
  so a long prompt is split over several steps.
- ``quantization: fp8`` needs FP8 tensor cores (compute capability >= 8.9: L4, L40S,
  H100, H200). On A100 it would only be dequantized, slower than ``int8``, so it is
  rejected. ``cpu`` is allowed: it is the reference path (weights stored as fp8 and
  dequantized to ``dtype`` per matmul) that tests and the demo run.
- ``quantization: gguf`` keeps a GGUF file's own blocks, so the source must be a ``.gguf`` file
  (``model.source`` or, for hf://, ``model.file``).
- ``model.credentialsSecret`` only means something for ``hf://`` and ``s3://``.
- ``model.file`` (a GGUF file inside the repo) only means something for ``hf://``; the
  other sources name a ``.gguf`` file in ``model.source`` itself.
- ``tensorParallel > 1`` on ``cpu`` is allowed (torch.distributed over gloo).
- ``pipelineParallel`` splits the layers into stages; one replica is ``tensorParallel x
  pipelineParallel`` ranks, packed onto pods of ``gpusPerNode`` GPUs (default: the SKU's
  ``gpus_per_node`` in :data:`GPU_SKUS`, ``kiln/skus.py``). :func:`replica_shape` is the one rule: a replica
  that fits one node is one pod; a larger one is ``ranks / gpusPerNode`` pods, which needs
  ``tensorParallel <= gpusPerNode`` so that no tensor-parallel group (one stage) is split
  across nodes. :data:`SHAPE_RULE` is its CEL twin, generated from the same table.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from kiln.api_base import DNS1123_LABEL, label_problems
from kiln.api_base import APIModel as _Model
from kiln.engine_status import LLMEngineStatus
from kiln.lora_options import LORA_ROOT_RULES, LORA_RULES, LoraOptions, lora_problems, served_name_problems
from kiln.model_source import ModelSource, scheme_problems
from kiln.serving_options import SCALE_OUT_RULES, ServingOptions, scale_out_problems
from kiln.skus import (
    FP8_GPUS,
    GPU_SKUS,
    SHAPE_RULE,
    GPUName,
    GPUSpec,
    ReplicaShape,
    replica_shape,
    shape_problem,
)
from kiln.speculative_options import SPECULATIVE_RULES, SpeculativeOptions, speculative_problems

GROUP = "serving.kiln.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "LLMEngine"
PLURAL = "llmengines"
SINGULAR = "llmengine"
SHORT_NAME = "llme"

__all__ = [
    "API_VERSION", "GROUP", "KIND", "PLURAL", "SHORT_NAME", "SINGULAR", "VERSION", "CROSS_FIELD_RULES",
    "BuildOptions", "KVOptions", "LLMEngine", "LLMEngineSpec", "Metadata", "QualityGate",
]


Dtype = Literal["bfloat16", "float16", "float32"]
Quantization = Literal["none", "int8", "fp8", "gguf"]
KVCacheDtype = Literal["auto", "bfloat16", "float16", "float32"]
TensorParallel = Literal[1, 2, 4, 8]
PipelineParallel = Literal[1, 2, 4, 8]
GPUsPerNode = Literal[1, 2, 4, 8, 16]
BlockSize = Literal[1, 2, 4, 8, 16, 32, 64, 128, 256]


class KVOptions(_Model):
    block_size: BlockSize = Field(
        default=16, description="Tokens per KV-cache block: a power of two from 1 to 256."
    )
    enable_prefix_caching: bool = Field(
        default=True, description="Reuse KV blocks of shared prompt prefixes across requests."
    )
    memory_fraction: float = Field(
        default=0.9, ge=0.1, le=0.98,
        description="Fraction of accelerator memory the engine may use for weights, activations and the "
        "KV pool together; the builder sizes the KV pool to what is left (vLLM's gpu_memory_utilization).",
    )


class QualityGate(_Model):
    max_kl_divergence: float = Field(
        default=0.05, ge=0.0, alias="maxKLDivergence",
        description="Largest mean per-token KL divergence of the built engine from the unquantized "
        "checkpoint on the calibration prompts; a build above it fails and publishes nothing.",
    )
    min_token_agreement: float = Field(
        default=0.9, ge=0.0, le=1.0,
        description="Smallest fraction of greedy next tokens that must match the unquantized checkpoint.",
    )


class BuildOptions(_Model):
    image: str | None = Field(default=None, max_length=512, description="Override of the builder image.")
    timeout_seconds: int = Field(
        default=3600, ge=60, le=86400, description="Build Job deadline (activeDeadlineSeconds)."
    )
    quality_gate: QualityGate = Field(
        default_factory=QualityGate, json_schema_extra={"default": {}},
        description="Thresholds a quantized build must meet against the unquantized checkpoint.",
    )
    calibration_prompts: list[str] | None = Field(
        default=None, max_length=256,
        description="Prompts for the quality gate; unset means kiln's built-in set.",
    )


# (python check name, CEL rule on spec, message, fieldPath). Python twins are in _check_cross_field.
CROSS_FIELD_RULES: tuple[tuple[str, str, str, str], ...] = (
    ("input_lt_seq", "self.maxInputLen < self.maxSeqLen",
     "spec.maxInputLen must be less than spec.maxSeqLen; lower maxInputLen or raise maxSeqLen",
     ".maxInputLen"),
    ("tokens_ge_batch", "self.maxNumTokens >= self.maxBatchSize",
     "spec.maxNumTokens must be at least spec.maxBatchSize; raise maxNumTokens or lower maxBatchSize",
     ".maxNumTokens"),
    ("fp8_gpu", "self.quantization != 'fp8' || self.gpu in [" + ", ".join(f"'{g}'" for g in FP8_GPUS) + "]",
     f"spec.quantization fp8 needs spec.gpu with FP8 support ({', '.join(FP8_GPUS)}); use int8 on A100",
     ".quantization"),
    ("gguf_source", "self.quantization != 'gguf' || self.model.source.endsWith('.gguf') "
     "|| (has(self.model.file) && self.model.file.endsWith('.gguf'))",
     "spec.quantization gguf keeps a GGUF file's own blocks: spec.model.source (or model.file) must name a .gguf "
     "file; use none, int8 or fp8 for other checkpoints",
     ".quantization"),
    ("credentials_scheme",
     "!has(self.model.credentialsSecret) || self.model.source.startsWith('hf://') "
     "|| self.model.source.startsWith('s3://')",
     "spec.model.credentialsSecret is only used by hf:// and s3:// sources; remove it",
     ".model.credentialsSecret"),
    ("file_scheme", "!has(self.model.file) || self.model.source.startsWith('hf://')",
     "spec.model.file is only used by hf:// sources; name the .gguf file in spec.model.source instead",
     ".model.file"),
    SHAPE_RULE,
    *SCALE_OUT_RULES,
    *SPECULATIVE_RULES,
    *LORA_RULES,
)
# Rules on the whole object (self is the LLMEngine: they may read metadata.name); twins in LLMEngine._check_root.
ROOT_RULES: tuple[tuple[str, str, str, str], ...] = LORA_ROOT_RULES


class LLMEngineSpec(_Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": rule, "message": message, "fieldPath": path, "reason": "FieldValueInvalid"}
        for _, rule, message, path in CROSS_FIELD_RULES
    ]})

    model: ModelSource = Field(description="The checkpoint to build from.")
    gpu: GPUName = Field(
        description="Target accelerator SKU (cpu, L4, L40S, A100-40GB, A100-80GB, H100-80GB, H200-141GB); "
        "the artifact is compiled for its architecture and memory size."
    )
    dtype: Dtype = Field(default="bfloat16", description="Compute and (unquantized) weight dtype.")
    quantization: Quantization = Field(
        default="none", description="Weight-only quantization: none; int8, fp8 (per-output-channel scales); gguf "
        "(a .gguf source's own Q8_0/Q4_0/Q4_1 blocks, kept as they are)."
    )
    kv_cache_dtype: KVCacheDtype = Field(
        default="auto", alias="kvCacheDtype", description="KV-cache dtype; auto means the same as dtype."
    )
    tensor_parallel: TensorParallel = Field(
        default=1, description="GPUs (or CPU processes) each pipeline stage is sharded over: 1, 2, 4 or 8; "
        "a stage never spans nodes, so at most gpusPerNode."
    )
    pipeline_parallel: PipelineParallel = Field(
        default=1, description="Pipeline stages the layers are split into: 1, 2, 4 or 8. One replica is "
        "tensorParallel x pipelineParallel GPUs; more than gpusPerNode makes it a LeaderWorkerSet group of "
        "tensorParallel x pipelineParallel / gpusPerNode pods.",
    )
    gpus_per_node: GPUsPerNode | None = Field(
        default=None,
        description="GPUs on one node of spec.gpu: 1, 2, 4, 8 or 16; unset means the SKU's (8; cpu: the "
        "whole replica in one pod). Only decides how ranks are packed into pods, not the engine version.",
    )
    max_batch_size: int = Field(default=64, ge=1, le=4096, description="Most sequences running at once.")
    max_input_len: int = Field(
        default=2048, ge=1, le=1048576, description="Longest prompt in tokens; must be < maxSeqLen."
    )
    max_seq_len: int = Field(
        default=4096, ge=2, le=1048576, description="Longest prompt + completion in tokens."
    )
    max_num_tokens: int = Field(
        default=8192, ge=1, le=1048576,
        description="Tokens per forward step (the chunked-prefill budget); must be >= maxBatchSize.",
    )
    kv: KVOptions = Field(
        default_factory=KVOptions, json_schema_extra={"default": {}}, description="Paged KV-cache options."
    )
    speculative: SpeculativeOptions | None = Field(
        default=None,
        description="Speculative decoding (docs/speculative.md); unset or method off means none. With ngram the "
        "build measures where it pays and records a per-batch-size table in the artifact.",
    )
    lora: LoraOptions | None = Field(
        default=None,
        description="LoRA adapters served beside the base model, mixed in one batch (docs/lora.md). The slot "
        "limits are in the engine version; the adapter list is not (adapters load without a rebuild or restart).",
    )
    serving: ServingOptions = Field(
        default_factory=ServingOptions, json_schema_extra={"default": {}},
        description="How the engine is served; none of it changes the engine version.",
    )
    build: BuildOptions = Field(
        default_factory=BuildOptions, json_schema_extra={"default": {}},
        description="How the engine is built; none of it changes the engine version.",
    )

    @model_validator(mode="after")
    def _check_cross_field(self) -> LLMEngineSpec:
        problems = []
        if self.max_input_len >= self.max_seq_len:
            problems.append(f"maxInputLen: must be less than maxSeqLen ({self.max_input_len} >= "
                            f"{self.max_seq_len}); lower maxInputLen or raise maxSeqLen")
        if self.max_num_tokens < self.max_batch_size:
            problems.append(f"maxNumTokens: must be at least maxBatchSize ({self.max_num_tokens} < "
                            f"{self.max_batch_size}); raise maxNumTokens or lower maxBatchSize")
        if self.quantization == "fp8" and self.gpu not in FP8_GPUS:
            problems.append(f"quantization: fp8 needs a GPU with FP8 support ({', '.join(FP8_GPUS)}), "
                            f"not {self.gpu}; use int8 on {self.gpu}")
        if self.quantization == "gguf" and not (self.model.source.endswith(".gguf")
                                                 or (self.model.file or "").endswith(".gguf")):
            problems.append("quantization: gguf keeps a GGUF file's own blocks: spec.model.source (or model.file) "
                            "must name a .gguf file; use none, int8 or fp8 for other checkpoints")
        problems += scheme_problems(self.model, "model")
        if shape := shape_problem(self.gpu, self.tensor_parallel, self.pipeline_parallel, self.gpus_per_node):
            problems.append(shape)
        problems += scale_out_problems(self.serving, self.gpu)
        problems += speculative_problems(self.speculative, self.max_num_tokens, self.model.credentials_secret)
        problems += lora_problems(self.lora, self.gpu)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @property
    def sources(self) -> dict[str, ModelSource]:
        """Every checkpoint the build fetches, by field path: ``model`` and a speculative draft model's."""
        draft = self.speculative.draft_model if self.speculative is not None else None
        return {"model": self.model, **({"speculative.draftModel": draft} if draft is not None else {})}

    @property
    def gpu_spec(self) -> GPUSpec:
        return GPU_SKUS[self.gpu]

    @property
    def replica_shape(self) -> ReplicaShape:
        """How one replica is laid out on pods (validated: never raises on a parsed spec)."""
        return replica_shape(self.gpu, self.tensor_parallel, self.pipeline_parallel, self.gpus_per_node)

    @property
    def resolved_kv_cache_dtype(self) -> str:
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype


class Metadata(BaseModel):
    """The part of ObjectMeta kiln reads; everything else the API server adds is kept as-is."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(max_length=63, pattern=DNS1123_LABEL, description="Engine name (DNS-1123 label).")
    namespace: str | None = Field(default=None, max_length=63, pattern=DNS1123_LABEL)
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None

    @field_validator("labels", "annotations")
    @classmethod
    def _check_keys(cls, value: dict[str, str] | None, info: ValidationInfo) -> dict[str, str] | None:
        """What the API server checks of every object's labels and annotations (a GitOps file's own, often)."""
        if problems := label_problems(value, values=info.field_name == "labels"):
            raise ValueError("; ".join(problems))
        return value


class LLMEngine(_Model):
    # Required, as the API server has them: a manifest without them is not one kubectl applies.
    api_version: Literal["serving.kiln.dev/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["LLMEngine"]
    metadata: Metadata
    spec: LLMEngineSpec
    status: LLMEngineStatus | None = None

    @model_validator(mode="after")
    def _check_root(self) -> LLMEngine:
        if problems := served_name_problems(self.spec.lora, self.metadata.name):
            raise ValueError("\n".join(problems))
        return self


if set(get_args(GPUName)) != set(GPU_SKUS):  # pragma: no cover - a table edit missed the Literal
    raise RuntimeError("GPUName and GPU_SKUS disagree")
