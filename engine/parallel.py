"""Tensor-parallel context: which rank this process is, and the collectives the layers use.

Layers ask this module for ``tp_rank()``/``tp_size()`` when they are built, so the
same model code builds one rank's shard inside a worker process (after
``init_distributed``) or offline in the builder (``shard_context`` with no
process group at all, used by ``artifact.shard_checkpoint``).

Two process groups: the default one carries tensors between ranks (NCCL on
GPU, gloo on CPU) and a gloo group carries the step's inputs from rank 0 to
the workers as Python objects, whatever the device.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator

import torch
import torch.distributed as dist

_rank = 0
_size = 1
_cpu_group: dist.ProcessGroup | None = None


def tp_rank() -> int:
    return _rank


def tp_size() -> int:
    return _size


@contextlib.contextmanager
def shard_context(rank: int, size: int) -> Iterator[None]:
    """Build layers as rank ``rank`` of ``size`` without any process group (offline sharding)."""
    global _rank, _size
    old = (_rank, _size)
    _rank, _size = rank, size
    try:
        yield
    finally:
        _rank, _size = old


def init_distributed(rank: int, size: int, init_method: str, device: str) -> None:
    """Join the tensor-parallel group; rank 0 is the driver that schedules."""
    global _rank, _size, _cpu_group
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(minutes=10))
    _cpu_group = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    _rank, _size = rank, size


def destroy_distributed() -> None:
    global _rank, _size, _cpu_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _rank, _size, _cpu_group = 0, 1, None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension (vocab shards of the LM head)."""
    if _size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def broadcast_object(obj: object | None = None) -> object:
    """Rank 0 sends ``obj``; every other rank returns what rank 0 sent."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_cpu_group)
    return box[0]


def min_over_ranks(value: int) -> int:
    """The smallest ``value`` any rank holds (e.g. KV blocks every rank can afford)."""
    if _size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_cpu_group)
    return int(t.item())
