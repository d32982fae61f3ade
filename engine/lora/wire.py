"""Adapters across ranks: rank 0 sends the weights of each adapter it puts in a device slot to the other ranks.

Ranks started separately (the pods of a LeaderWorkerSet) have no copy of an adapter's files, and need none:
rank 0 read and checked the adapter (``adapter.load_adapter``), so when the scheduler assigns it a slot rank 0
sends, before the step that uses it, a JSON header (the slot, the adapter's int_id, and per tensor its layer,
linear, part, ``A``/``B``, shape and dtype) and then every tensor's bytes as one ``uint8`` message: typed
messages over the authenticated rank channel, nothing unpickled. An emptied slot is a header with no tensors.
Each rank fills its slot from what it received and keeps nothing else: no files, no host cache. The cost is
one broadcast of the adapter (a few MB at rank 16) per slot load, which the scheduler makes only when an
adapter is not already on the device.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from kiln.engine import parallel

SLOT_KEY = "lora_slot"  # a JSON control message carrying this key is a slot load
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

Weights = dict[tuple[int, str], dict[Any, tuple[torch.Tensor, torch.Tensor]]]


def slot_header(slot: int, int_id: int, weights: Weights) -> tuple[dict[str, Any], torch.Tensor]:
    """The header and the byte payload that put ``weights`` (an adapter's, or {} to empty) in ``slot``."""
    tensors, blobs = [], []
    for (layer, name), parts in weights.items():
        for part, pair in parts.items():
            for half, t in zip("AB", pair, strict=True):
                t = t.detach().contiguous().cpu()
                tensors.append([layer, name, part, half, list(t.shape), str(t.dtype).removeprefix("torch.")])
                blobs.append(t.reshape(-1).view(torch.uint8))
    payload = torch.cat(blobs) if blobs else torch.empty(0, dtype=torch.uint8)
    return {SLOT_KEY: slot, "int_id": int_id, "tensors": tensors}, payload


def send_slot(slot: int, adapter: Any) -> None:
    """Rank 0: tell every rank to put ``adapter`` (None: nothing) in ``slot``."""
    header, payload = slot_header(slot, 0 if adapter is None else adapter.int_id,
                                  {} if adapter is None else adapter.weights)
    parallel.broadcast_json(header)
    parallel.send_message(parallel.BYTES, payload)


def recv_slot(header: dict[str, Any]) -> Weights:
    """A rank other than 0, given a slot load's header: read its payload, return the weights by linear."""
    kind, payload = parallel.recv_message()
    if kind != parallel.BYTES:
        raise RuntimeError(f"malformed LoRA slot message: expected its tensors' bytes, got message kind {kind}")
    return recv_slot_weights(header, payload)


def _malformed(why: str) -> RuntimeError:
    return RuntimeError(f"rank 0 sent a malformed LoRA slot message: {why}")


def recv_slot_weights(header: dict[str, Any], payload: torch.Tensor) -> Weights:
    """The weights a header and its payload describe; raises if they do not match exactly."""
    weights: Weights = {}
    at, halves = 0, []
    entries = header.get("tensors")
    if not isinstance(entries, list):
        raise _malformed("no tensor list")
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 6):
            raise _malformed(f"tensor entry {entry!r}")
        layer, name, part, half, shape, dtype = entry
        if (not isinstance(layer, int) or name not in LINEARS or half not in ("A", "B") or dtype not in DTYPES
                or not isinstance(shape, list) or len(shape) != 2
                or not all(isinstance(n, int) and n >= 0 for n in shape)):
            raise _malformed(f"tensor entry {entry!r}")
        dt = DTYPES[dtype]
        size = math.prod(shape) * dt.itemsize
        if at + size > payload.numel():
            raise _malformed(f"{payload.numel()} bytes, fewer than its tensors need")
        halves.append(((layer, name), part, half, payload[at:at + size].clone().view(dt).view(shape)))
        at += size
    if at != payload.numel():
        raise _malformed(f"{payload.numel() - at} bytes left over")
    if len(halves) % 2:
        raise _malformed("an A without its B")
    for (key, part, ha, a), (key_b, part_b, hb, b) in zip(halves[::2], halves[1::2], strict=True):
        if (key, part, ha, hb) != (key_b, part_b, "A", "B"):
            raise _malformed(f"A of {key}/{part} followed by B of {key_b}/{part_b}")
        weights.setdefault(key, {})[part] = (a, b)
    return weights
