"""Which ranks this ``kiln serve`` process hosts when an engine spans processes started separately.

Two sources, flags first:

- ``--rank R --world-size W --leader-address HOST[:PORT]``: this process is exactly rank R
  of W (one rank per process; W = tensor_parallel_size x pipeline_parallel_size);
- a LeaderWorkerSet's environment: ``LWS_LEADER_ADDRESS`` (the leader pod's host name),
  ``LWS_GROUP_SIZE`` (pods in the group) and ``LWS_WORKER_INDEX`` (this pod, 0 = leader).
  Each pod hosts W / LWS_GROUP_SIZE consecutive ranks: pod i holds ranks
  ``i*k .. i*k+k-1`` (``k = W / LWS_GROUP_SIZE``); with ``k = tensor_parallel_size`` a pod
  is one pipeline stage, tensor parallel over its own GPUs (the layout the issue asks for).

Rank 0's process (the leader) serves the OpenAI API; the others only compute.
The rendezvous port is the PORT in ``--leader-address`` or ``--leader-port`` (default 29500).
Every process of such a group needs the same ``$KILN_GROUP_TOKEN`` (its ranks prove they hold it
before they are counted; ``kiln.engine.workers.group_token``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import click

DEFAULT_PORT = 29500


class PlacementError(click.UsageError, ValueError):
    """A rank/world/LeaderWorkerSet setting that cannot place this process (names the flag or variable)."""


@dataclass(frozen=True)
class Placement:
    host: str
    port: int
    rank: int | None = None          # --rank (one rank per process)
    world_size: int | None = None    # --world-size
    group_size: int | None = None    # LWS_GROUP_SIZE (pods)
    worker_index: int | None = None  # LWS_WORKER_INDEX
    timeout_s: float | None = None
    join_timeout_s: float | None = None

    @property
    def is_leader(self) -> bool:
        return (self.rank if self.rank is not None else self.worker_index) == 0

    def describe(self) -> str:
        if self.rank is not None:
            return f"rank {self.rank} of {self.world_size} (leader {self.host}:{self.port})"
        return f"pod {self.worker_index} of {self.group_size} (leader {self.host}:{self.port})"

    def engine_kwargs(self, tp: int, pp: int) -> dict[str, Any]:
        """``LLM(...)`` keywords that place this process's ranks in a world of ``tp * pp`` ranks."""
        world = tp * pp
        if self.rank is not None:
            if self.world_size != world:
                raise PlacementError(
                    f"--world-size {self.world_size} must equal tensor_parallel_size {tp} x pipeline_parallel_size "
                    f"{pp} = {world} (one rank per process); give every process the same sizes")
            offset, local = self.rank, 1
        else:
            assert self.group_size is not None and self.worker_index is not None
            if world % self.group_size:
                raise PlacementError(
                    f"LWS_GROUP_SIZE {self.group_size} must divide the engine's {world} ranks (tensor_parallel_size "
                    f"{tp} x pipeline_parallel_size {pp}): each pod hosts the same number of ranks; set the "
                    f"LeaderWorkerSet size to {pp} (one pipeline stage per pod) or {world} (one rank per pod)")
            local = world // self.group_size
            offset = self.worker_index * local
        kwargs: dict[str, Any] = {"distributed_address": f"{self.host}:{self.port}", "rank_offset": offset,
                                  "local_ranks": local}
        if self.timeout_s is not None:
            kwargs["distributed_timeout_s"] = self.timeout_s
        if self.join_timeout_s is not None:
            kwargs["join_timeout_s"] = self.join_timeout_s
        return kwargs


def _split(address: str, default_port: int, flag: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or "]" in port:  # no port given (or a bare IPv6 literal)
        return address.strip("[]"), default_port
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PlacementError(f"{flag} must be HOST or HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def _env_int(env: Mapping[str, str], name: str, minimum: int) -> int:
    raw = env.get(name, "")
    try:
        value = int(raw)
    except ValueError:
        raise PlacementError(f"${name} must be an integer >= {minimum}, got {raw!r}") from None
    if value < minimum:
        raise PlacementError(f"${name} must be >= {minimum}, got {value}")
    return value


def resolve_placement(rank: int | None, world_size: int | None, leader_address: str | None, leader_port: int,
                      env: Mapping[str, str], timeout_s: float | None = None,
                      join_timeout_s: float | None = None) -> Placement | None:
    """The placement from flags, else from a LeaderWorkerSet's environment; None = one machine."""
    flags = {"--rank": rank, "--world-size": world_size, "--leader-address": leader_address}
    if any(v is not None for v in flags.values()):
        missing = [k for k, v in flags.items() if v is None]
        if missing:
            raise PlacementError(f"{', '.join(missing)} missing: a separately started rank needs --rank, "
                                   "--world-size and --leader-address (rank 0's HOST[:PORT]) together")
        if not 0 <= rank < world_size:
            raise PlacementError(f"--rank {rank} must be in [0, --world-size {world_size})")
        host, port = _split(leader_address, leader_port, "--leader-address")
        return Placement(host, port, rank=rank, world_size=world_size, timeout_s=timeout_s,
                         join_timeout_s=join_timeout_s)
    if not env.get("LWS_LEADER_ADDRESS"):
        return None
    group = _env_int(env, "LWS_GROUP_SIZE", 1)
    index = _env_int(env, "LWS_WORKER_INDEX", 0)
    if index >= group:
        raise PlacementError(f"$LWS_WORKER_INDEX {index} must be below $LWS_GROUP_SIZE {group}")
    if group == 1:
        return None  # a group of one pod: every rank on this machine
    host, port = _split(env["LWS_LEADER_ADDRESS"], leader_port, "$LWS_LEADER_ADDRESS")
    return Placement(host, port, group_size=group, worker_index=index, timeout_s=timeout_s,
                     join_timeout_s=join_timeout_s)
