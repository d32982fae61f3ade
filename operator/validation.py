"""Semantic checks of a spec (and of the LLMEngine's name): what the CRD schema cannot express, or what
depends on this cluster or operator (its SKU map, its image allowlist: kiln.operator.trust).

The CRD's schema and CEL rules reject most bad specs at ``kubectl apply``; the
same pydantic model runs here too because an API server without those rules
(an old CRD, an emulator) must still never hand the builder a spec it cannot
build. Every message names the field and the fix.
"""

from __future__ import annotations

from typing import Any

from kiln.operator.autoscaling import autoscaling_problem
from kiln.operator.jobs import pod_gpus
from kiln.operator.naming import engine_name_problem
from kiln.operator.settings import OperatorConfig
from kiln.operator.trust import spec_image_problem
from kiln.operator.workloads import RENDEZVOUS_PORT

from kiln.api import LLMEngineSpec
from kiln.manifest import ManifestError, load_spec
from kiln.memory_budget import QUANTITY
from kiln.pool_api import member_problem


class InvalidSpec(ValueError):
    """A spec that can never work as written; ``str()`` is the user-facing message."""


def parse_spec(raw: dict[str, Any]) -> LLMEngineSpec:
    """The spec the API server stored, each problem worded as ``kiln plan`` words it (``kiln.manifest``)."""
    try:
        return load_spec(raw)
    except ManifestError as exc:
        raise InvalidSpec("; ".join(exc.problems)) from None


def validate_name(name: str) -> None:
    """An LLMEngine whose name cannot name its children fails once, naming ``metadata.name``."""
    if problem := engine_name_problem(name):
        raise InvalidSpec(problem)


def validate_spec(raw: dict[str, Any], config: OperatorConfig) -> LLMEngineSpec:
    spec = parse_spec(raw)
    if problem := spec_image_problem(spec, config):
        raise InvalidSpec(problem)
    if problem := autoscaling_problem(spec, config):  # scale out: minReplicas 0 needs KEDA, not an HPA
        raise InvalidSpec(problem)
    if problem := pool_problem(spec):
        raise InvalidSpec(problem)
    if problem := file_source_problem(spec):
        raise InvalidSpec(problem)
    if config.node_selector(spec.gpu) is None:
        known = ", ".join(sorted(config.sku_node_labels))
        raise InvalidSpec(
            f"spec.gpu: {spec.gpu} has no node label in this operator's SKU map ({known}); "
            "add it to the chart value gpuNodeLabels (KILN_SKU_NODE_LABELS) or pick a listed SKU")
    if problem := resources_problem(spec) or serving_port_problem(spec):
        raise InvalidSpec(problem)
    return spec


def file_source_problem(spec: LLMEngineSpec) -> str | None:
    """A file:// source (the model, a speculative draft model, a LoRA adapter): a path on one machine."""
    named = [(f"spec.{path}.source", source) for path, source in spec.sources.items()]
    adapters = spec.lora.adapters if spec.lora is not None else []
    named += [(f"spec.lora.adapters[{i}].source", a.model_source) for i, a in enumerate(adapters)]
    for field, source in named:
        if source.scheme == "file":
            return (f"{field}: {source.source} is a path on one machine, not visible to build pods; "
                    "use s3://, hf:// or pvc://claim/path (file:// is for `kiln up`)")
    return None


def resources_problem(spec: LLMEngineSpec) -> str | None:
    """``spec.serving.resources`` the API server would refuse in the pod (a malformed quantity), or whose
    ``nvidia.com/gpu`` is not what each serving pod holds."""
    resources = spec.serving.resources or {}
    want = 0 if spec.gpu_spec.is_cpu else pod_gpus(spec)
    if problem := quantity_problem("spec.serving.resources", resources):
        return problem
    for key in ("limits", "requests"):
        gpus = (resources.get(key) or {}).get("nvidia.com/gpu")
        if gpus is not None and str(gpus) != str(want):
            return (f"spec.serving.resources.{key}: nvidia.com/gpu is {gpus} but each serving pod of this engine "
                    f"holds {want} GPU(s) (spec.tensorParallel x spec.pipelineParallel, at most spec.gpusPerNode, on "
                    f"spec.gpu {spec.gpu}); remove it, the operator sets it")
    return None


def quantity_problem(field: str, resources: dict[str, Any]) -> str | None:
    """A container's ``resources`` (an engine's pods, a pool's) with an amount the API server would refuse."""
    for key in ("limits", "requests"):
        for resource, value in (resources.get(key) or {}).items():
            if isinstance(value, bool) or not QUANTITY.match(str(value)):
                return (f"{field}.{key}.{resource}: {value!r} is not a Kubernetes quantity; write it as Kubernetes "
                        "does, e.g. 64Gi or 512Mi (memory), 8 or 500m (cpu)")
    return None


def serving_port_problem(spec: LLMEngineSpec) -> str | None:
    """A multi-node engine's leader listens on the rendezvous port too: the API port must be another."""
    if spec.replica_shape.multi_node and spec.serving.port == RENDEZVOUS_PORT:
        return (f"spec.serving.port: {RENDEZVOUS_PORT} is the port the ranks of this multi-node engine meet on "
                "(its leader pod listens on it for them); pick another port, e.g. 8000")
    return None


def pool_problem(spec: LLMEngineSpec) -> str | None:
    """What an engine of a pool (``spec.serving.pool``) cannot ask for (:func:`kiln.pool_api.member_problem`)."""
    pool = spec.serving.pool
    if pool is None:
        return None
    return member_problem(spec, f"LLMEnginePool {pool} (spec.serving.pool)",
                          "remove spec.serving.pool to serve the engine from its own pods")


def validate_namespace(spec: LLMEngineSpec, namespace: str, config: OperatorConfig) -> None:
    """A ``pvc://`` source is mounted by the build Job, which runs in the jobs namespace: only an engine of that
    namespace may name a claim there (else any tenant could publish the contents of any claim of it, the operator's
    own included)."""
    jobs = config.jobs_namespace
    if namespace == jobs:
        return
    named = [(f"spec.{path}.source", m.source) for path, m in spec.sources.items() if m.scheme == "pvc"]
    adapters = spec.lora.adapters if spec.lora is not None else []
    named += [(f"spec.lora.adapters[{i}].source", a.source) for i, a in enumerate(adapters)
              if a.model_source.scheme == "pvc"]
    if named:
        field, source = named[0]
        raise InvalidSpec(
            f"{field}: {source} names a PersistentVolumeClaim, which build Jobs mount in the jobs namespace {jobs}, "
            f"not in this engine's namespace {namespace}; put the engine in namespace {jobs}, or copy the checkpoint "
            "to s3:// or hf:// and use that")
