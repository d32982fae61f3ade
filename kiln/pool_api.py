"""The ``LLMEnginePool`` API: pydantic types for ``serving.kiln.dev/v1alpha1``, kind ``LLMEnginePool``.

A pool is a set of serving pods that serve several engines, each loaded on the first request that names it,
evicted least-recently-used when another needs its memory and unloaded when idle (docs/pools.md). An
``LLMEngine`` joins one with ``spec.serving.pool: NAME`` (same namespace): it is still built on its own, once
per envelope, but instead of its own Deployment it is listed in the pool's engine list (a ConfigMap the pool's
pods follow without restarting). These types are the source of the pool CRD (``kiln crd``) as :mod:`kiln.api`'s
are of the engine's; the pool's settings become the ``kiln serve`` flags of the same names (:data:`SERVE_FLAGS`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import datetime
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from kiln.api import LLMEngineSpec, Metadata
from kiln.api_base import DNS1035_LABEL, DNS1123_SUBDOMAIN, MAX_POOL_NAME, ServiceName, label_problems
from kiln.api_base import APIModel as _Model
from kiln.engine_status import Condition, PoolMemberState
from kiln.memory_budget import QUANTITY_PATTERN, parse_quantity
from kiln.serving_options import (
    BATCH_INVARIANT_FLAG,
    AutoscalingOptions,
    ChatServingOptions,
    RoutingOptions,
    autoscaling_bounds_problem,
    batch_invariant_problem,
    check_resources,
)
from kiln.skus import GPUName

POOL_KIND = "LLMEnginePool"
POOL_PLURAL = "llmenginepools"
POOL_SINGULAR = "llmenginepool"
POOL_SHORT_NAME = "llmep"


class PoolRoutingOptions(RoutingOptions):
    """An engine's routing settings (:class:`kiln.serving_options.RoutingOptions`), for the pool's pods."""

    inference_pool: bool = Field(
        default=False,
        description="Render a Gateway API Inference Extension InferencePool (inference.networking.k8s.io/v1) "
        "<pool>-pool over the pool's pods, for an endpoint picker that scores their queues, KV-cache use and which "
        "engines each has loaded (docs/pools.md, Routing).",
    )
    endpoint_picker: ServiceName | None = Field(
        default=None,
        description="Service of the endpoint picker (EPP) serving the pool's InferencePool (a DNS-1035 label, as a "
        "Service's name is); unset means <pool>-pool-epp (hashed under 63 characters).",
    )


class LLMEnginePoolSpec(ChatServingOptions):
    engines: list[str] | None = Field(
        default=None, max_length=1000,
        description="kiln up only: the LLMEngine manifests to serve, as paths relative to the pool's manifest. In a "
        "cluster, engines join with their spec.serving.pool instead, and this must be unset.",
    )
    gpu: GPUName = Field(
        default="cpu", description="Accelerator SKU of the pool's pods; every member engine must be built for it "
        "(spec.gpu), and with one pod per replica (tensorParallel x pipelineParallel within a node).",
    )
    replicas: int = Field(default=1, ge=0, le=1000, description="Serving pods; each serves every member engine.")
    autoscaling: AutoscalingOptions | None = Field(
        default=None, description="Scale the pool's pods on the pool's queue (kiln:num_requests_waiting of its "
        "engines and of the pool, summed over its pods) with a KEDA ScaledObject or an HPA, as the operator renders "
        "them (docs/scale-out.md); replicas is then only the count on create. minReplicas 0 scales the pool to "
        "zero when idle: needs KEDA and its HTTP add-on, whose interceptor holds requests while a pod starts "
        "(docs/pools.md).",
    )
    port: int = Field(default=8000, ge=1024, le=65535, description="Container and Service port of the API.")
    resources: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra={"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        description="Kubernetes ResourceRequirements of the serving container; limits.memory is the default "
        "memory budget (less 10% and 768Mi for the server). Unset means the operator's CPU/memory defaults.",
    )
    node_selector: dict[str, str] | None = Field(
        default=None, description="nodeSelector of the pool's pods (besides the GPU SKU's placement).")
    image: str | None = Field(default=None, max_length=512, description="Override of the serving image.")
    api_key_secret: str | None = Field(
        default=None, max_length=253, pattern=DNS1123_SUBDOMAIN,
        description="Secret with key KILN_API_KEY; when set, every request to the pool needs 'Authorization: Bearer "
        "<key>' (or x-api-key). It guards every member: a member's own spec.serving.apiKeySecret is refused.",
    )
    max_loaded_engines: int | None = Field(
        default=None, ge=1, le=1000, description="Engines loaded at once at most (kiln serve --max-loaded-engines); "
        "unset means as many as the memory budget holds.",
    )
    memory_budget: str | None = Field(
        default=None, max_length=32, pattern=QUANTITY_PATTERN,
        description="What the loaded engines may count, as a quantity (6Gi); unset means resources.limits.memory "
        "less 10% and 768Mi, else the node's memory. Each engine counts the memory its build measured.",
    )
    idle_unload_after: int | None = Field(
        default=None, ge=1, le=86400 * 30,
        description="Seconds without a request after which an engine is unloaded; unset means never.",
    )
    load_timeout: int = Field(
        default=300, ge=1, le=3600,
        description="Seconds a request waits for its engine to be placed and loaded before a 503 with Retry-After.",
    )
    queue_size: int = Field(
        default=64, ge=1, le=100000, description="Requests that may wait for an engine to be placed.",
    )
    max_queue_len: int = Field(
        default=256, ge=1, le=100000, description="Requests waiting beyond this get HTTP 429 instead of queueing.",
    )
    drain_timeout_seconds: int = Field(
        default=30, ge=0, le=3600,
        description="On shutdown, how long in-flight requests may finish before being aborted.",
    )
    batch_invariant: bool = Field(
        default=False,
        description="kiln serve --batch-invariant for every engine the pool loads: a greedy answer does not depend "
        "on its batch (docs/tactics.md). CPU pools only (spec.gpu cpu).",
    )
    routing: PoolRoutingOptions = Field(
        default_factory=PoolRoutingOptions, json_schema_extra={"default": {}},
        description="Routing across the pool's pods (Gateway API Inference Extension).",
    )

    @model_validator(mode="after")
    def _check_cross_field(self) -> LLMEnginePoolSpec:  # the twins of kiln.crd.POOL_RULES' pool_batch_invariant_cpu
        problems = [p for p in (batch_invariant_problem("batchInvariant", self.batch_invariant, self.gpu, "pools"),
                                autoscaling_bounds_problem("autoscaling", self.autoscaling)) if p]  # and its bounds
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @field_validator("resources")
    @classmethod
    def _check_resources(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_resources(value)

    @field_validator("node_selector")
    @classmethod
    def _check_node_selector(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if problems := label_problems(value):  # the pods' nodeSelector: the API server refuses the Deployment
            raise ValueError("; ".join(problems))
        return value

    @field_validator("memory_budget")
    @classmethod
    def _check_budget(cls, value: str | None) -> str | None:
        if value is not None:
            parse_quantity(value, "memoryBudget")
        return value

    @property
    def memory_budget_bytes(self) -> int | None:
        """``memoryBudget`` in bytes (None: the pods' default)."""
        return parse_quantity(self.memory_budget, "memoryBudget") if self.memory_budget is not None else None

    @property
    def memory_limit_bytes(self) -> int | None:
        """``resources.limits.memory`` in bytes, when given."""
        limit = ((self.resources or {}).get("limits") or {}).get("memory")
        return parse_quantity(str(limit), "resources.limits.memory") if limit is not None else None


# The pool's settings and the `kiln serve` flags they become (kiln up's pool manifest uses the same table).
SERVE_FLAGS: dict[str, str] = {
    "maxLoadedEngines": "--max-loaded-engines", "memoryBudget": "--memory-budget",
    "idleUnloadAfter": "--idle-unload-after", "loadTimeout": "--load-timeout", "queueSize": "--pool-queue-size",
}

MemberState = PoolMemberState  # one list: an engine's status.pool.state says the same


class LeftOutAdapter(_Model):
    """An adapter of a member the pool's pods are not given (its name says another engine or adapter)."""

    name: str = Field(description="The adapter (spec.lora.adapters[].name of the member).")
    message: str = Field(max_length=4096, description="Why the pool leaves it out, and the fix.")


class PoolMember(_Model):
    """One engine of ``status.engines``: an LLMEngine whose ``spec.serving.pool`` names this pool."""

    name: str = Field(description="The LLMEngine (what clients send as model).")
    engine_version: str | None = Field(default=None, description="The version listed (or being built).")
    state: MemberState = Field(
        description="Building: not built yet; Listed: in the engine list the pods follow; Refused: see message.")
    memory_bytes: int | None = Field(default=None, ge=0, description="What it counts against the budget.")
    message: str | None = Field(default=None, max_length=32768, description="Why it is refused.")
    listed_since: str | None = Field(
        default=None, description="Listed: when this version was first listed (RFC 3339); the pods follow the "
        "engine list within the kubelet's ConfigMap sync, so the engine counts as served by the pool a while after.")
    adapters_left_out: list[LeftOutAdapter] | None = Field(
        default=None, description="Its LoRA adapters the pool's pods are not given: a request names an "
        "adapter as it names an engine, so within a pool a name must say which (the member's status.adapters says "
        "so too).")


class LLMEnginePoolStatus(_Model):
    # The operator writes status, not users; keys another writer left (kopf's status.kopf) must not make the
    # object unreadable (as LLMEngineStatus).
    model_config = ConfigDict(extra="ignore")

    phase: Literal["Pending", "Ready", "Failed"] | None = Field(
        default=None, description="Pending: pods not ready yet; Ready: serving; Failed: see the Ready condition.")
    observed_generation: int | None = Field(
        default=None, ge=0, description="metadata.generation the status was computed for.")
    endpoint: str | None = Field(default=None, description="The pool Service's OpenAI base URL.")
    memory_budget_bytes: int | None = Field(
        default=None, ge=0, description="What the loaded engines may count (None: the node's memory, unknown here).")
    engines: list[PoolMember] = Field(
        default_factory=list, description="The member engines and their states.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})
    listed_engines: int | None = Field(
        default=None, ge=0, description="How many of status.engines are Listed (kubectl get's Engines column).")
    replicas: int | None = Field(default=None, ge=0, description="Pods desired.")
    ready_replicas: int | None = Field(default=None, ge=0, description="Pods ready.")
    conditions: list[Condition] = Field(
        default_factory=list, description="Kubernetes-style conditions; Ready means the pool's pods serve.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    last_reconciled: datetime | None = Field(default=None, description="When the operator last reconciled it.")


class LLMEnginePool(_Model):
    api_version: Literal["serving.kiln.dev/v1alpha1"] = Field(alias="apiVersion")  # required, as LLMEngine's
    kind: Literal["LLMEnginePool"]
    metadata: Metadata = Field(description="metadata.name is at most 58 characters (the pods' Deployment is "
                               "<name>-pool).")
    spec: LLMEnginePoolSpec
    status: LLMEnginePoolStatus | None = None

    @model_validator(mode="after")
    def _check_root(self) -> LLMEnginePool:  # the twin of kiln.crd.POOL_RULES' pool_name (kiln up refuses it too)
        if problem := pool_name_problem(self.metadata.name):
            raise ValueError(problem)
        return self


def pool_name_problem(name: str) -> str | None:
    """Why an LLMEnginePool called ``name`` cannot have its children (``<name>-pool``: a Service); None if it can."""
    if len(name) > MAX_POOL_NAME or not re.fullmatch(DNS1035_LABEL, name):
        return (f"metadata.name: {name!r} must be a DNS-1035 label of at most {MAX_POOL_NAME} characters (lowercase "
                f"letters, digits and '-', starting with a letter), as it names the Service {name}-pool; recreate the "
                "LLMEnginePool with such a name")
    return None


def serve_flags(spec: LLMEnginePoolSpec) -> list[str]:
    """The ``kiln serve`` flags of a pool's settings (:data:`SERVE_FLAGS`; an unset one is the server's default)."""
    values = {"maxLoadedEngines": spec.max_loaded_engines, "memoryBudget": spec.memory_budget,
              "idleUnloadAfter": spec.idle_unload_after, "loadTimeout": spec.load_timeout,
              "queueSize": spec.queue_size}
    flags = ["--max-queue-len", str(spec.max_queue_len), *([BATCH_INVARIANT_FLAG] if spec.batch_invariant else []),
             *spec.chat_flags()]
    for field, flag in SERVE_FLAGS.items():
        if values[field] is not None:
            flags += [flag, str(values[field])]
    return flags


def member_problem(spec: LLMEngineSpec, by: str, alone: str) -> str | None:
    """What a pool's member cannot ask for, as ``<field>: <what + fix>``: the pool's pods serve it, so their count,
    routing, key, ``--batch-invariant`` and chat settings (reasoning parser, template defaults) are the pool's, and
    a pool pod holds whole engines (one pod per replica). ``by`` names the pool (the operator: ``LLMEnginePool NAME
    (spec.serving.pool)``; ``kiln up``: its pool manifest), ``alone`` the other fix: serving the engine on its own.
    The operator and ``kiln up`` refuse the same fields."""
    serving = spec.serving
    if serving.autoscaling is not None:
        return (f"spec.serving.autoscaling: this engine is served by {by}, whose pods serve every engine of the pool "
                "and are scaled by the pool (its spec.replicas, or its spec.autoscaling), not per engine; remove "
                f"spec.serving.autoscaling, or {alone}")
    if serving.routing.inference_pool:
        return (f"spec.serving.routing.inferencePool: this engine is served by {by}, whose Service answers every "
                "engine of the pool; routing is the pool's, not per engine: set the pool's "
                f"spec.routing.inferencePool and remove spec.serving.routing.inferencePool here, or {alone}")
    if serving.api_key_secret:
        return (f"spec.serving.apiKeySecret: this engine is served by {by}, whose pods check one key for every "
                "member; set it as the pool's spec.apiKeySecret (kiln up reads no Secret: set $KILN_API_KEY where "
                f"you run it) and remove it here, or {alone}")
    for field, value in serving.process_wide():
        if value:
            return (f"spec.serving.{field}: this engine is served by {by}, whose pods run every member with one "
                    f"setting; set it as the pool's spec.{field} and remove it here, or {alone}")
    shape = spec.replica_shape
    if shape.pods > 1:
        return (f"spec.tensorParallel x spec.pipelineParallel: this engine is served by {by}, but one replica of it "
                f"spans {shape.pods} pods ({shape.tensor_parallel} x {shape.pipeline_parallel} ranks, "
                f"{shape.ranks_per_pod} per node) and a pool's pod holds whole engines; lower tensorParallel x "
                f"pipelineParallel to fit one node, or {alone}")
    return None


def adapter_name_clashes(engines: Iterable[str],
                         adapters: Iterable[tuple[str, str, str]]) -> dict[tuple[str, str], tuple[str, str]]:
    """The one rule of adapter names where one server answers several engines (a pool's pods, ``kiln up``): a request
    names an adapter as it names an engine (``model``), so each name must say one thing. ``adapters``: (engine, adapter
    name, adapter version) rows, the engines that keep a name first. Returns (engine, adapter) -> ``("engine", name)``
    where an engine has that name (requests naming it reach that engine), or ``("adapter", E)`` where ``E``, before it,
    holds another adapter of that name. One adapter version (the same adapter of the same base) under two engines says
    one thing: no clash. ``kiln up`` refuses a clash; the operator leaves the adapter out of the pool's list."""
    names = set(engines)
    keeper: dict[str, tuple[str, str]] = {}  # adapter name -> (engine, version) that keeps it
    out: dict[tuple[str, str], tuple[str, str]] = {}
    for engine, name, version in adapters:
        if name in names:
            out[(engine, name)] = ("engine", name)
        elif keeper.setdefault(name, (engine, version))[1] != version:
            out[(engine, name)] = ("adapter", keeper[name][0])
    return out
