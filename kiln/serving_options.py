"""``spec.serving``: how a built engine is served (replicas, port, queue, autoscaling, routing, rollout).

Serving fields only: none of them is in the build envelope (:mod:`kiln.envelope`), so changing
them never changes the engine version. Autoscaling, routing and the rollout strategy are
described in docs/scale-out.md, batchInvariant in docs/tactics.md. :data:`SCALE_OUT_RULES` are
the cross-field rules of this part of the spec (CEL, joined into ``kiln.api.CROSS_FIELD_RULES``);
:func:`scale_out_problems` is their Python twin.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator

from kiln.api_base import DNS1035_LABEL, DNS1123_SUBDOMAIN, MAX_POOL_NAME, ServiceName
from kiln.api_base import APIModel as _Model
from kiln.chat_options import MAX_TEMPLATE_KWARGS, ReasoningParserName, template_kwargs_problem

BATCH_INVARIANT_FLAG = "--batch-invariant"  # kiln serve's, for spec.serving.batchInvariant (and a pool's)
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
    endpoint_picker: ServiceName | None = Field(
        default=None,
        description="Service of the endpoint picker (EPP) serving this pool (a DNS-1035 label, as a Service's name "
                    "is); unset means <engine Service name>-epp (hashed under 63 characters).",
    )
    endpoint_picker_port: int = Field(
        default=9002, ge=1, le=65535, description="gRPC (ext-proc) port of the endpoint picker's Service.",
    )
    endpoint_picker_failure_mode: EndpointPickerFailureMode = Field(
        default="FailClose",
        description="What the gateway does when the endpoint picker does not answer: FailClose rejects the "
        "request, FailOpen forwards it to any pod of the pool.",
    )


class ChatServingOptions(_Model):
    """The chat settings of a server, which every engine it serves takes: an engine's own (spec.serving) or its
    pool's (spec). Both are ``kiln serve`` flags (docs/serving.md)."""

    reasoning_parser: ReasoningParserName | None = Field(
        default=None,
        description="kiln serve --reasoning-parser: keep a thinking model's <think>...</think> apart from its answer "
        "(reasoning_content in chat, thinking blocks in Messages, reasoning items in Responses); vLLM's names. "
        "Unset: the whole output is the answer.",
    )
    default_chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, json_schema_extra={"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                                         "maxProperties": MAX_TEMPLATE_KWARGS},
        description="kiln serve --default-chat-template-kwargs: chat template variables every chat, Messages and "
        "Responses request gets under its own chat_template_kwargs, e.g. {enable_thinking: false} for Qwen3.",
    )

    @field_validator("default_chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and (problem := template_kwargs_problem(value, "defaultChatTemplateKwargs")):
            raise ValueError(problem)
        return value

    def chat_flags(self) -> list[str]:
        """The ``kiln serve`` flags of these settings (none for an unset one)."""
        flags = ["--reasoning-parser", self.reasoning_parser] if self.reasoning_parser else []
        if self.default_chat_template_kwargs:
            flags += ["--default-chat-template-kwargs", json.dumps(self.default_chat_template_kwargs, sort_keys=True)]
        return flags


class ServingOptions(ChatServingOptions):
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
    autoscaling: AutoscalingOptions | None = Field(
        default=None,
        description="Scale pods with the queue (KEDA ScaledObject, or an HPA where the chart says so); when set, "
        "the autoscaler owns the replica count and spec.serving.replicas is not used.",
    )
    routing: RoutingOptions = Field(
        default_factory=RoutingOptions, json_schema_extra={"default": {}},
        description="Routing across replicas (Gateway API Inference Extension).",
    )
    pool: str | None = Field(
        default=None, max_length=MAX_POOL_NAME, pattern=DNS1035_LABEL,
        description="An LLMEnginePool of this namespace to serve the engine from (docs/pools.md): it is built as "
        "usual, then listed in the pool's engine list instead of getting a Deployment of its own. Unset: its own "
        "pods. replicas, resources, autoscaling, routing, rolloutStrategy and batchInvariant are then the pool's.",
    )
    batch_invariant: bool = Field(
        default=False,
        description="kiln serve --batch-invariant: each linear runs one of kiln's C kernels at every row count, so "
        "a greedy answer does not depend on its batch, its prefill chunks or a prefix-cache hit (docs/tactics.md). "
        "CPU engines only (spec.gpu cpu); /version says whether every linear got one.",
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
        return check_resources(value)

    def process_wide(self) -> tuple[tuple[str, Any], ...]:
        """(field, value) of the settings one ``kiln serve`` takes for every engine it serves: a pool's member
        cannot have its own, and engines served in one process must agree on them."""
        return (("batchInvariant", self.batch_invariant), ("reasoningParser", self.reasoning_parser),
                ("defaultChatTemplateKwargs", self.default_chat_template_kwargs))

    def serve_flags(self) -> list[str]:
        """The ``kiln serve`` flags of these options that the server's defaults do not already say."""
        return [*([BATCH_INVARIANT_FLAG] if self.batch_invariant else []), *self.chat_flags()]


def batch_invariant_problem(field: str, on: bool, gpu: str, of: str = "engines") -> str | None:
    """``<field>: <what + fix>`` where ``batchInvariant`` is asked of a GPU SKU (its twin: :data:`SCALE_OUT_RULES`)."""
    if on and gpu != "cpu":
        return (f"{field}: is for CPU {of} (kiln's tactic table), not spec.gpu {gpu}; a CUDA engine has no such "
                "mode yet: set it false, or spec.gpu cpu")
    return None


def check_resources(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """A container's ResourceRequirements as a spec gives them (an engine's or a pool's); ValueError with the fix."""
    if value is None:
        return value
    unknown = sorted(set(value) - {"limits", "requests", "claims"})
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)}; use limits, requests (and claims)")
    for key in ("limits", "requests"):
        if key in value and not isinstance(value[key], dict):
            raise ValueError(f"{key} must be a map of resource name to quantity, e.g. {{cpu: '4'}}")
    return value


def autoscaling_bounds_rule(name: str, at: str, field: str) -> tuple[str, str, str, str]:
    """The CEL rule that ``minReplicas <= maxReplicas`` of the autoscaling options at ``at``
    (``self.serving.autoscaling`` for an engine's spec, ``self.spec.autoscaling`` for a pool), named ``field`` (from
    spec); its Python twin is :func:`autoscaling_bounds_problem`."""
    return (name, f"!has({at}) || {at}.minReplicas <= {at}.maxReplicas",
            f"spec.{field}.minReplicas must be at most maxReplicas; lower minReplicas or raise maxReplicas",
            f"{at.removeprefix('self')}.minReplicas")


def autoscaling_bounds_problem(field: str, scaling: AutoscalingOptions | None) -> str | None:
    """``<field>.minReplicas: <what + fix>`` where the autoscaler's floor is above its ceiling (an engine's or a
    pool's)."""
    if scaling is not None and scaling.min_replicas > scaling.max_replicas:
        return (f"{field}.minReplicas: must be at most maxReplicas ({scaling.min_replicas} > {scaling.max_replicas}); "
                "lower minReplicas or raise maxReplicas")
    return None


# (python check name, CEL rule on spec, message, fieldPath), joined to kiln.api.CROSS_FIELD_RULES.
SCALE_OUT_RULES: tuple[tuple[str, str, str, str], ...] = (
    autoscaling_bounds_rule("autoscaling_bounds", "self.serving.autoscaling", "serving.autoscaling"),
    ("batch_invariant_cpu", "!has(self.serving.batchInvariant) || !self.serving.batchInvariant || self.gpu == 'cpu'",
     "spec.serving.batchInvariant is for CPU engines (kiln's tactic table); set it false, or spec.gpu cpu",
     ".serving.batchInvariant"),
)


def scale_out_problems(serving: ServingOptions, gpu: str) -> list[str]:
    """The Python twins of :data:`SCALE_OUT_RULES`, one ``<field path>: <what + fix>`` line each."""
    problems = []
    if problem := autoscaling_bounds_problem("serving.autoscaling", serving.autoscaling):
        problems.append(problem)
    if problem := batch_invariant_problem("serving.batchInvariant", serving.batch_invariant, gpu):
        problems.append(problem)
    return problems
