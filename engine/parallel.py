"""Parallel context: which rank this process is, and the collectives the layers and stages use.

Rank layout (``world = pipeline_parallel_size * tensor_parallel_size``)::

    rank = pp_stage * tp_size + tp_rank

so the ``tp_size`` ranks of one pipeline stage are consecutive (one node / one
LeaderWorkerSet pod holds one stage, tensor parallel over NVLink inside it), and
rank 0 (stage 0, TP rank 0) is the driver: scheduler, sampler, detokenizer.

Layers ask this module for ``tp_rank()``/``tp_size()`` and models for
``pp_rank()``/``pp_size()`` when they are built, so the same model code builds
one rank's shard inside a rank process (after ``init_distributed``) or offline
in the builder (``shard_context`` with no process group at all, used by
``artifact.shard_checkpoint``).

Process groups: the default one carries tensors (NCCL on GPU, gloo on CPU):
pipeline activations point to point, the last stage's logits back to rank 0;
one TP group per stage carries the all-reduces / all-gathers; a gloo group over
every rank carries rank 0's messages (``send_message``): typed tensors, a header
then a payload, never a pickle (JSON control messages, the steps' inputs as int64
words: ``step_inputs.encode_steps``). Every wait
that depends on another process is bounded by ``timeout`` (the process group's
timeout): a dead or hung peer fails the step with an error, never a hang.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist

_rank = 0          # global rank
_world = 1
_tp_rank = 0
_tp_size = 1
_pp_rank = 0
_pp_size = 1
_cpu_group: dist.ProcessGroup | None = None
_tp_group: dist.ProcessGroup | None = None
_timing = False    # inside ``no_collectives``: the TP collectives are skipped
log = logging.getLogger("kiln.engine")


def tp_rank() -> int:
    return _tp_rank


def tp_size() -> int:
    return _tp_size


def pp_rank() -> int:
    return _pp_rank


def pp_size() -> int:
    return _pp_size


def rank() -> int:
    return _rank


def world_size() -> int:
    return _world


def is_first_stage() -> bool:
    return _pp_rank == 0


def is_last_stage() -> bool:
    return _pp_rank == _pp_size - 1


def global_rank(pp: int, tp: int, tp_size_: int) -> int:
    return pp * tp_size_ + tp


def stage_layers(num_layers: int, stage: int, num_stages: int) -> tuple[int, int]:
    """Layers [start, end) of ``stage``: as even as possible, earlier stages take the remainder
    (the last stage also runs the norm and the LM head)."""
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return start, start + base + (1 if stage < extra else 0)


def _set(rank_: int, tp: int, pp: int) -> None:
    global _rank, _world, _tp_rank, _tp_size, _pp_rank, _pp_size
    _rank, _world = rank_, tp * pp
    _tp_size, _pp_size = tp, pp
    _pp_rank, _tp_rank = divmod(rank_, tp)


@contextlib.contextmanager
def shard_context(rank_: int, tp: int, pp: int = 1) -> Iterator[None]:
    """Build layers as global rank ``rank_`` of ``tp * pp`` without any process group (offline sharding)."""
    old = (_rank, _tp_size, _pp_size)
    _set(rank_, tp, pp)
    try:
        yield
    finally:
        _set(*old)


# -- joining: each rank proves it holds the group token before anything else is exchanged ------------
def init_distributed(rank_: int, tp: int, pp: int, device: str, *, store: dist.Store | None = None,
                     init_method: str | None = None, timeout_s: float = 600.0) -> None:
    """Join the world (``tp * pp`` ranks) and make the TP group of this rank's stage."""
    global _cpu_group, _tp_group
    backend = "nccl" if device == "cuda" else "gloo"
    world = tp * pp
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, store=store, rank=rank_, world_size=world,
                            timeout=timeout)
    _cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    _set(rank_, tp, pp)
    _tp_group = None
    for stage in range(pp):  # every rank creates every group, in the same order
        ranks = list(range(stage * tp, (stage + 1) * tp))
        group = dist.new_group(ranks, timeout=timeout) if pp > 1 else dist.group.WORLD
        if stage == _pp_rank:
            _tp_group = group


def destroy_distributed() -> None:
    global _cpu_group, _tp_group
    if dist.is_initialized():
        with contextlib.suppress(Exception):  # a peer may be gone already
            dist.destroy_process_group()
    _set(0, 1, 1)
    _cpu_group = _tp_group = None


@contextlib.contextmanager
def no_collectives() -> Iterator[None]:
    """Run a rank's layers on their own, skipping the TP all-reduces / all-gathers (partial sums come out):
    for timing a slice of the model on one rank, where each rank repeats it a different number of times."""
    global _timing
    old, _timing = _timing, True
    try:
        yield
    finally:
        _timing = old


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _tp_size > 1 and not _timing:
        dist.all_reduce(x, group=_tp_group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every TP rank's ``x`` along the last dimension (vocab shards of the LM head)."""
    if _tp_size == 1 or _timing:
        return x
    parts = [torch.empty_like(x) for _ in range(_tp_size)]
    dist.all_gather(parts, x.contiguous(), group=_tp_group)
    return torch.cat(parts, dim=-1)


# -- rank 0's messages: a typed header, then a typed payload (nothing received is unpickled) --------
# message kinds: a JSON value (uint8 UTF-8), the steps' inputs (int64 words), raw bytes of typed tensors a
# JSON header described (an adapter's weights: lora/wire.py)
JSON, STEPS, BYTES = 1, 2, 3
_PAYLOAD_DTYPES = {JSON: torch.uint8, STEPS: torch.int64, BYTES: torch.uint8}
MAX_MESSAGE_ELEMENTS = 1 << 30


def send_message(kind: int, payload: torch.Tensor) -> None:
    """Rank 0 sends ``payload`` (1-D, the kind's dtype) to every rank: a ``[kind, length]`` int64 header,
    then the payload: two broadcasts on the gloo group, as many as a pickled object took."""
    if payload.dtype != _PAYLOAD_DTYPES[kind] or payload.dim() != 1:
        raise TypeError(f"message kind {kind} carries a 1-D {_PAYLOAD_DTYPES[kind]} tensor, got "
                        f"{payload.dtype} {tuple(payload.shape)}")
    dist.broadcast(torch.tensor([kind, payload.numel()], dtype=torch.int64), src=0, group=_cpu_group)
    if payload.numel():
        dist.broadcast(payload.contiguous(), src=0, group=_cpu_group)


def recv_message() -> tuple[int, torch.Tensor]:
    """On a rank other than 0: the next message rank 0 sent, ``(kind, payload)``."""
    header = torch.empty(2, dtype=torch.int64)
    dist.broadcast(header, src=0, group=_cpu_group)
    kind, length = header.tolist()
    if kind not in _PAYLOAD_DTYPES or not 0 <= length <= MAX_MESSAGE_ELEMENTS:
        raise RuntimeError(f"rank 0 sent a malformed message header (kind {kind}, length {length})")
    payload = torch.empty(length, dtype=_PAYLOAD_DTYPES[kind])
    if length:
        dist.broadcast(payload, src=0, group=_cpu_group)
    return kind, payload


def encode_json(obj: object) -> torch.Tensor:
    data = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def decode_json(payload: torch.Tensor) -> object:
    return json.loads(payload.numpy().tobytes().decode())


def broadcast_json(obj: object = None) -> object:
    """Rank 0 sends ``obj`` (a JSON value: None, numbers, strings, lists, dicts with string keys) and
    returns it; every other rank returns what rank 0 sent (dict keys arrive as strings)."""
    if _rank == 0:
        send_message(JSON, encode_json(obj))
        return obj
    kind, payload = recv_message()
    if kind != JSON:
        raise RuntimeError(f"expected a JSON message from rank 0, got kind {kind}")
    return decode_json(payload)


def wait_for_ranks(timeout_s: float, what: str) -> None:
    """Return once every rank got here, waiting at most ``timeout_s`` (the join timeout).

    Loading weights and timing tactics can take one rank minutes longer than another (a host without a
    tactic table times its linears), far past the step timeout every later collective runs under: so the
    first collective after them is this barrier, under the join timeout, naming the rank that did not come.
    """
    if _cpu_group is None or _world == 1 or not dist.is_initialized():
        return
    try:
        dist.monitored_barrier(group=_cpu_group, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TimeoutError(f"not every rank finished {what} within join_timeout_s ({timeout_s:g}s): {first}") from None


def min_over_ranks(value: int) -> int:
    """The smallest ``value`` any rank holds (e.g. KV blocks every rank can afford)."""
    if _world == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_cpu_group)
    return int(t.item())


# -- pipeline point to point ----------------------------------------------------------------
def next_stage_peer() -> int:
    """The same TP rank in the next stage (activations go there)."""
    return global_rank(_pp_rank + 1, _tp_rank, _tp_size)


def prev_stage_peer() -> int:
    return global_rank(_pp_rank - 1, _tp_rank, _tp_size)


def last_stage_driver() -> int:
    """The rank that sends the logits to rank 0: TP rank 0 of the last stage."""
    return global_rank(_pp_size - 1, 0, _tp_size)


def isend(x: torch.Tensor, dst: int, tag: int) -> dist.Work:
    return dist.isend(x.contiguous(), dst, tag=tag)


def irecv(buf: torch.Tensor, src: int, tag: int) -> dist.Work:
    return dist.irecv(buf, src, tag=tag)
