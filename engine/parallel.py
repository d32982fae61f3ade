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
import hashlib
import hmac
import json
import logging
import secrets
import time
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
TOKEN_ENV = "KILN_GROUP_TOKEN"


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
class JoinRefusedError(RuntimeError):
    """The group token of this rank and of the leader differ (or something else answered as the leader)."""


_NONCE, _PROOF, _VERDICT = "kiln/auth/nonce", "kiln/auth/proof/{}", "kiln/auth/verdict/{}"


def _mac(token: str, *fields: object) -> str:
    message = "|".join(("kiln-join-v1", *map(str, fields))).encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())  # constant time, any text (a forged proof may be anything)


def _json_or_empty(raw: bytes) -> dict:
    with contextlib.suppress(ValueError, UnicodeDecodeError):
        value = json.loads(raw.decode())
        if isinstance(value, dict):
            return {k: str(v) for k, v in value.items()}
    return {}


def rendezvous(store: dist.Store, rank_: int, world: int, token: str, deadline: float) -> None:
    """Return once every rank of ``world`` proved it holds ``token``, by ``deadline`` (``time.monotonic``).

    The store is unauthenticated, so nothing in it counts by itself: rank 0 writes a fresh nonce; rank
    ``r`` writes ``{nonce: n_r, proof: HMAC(token, nonce, world, r, n_r)}`` (``n_r`` its own fresh nonce)
    at ``kiln/auth/proof/r``; rank 0 admits ``r`` only for a proof it verifies (a wrong one is logged and
    answered ``refused``), and once all ``world - 1`` are admitted writes each rank's verdict, an
    ``HMAC(token, "admit", ...)`` over that rank's ``n_r``, which the rank checks before it goes on.
    """
    if rank_ == 0:
        _admit(store, world, token, deadline)
    else:
        _prove(store, rank_, world, token, deadline)


def _admit(store: dist.Store, world: int, token: str, deadline: float) -> None:
    nonce = secrets.token_hex(16)
    store.set(_NONCE, nonce)
    admitted: dict[int, str] = {}
    seen: dict[int, bytes] = {}
    refused = 0
    while len(admitted) < world - 1:
        for r in range(1, world):
            key = _PROOF.format(r)
            if r in admitted or not store.check([key]) or (raw := store.get(key)) == seen.get(r):
                continue
            seen[r] = raw
            claim = _json_or_empty(raw)
            theirs = claim.get("nonce", "")
            if theirs and _same(claim.get("proof", ""), _mac(token, "join", nonce, world, r, theirs)):
                admitted[r] = theirs
                continue
            refused += 1
            log.warning("refused a process joining as rank %d of %d: its proof of $%s does not match this "
                        "leader's (a rank with another token, or not a rank of this group)", r, world, TOKEN_ENV)
            store.set(_VERDICT.format(r), json.dumps({"nonce": theirs, "refused": "1"}))
        if len(admitted) < world - 1 and time.monotonic() > deadline:
            missing = [r for r in range(1, world) if r not in admitted]
            raise TimeoutError(f"{len(admitted) + 1} of {world} ranks joined (missing: ranks {missing})"
                               + (f"; refused {refused} join(s) whose ${TOKEN_ENV} differs" if refused else ""))
        time.sleep(0.05)
    for r, theirs in admitted.items():
        mac = _mac(token, "admit", nonce, world, r, theirs)
        store.set(_VERDICT.format(r), json.dumps({"nonce": theirs, "mac": mac}))


def _prove(store: dist.Store, rank_: int, world: int, token: str, deadline: float) -> None:
    while not store.check([_NONCE]):
        if time.monotonic() > deadline:
            raise TimeoutError("the leader's store is up but it has not started the rendezvous")
        time.sleep(0.05)
    nonce, mine = store.get(_NONCE).decode(), secrets.token_hex(16)
    proof = _mac(token, "join", nonce, world, rank_, mine)
    store.set(_PROOF.format(rank_), json.dumps({"nonce": mine, "proof": proof}))
    key = _VERDICT.format(rank_)
    while True:
        verdict = _json_or_empty(store.get(key)) if store.check([key]) else {}
        if verdict.get("nonce") == mine:
            if verdict.get("refused"):
                raise JoinRefusedError(f"the leader refused this rank: its ${TOKEN_ENV} differs from the "
                                       f"leader's (every rank of a group needs the same ${TOKEN_ENV})")
            if _same(verdict.get("mac", ""), _mac(token, "admit", nonce, world, rank_, mine)):
                return
            raise JoinRefusedError(f"the leader did not prove it holds this rank's ${TOKEN_ENV}: the tokens "
                                   "differ, or another process answered at the leader's address")
        if time.monotonic() > deadline:
            raise TimeoutError("the leader has not admitted every rank")
        time.sleep(0.05)


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
JSON, STEPS = 1, 2  # message kinds: a JSON value (uint8 UTF-8), the steps' inputs (int64 words)
_PAYLOAD_DTYPES = {JSON: torch.uint8, STEPS: torch.int64}
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
