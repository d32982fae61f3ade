"""The ``LLMEngine`` API: pydantic types for ``serving.kiln.dev/v1alpha1``.

These types are the single source of truth (the GPU table and the replica layout rule are in
``kiln/skus.py``, the status types in ``kiln/engine_status.py``, re-exported here): the CRD (``kiln crd``) is generated
from them, the build envelope (:mod:`kiln.envelope`) reads them, and the
operator validates what the API server hands it with them. YAML uses camelCase
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

import re
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kiln.api_base import APIModel as _Model
from kiln.engine_status import (
    HISTORY_LIMIT,
    Condition,
    HistoryEntry,
    LLMEngineStatus,
    Phase,
    ReplicaStatus,
    add_to_history,
)
from kiln.skus import (
    FP8_GPUS,
    GPU_SKUS,
    SHAPE_RULE,
    GPUName,
    GPUSpec,
    ReplicaShape,
    gpus_per_node,
    replica_shape,
    shape_problem,
)

GROUP = "serving.kiln.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "LLMEngine"
PLURAL = "llmengines"
SINGULAR = "llmengine"
SHORT_NAME = "llme"

__all__ = [
    "API_VERSION", "GROUP", "KIND", "PLURAL", "SHORT_NAME", "SINGULAR", "VERSION", "GPU_SKUS",
    "BuildOptions", "Condition", "GPUSpec", "HistoryEntry", "KVOptions", "LLMEngine", "LLMEngineSpec",
    "LLMEngineStatus", "Metadata", "ModelSource", "Phase", "QualityGate",
    "ReplicaShape", "ServingOptions", "gpus_per_node", "replica_shape", "shape_problem",
    "AutoscalingOptions", "ReplicaStatus", "RoutingOptions", "FP8_GPUS", "GPUName", "HISTORY_LIMIT",
    "SHAPE_RULE", "add_to_history",
]


Dtype = Literal["bfloat16", "float16", "float32"]
Quantization = Literal["none", "int8", "fp8"]
KVCacheDtype = Literal["auto", "bfloat16", "float16", "float32"]
TensorParallel = Literal[1, 2, 4, 8]
PipelineParallel = Literal[1, 2, 4, 8]
GPUsPerNode = Literal[1, 2, 4, 8, 16]
BlockSize = Literal[1, 2, 4, 8, 16, 32, 64, 128, 256]
DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# One pattern for the CRD; Python checks each scheme separately for a precise message.
SOURCE_PATTERN = (
    r"^(hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*"
    r"|s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?"
    r"|file://(/|\./|\.\./)[^\s]*"
    r"|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^\s]*)?)$"
)
# A GGUF file inside an hf:// repo: a relative path ending in .gguf (no '..' segment: ModelSource checks).
GGUF_FILE_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._/-]*\.[gG][gG][uU][fF]$"
_SOURCE_RULES = {
    "hf": (r"^hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$", "hf://org/name"),
    "s3": (r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?$", "s3://bucket/prefix"),
    "file": (r"^file://(/|\./|\.\./)[^\s]*$", "file:///absolute/path or file://./relative/path"),
    "pvc": (r"^pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^\s]*)?$", "pvc://claim-name/sub/path"),
}


class ModelSource(_Model):
    source: str = Field(
        max_length=1024, json_schema_extra={"pattern": SOURCE_PATTERN},
        description="Where the checkpoint lives: hf://org/name (Hugging Face hub), s3://bucket/prefix, "
        "file:///absolute/path or file://./relative/path (relative to the working directory), or "
        "pvc://claim-name/sub/path (a PersistentVolumeClaim in the engine's namespace). A checkpoint "
        "directory (config.json, tokenizer, *.safetensors) or, except for hf://, one .gguf file.",
    )
    revision: str | None = Field(
        default=None, max_length=255, pattern=r"^[A-Za-z0-9._/-]+$",
        description="hf://: branch, tag or commit sha (pin a 40-hex commit sha; unset means main). "
        "Other sources: a label you bump when the files change, since the engine version cannot see them; "
        "for a .gguf file, 64 hex digits are its sha256, checked when the build fetches it.",
    )
    file: str | None = Field(
        default=None, max_length=512, pattern=GGUF_FILE_PATTERN,
        description="hf:// only: the .gguf file in the repo to build from (e.g. model.Q4_K_M.gguf); unset means "
        "the repo's safetensors checkpoint.",
    )
    credentials_secret: str | None = Field(
        default=None, max_length=253, pattern=DNS1123_SUBDOMAIN,
        description="Secret in the engine's namespace with HF_TOKEN (hf://) or AWS_ACCESS_KEY_ID/"
        "AWS_SECRET_ACCESS_KEY (s3://) keys; only valid for hf:// and s3:// sources.",
    )

    @field_validator("source")
    @classmethod
    def _check_source(cls, value: str) -> str:
        scheme = value.split("://", 1)[0] if "://" in value else ""
        if scheme not in _SOURCE_RULES:
            raise ValueError(
                f"unsupported model source {value!r}; use hf://org/name, s3://bucket/prefix, "
                "file:///path or pvc://claim/path"
            )
        pattern, example = _SOURCE_RULES[scheme]
        if not re.match(pattern, value):
            raise ValueError(f"malformed {scheme}:// source {value!r}; expected {example}")
        return value

    @field_validator("file")
    @classmethod
    def _check_file(cls, value: str | None) -> str | None:
        if value is not None and ".." in value.split("/"):
            raise ValueError(f"{value!r} has a '..' segment; name the .gguf file by its path inside the repo")
        return value

    @property
    def scheme(self) -> str:
        return self.source.split("://", 1)[0]


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


# ---- Scale out (issue 14): autoscaling, routing, rollout strategy; see docs/scale-out.md ----------------------
# Serving fields only: none of them is in the build envelope (kiln.envelope), so no engine version changes.

RolloutStrategy = Literal["Surge", "RecreateOneAtATime"]
EndpointPickerFailureMode = Literal["FailOpen", "FailClose"]


class AutoscalingOptions(_Model):
    min_replicas: int = Field(
        default=1, ge=0, le=1000,
        description="Fewest serving pods. 0 scales to zero when idle: needs KEDA and its HTTP add-on, whose "
        "interceptor holds requests while a pod starts (docs/scale-out.md).",
    )
    max_replicas: int = Field(ge=1, le=1000, description="Most serving pods the autoscaler may run.")
    target_waiting_requests: int = Field(
        default=4, ge=1, le=100000,
        description="Requests waiting in the engine's queue (kiln:num_requests_waiting) per pod that the "
        "autoscaler aims for; more waiting adds pods.",
    )
    scale_down_stabilization_seconds: int = Field(
        default=300, ge=0, le=3600,
        description="How long load must stay low before pods are removed (the HPA's scaleDown stabilization "
        "window; with KEDA also the idle time before scaling to zero).",
    )


class RoutingOptions(_Model):
    inference_pool: bool = Field(
        default=False,
        description="Render a Gateway API Inference Extension InferencePool (inference.networking.k8s.io/v1) over "
        "this engine's pods, for an endpoint picker that scores queue depth, KV-cache use and prefix hits.",
    )
    endpoint_picker: str | None = Field(
        default=None, max_length=63, pattern=DNS1123_LABEL,
        description="Service of the endpoint picker (EPP) serving this pool; unset means <engine name>-epp.",
    )
    endpoint_picker_port: int = Field(
        default=9002, ge=1, le=65535, description="gRPC (ext-proc) port of the endpoint picker's Service.",
    )
    endpoint_picker_failure_mode: EndpointPickerFailureMode = Field(
        default="FailClose",
        description="What the gateway does when the endpoint picker does not answer: FailClose rejects the "
        "request, FailOpen forwards it to any pod of the pool.",
    )


# (python check name, CEL rule on spec, message, fieldPath), joined to CROSS_FIELD_RULES below.
SCALE_OUT_RULES: tuple[tuple[str, str, str, str], ...] = (
    ("autoscaling_bounds",
     "!has(self.serving.autoscaling) || self.serving.autoscaling.minReplicas <= self.serving.autoscaling.maxReplicas",
     "spec.serving.autoscaling.minReplicas must be at most maxReplicas; lower minReplicas or raise maxReplicas",
     ".serving.autoscaling.minReplicas"),
)


def _scale_out_problems(spec: LLMEngineSpec) -> list[str]:
    """The Python twins of SCALE_OUT_RULES."""
    scaling = spec.serving.autoscaling
    if scaling is not None and scaling.min_replicas > scaling.max_replicas:
        return [f"serving.autoscaling.minReplicas: must be at most maxReplicas ({scaling.min_replicas} > "
                f"{scaling.max_replicas}); lower minReplicas or raise maxReplicas"]
    return []

# ---- end of scale out types ---------------------------------------------------------------------------------


class ServingOptions(_Model):
    replicas: int = Field(
        default=1, ge=0, le=1000,
        description="Serving replicas: each is one pod, or one LeaderWorkerSet group of pods when the engine "
        "spans nodes (tensorParallel x pipelineParallel > gpusPerNode).",
    )
    port: int = Field(default=8000, ge=1024, le=65535, description="Container and Service port of the API.")
    resources: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra={"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        description="Kubernetes ResourceRequirements for the serving container (limits/requests); "
        "unset means the pod's GPUs (tensorParallel x pipelineParallel, at most gpusPerNode) as nvidia.com/gpu and "
        "the operator's CPU/memory defaults.",
    )
    api_key_secret: str | None = Field(
        default=None, max_length=253, pattern=DNS1123_SUBDOMAIN,
        description="Secret with key KILN_API_KEY; when set, requests need 'Authorization: Bearer <key>'.",
    )
    image: str | None = Field(default=None, max_length=512, description="Override of the serving image.")
    max_queue_len: int = Field(
        default=256, ge=1, le=100000,
        description="Requests waiting beyond this get HTTP 429 instead of queueing.",
    )
    drain_timeout_seconds: int = Field(
        default=30, ge=0, le=3600,
        description="On shutdown, how long in-flight requests may finish before being aborted.",
    )
    # -- scale out (docs/scale-out.md) --
    autoscaling: AutoscalingOptions | None = Field(
        default=None,
        description="Scale pods with the queue (KEDA ScaledObject, or an HPA where the chart says so); when set, "
        "the autoscaler owns the replica count and spec.serving.replicas is not used.",
    )
    routing: RoutingOptions = Field(
        default_factory=RoutingOptions, json_schema_extra={"default": {}},
        description="Routing across replicas (Gateway API Inference Extension).",
    )
    rollout_strategy: RolloutStrategy = Field(
        default="Surge",
        description="Surge: a new pod starts beside the old ones, which serve until it is Ready (needs one spare "
        "pod's GPUs). RecreateOneAtATime: an old pod stops before its replacement starts (no spare GPU needed; "
        "one pod less serves during each step, and a single replica means downtime).",
    )

    @field_validator("resources")
    @classmethod
    def _check_resources(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return value
        unknown = sorted(set(value) - {"limits", "requests", "claims"})
        if unknown:
            raise ValueError(f"unknown key(s) {', '.join(unknown)}; use limits, requests (and claims)")
        for key in ("limits", "requests"):
            if key in value and not isinstance(value[key], dict):
                raise ValueError(f"{key} must be a map of resource name to quantity, e.g. {{cpu: '4'}}")
        return value


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
    ("credentials_scheme",
     "!has(self.model.credentialsSecret) || self.model.source.startsWith('hf://') "
     "|| self.model.source.startsWith('s3://')",
     "spec.model.credentialsSecret is only used by hf:// and s3:// sources; remove it",
     ".model.credentialsSecret"),
    ("file_scheme", "!has(self.model.file) || self.model.source.startsWith('hf://')",
     "spec.model.file is only used by hf:// sources; name the .gguf file in spec.model.source instead",
     ".model.file"),
    SHAPE_RULE,
)

CROSS_FIELD_RULES += SCALE_OUT_RULES  # scale out (issue 14)


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
        default="none", description="Weight-only quantization with per-output-channel scales: none, int8, fp8."
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
        if self.model.credentials_secret is not None and self.model.scheme not in ("hf", "s3"):
            problems.append("model.credentialsSecret: only used by hf:// and s3:// sources; remove it")
        if self.model.file is not None and self.model.scheme != "hf":
            problems.append("model.file: only used by hf:// sources; name the .gguf file in model.source instead")
        if shape := shape_problem(self.gpu, self.tensor_parallel, self.pipeline_parallel, self.gpus_per_node):
            problems.append(shape)
        problems += _scale_out_problems(self)  # scale out (issue 14)
        if problems:
            raise ValueError("\n".join(problems))
        return self

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


class LLMEngine(_Model):
    api_version: Literal["serving.kiln.dev/v1alpha1"] = Field(default=API_VERSION, alias="apiVersion")
    kind: Literal["LLMEngine"] = Field(default=KIND)
    metadata: Metadata
    spec: LLMEngineSpec
    status: LLMEngineStatus | None = None


if set(get_args(GPUName)) != set(GPU_SKUS):  # pragma: no cover - a table edit missed the Literal
    raise RuntimeError("GPUName and GPU_SKUS disagree")
