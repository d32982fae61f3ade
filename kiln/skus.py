"""The accelerators kiln builds for, and how one replica's ranks are laid out on their nodes.

:data:`GPU_SKUS` is the one table (memory, compute capability, arch, node label, GPUs per
node); :func:`replica_shape` the one layout rule, with :data:`SHAPE_RULE` its CEL twin
generated from the same table. Plain Python: the core and the operator import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FP8_MIN_COMPUTE_CAPABILITY = (8, 9)  # the engine's FP8_MIN_CAPABILITY (kiln/engine/kernels/fp8.py)


@dataclass(frozen=True)
class GPUSpec:
    """One supported accelerator. ``memory_gib``/``compute_capability`` are None for ``cpu``."""

    memory_gib: int | None
    compute_capability: str | None  # "9.0"
    arch: str  # "sm90" | "cpu": what compiled artifacts are specific to
    product_label: str | None  # value of the node label nvidia.com/gpu.product (GPU feature discovery)
    # GPUs on one node of the usual machine type (8 for HGX/DGX H100 and H200, A100, L40S and L4 servers);
    # spec.gpusPerNode overrides it. None (cpu): a replica is one pod unless spec.gpusPerNode says otherwise.
    gpus_per_node: int | None = 8

    @property
    def is_cpu(self) -> bool:
        return self.arch == "cpu"

    @property
    def supports_fp8(self) -> bool:
        """FP8 GEMMs are native at compute capability >= 8.9; cpu runs the dequantized reference path.

        The engine's rule (``kiln.engine.kernels.fp8.fp8_gemm_supported``) decides what really
        runs; the core imports no engine, so tests/engine/test_quant_kernels.py pins that they agree.
        """
        if self.compute_capability is None:
            return True
        major, minor = (int(x) for x in self.compute_capability.split("."))
        return (major, minor) >= FP8_MIN_COMPUTE_CAPABILITY


GPU_SKUS: dict[str, GPUSpec] = {
    "cpu": GPUSpec(None, None, "cpu", None, gpus_per_node=None),
    "L4": GPUSpec(24, "8.9", "sm89", "NVIDIA-L4"),
    "L40S": GPUSpec(48, "8.9", "sm89", "NVIDIA-L40S"),
    "A100-40GB": GPUSpec(40, "8.0", "sm80", "NVIDIA-A100-SXM4-40GB"),
    "A100-80GB": GPUSpec(80, "8.0", "sm80", "NVIDIA-A100-SXM4-80GB"),
    "H100-80GB": GPUSpec(80, "9.0", "sm90", "NVIDIA-H100-80GB-HBM3"),
    "H200-141GB": GPUSpec(141, "9.0", "sm90", "NVIDIA-H200"),
}

GPUName = Literal["cpu", "L4", "L40S", "A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB"]
FP8_GPUS = tuple(name for name, gpu in GPU_SKUS.items() if gpu.supports_fp8)



@dataclass(frozen=True)
class ReplicaShape:
    """One serving replica: ``pods`` pods of ``ranks_per_pod`` ranks each (one GPU per rank; processes on cpu).

    Ranks are numbered ``stage * tensor_parallel + tp_rank`` (docs/multi-node.md) and pod ``i`` holds
    ranks ``i * ranks_per_pod ..``, so a pod holds whole pipeline stages.
    """

    tensor_parallel: int
    pipeline_parallel: int
    pods: int
    ranks_per_pod: int

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def multi_node(self) -> bool:
        return self.pods > 1


def gpus_per_node(gpu: str, override: int | None = None) -> int | None:
    """``spec.gpusPerNode`` if set, else the SKU's; None (cpu): no limit, the replica is one pod."""
    return override if override is not None else GPU_SKUS[gpu].gpus_per_node


def shape_problem(gpu: str, tensor_parallel: int, pipeline_parallel: int, override: int | None = None) -> str | None:
    """Why this shape cannot be laid out on nodes (a ``tensorParallel: ...`` line); None when it can.

    The one rule (CEL twin: :data:`SHAPE_RULE`): a replica larger than a node needs each
    tensor-parallel group on one node, i.e. ``tensorParallel <= gpusPerNode``. With the enums
    (powers of two) that also makes ``gpusPerNode`` divide ``tensorParallel x pipelineParallel``.
    """
    node = gpus_per_node(gpu, override)
    world = tensor_parallel * pipeline_parallel
    if node is None or world <= node:
        return None
    whose = f"spec.gpusPerNode {node}" if override is not None else f"{node} on a {gpu} node (spec.gpu)"
    if tensor_parallel > node or node % tensor_parallel or world % node:
        return (f"tensorParallel: {tensor_parallel} GPUs per pipeline stage do not fit the GPUs per node ({whose}): "
                "a tensor-parallel group must stay inside one node; lower tensorParallel to at most "
                f"{node} and raise pipelineParallel, or set gpusPerNode to the GPUs your nodes have")
    return None


def replica_shape(gpu: str, tensor_parallel: int, pipeline_parallel: int, override: int | None = None) -> ReplicaShape:
    """Pods per replica = tensorParallel x pipelineParallel / gpusPerNode (one pod when it fits a node)."""
    if (problem := shape_problem(gpu, tensor_parallel, pipeline_parallel, override)) is not None:
        raise ValueError(problem)
    node = gpus_per_node(gpu, override)
    world = tensor_parallel * pipeline_parallel
    if node is None or world <= node:
        return ReplicaShape(tensor_parallel, pipeline_parallel, 1, world)
    return ReplicaShape(tensor_parallel, pipeline_parallel, world // node, node)


def _shape_cel() -> str:
    nodeless = [sku for sku, g in GPU_SKUS.items() if g.gpus_per_node is None]
    table = ", ".join(f"'{sku}': {g.gpus_per_node}" for sku, g in GPU_SKUS.items() if g.gpus_per_node is not None)
    return ("has(self.gpusPerNode) ? self.tensorParallel <= self.gpusPerNode : ("
            + "".join(f"self.gpu == '{sku}' || " for sku in nodeless)
            + f"self.tensorParallel <= {{{table}}}[self.gpu])")


SHAPE_RULE = (
    "replica_shape", _shape_cel(),
    "spec.tensorParallel must be at most spec.gpusPerNode (default: the GPU SKU's GPUs per node, 8): a "
    "tensor-parallel group must stay inside one node; lower tensorParallel and raise pipelineParallel, or set "
    "gpusPerNode to the GPUs your nodes have",
    ".tensorParallel",
)
