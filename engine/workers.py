"""Rank processes for tensor and pipeline parallelism; rank 0 (the LLM's process) drives.

Rank layout: ``rank = pp_stage * tensor_parallel_size + tp_rank`` (see ``parallel.py``).
Rank 0 owns the scheduler and the sampler. Each step it broadcasts the step's
packed ``StepInputs`` (one per micro-batch, as int64 words: ``step_inputs.encode_steps``;
control messages are JSON; nothing a rank receives is unpickled) over the gloo group; every rank runs
its stage (``ModelRunner.run_stage``): stage 0 embeds, each stage runs its layers
and sends the activations to the next stage, the last stage computes the logits
and sends them to rank 0. ``None`` tells the ranks to exit; ``PING`` is the
driver's heartbeat while no step runs, so a rank waiting for work learns within
``distributed_timeout_s`` that the driver is gone, and the driver learns that a
rank is gone at the next heartbeat or step.

Where the ranks come from:

- ``distributed_address=None``: this process hosts every rank; ranks 1..n-1 are
  spawned here (one machine, one process tree; what ``tensor_parallel_size`` always did).
- ``distributed_address="HOST:PORT"``: ranks were started separately (pods of a
  LeaderWorkerSet, or ``kiln serve --rank``); this process hosts ``local_ranks``
  consecutive ranks from ``rank_offset``, spawning all but the first of them.
  Rank 0's process serves the store at HOST:PORT that every rank joins.

Before any tensor or message is exchanged, each rank proves to rank 0 that it holds the
group's token (``rendezvous.rendezvous``): ``$KILN_GROUP_TOKEN``, the same on every rank, for
ranks started separately; a fresh random one when this process spawns every rank itself.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import secrets
import threading
import time

import torch
import torch.distributed as dist
from kiln.engine import parallel, rendezvous
from kiln.engine.config import EngineConfig
from kiln.engine.errors import ConfigError
from kiln.engine.local_port import free_local_port
from kiln.engine.rendezvous import TOKEN_ENV
from kiln.engine.step_inputs import decode_steps

log = logging.getLogger("kiln.engine")

PING = "ping"
INSECURE_ENV = "KILN_INSECURE_GROUP"  # "1": ranks started separately join without $KILN_GROUP_TOKEN


def _threads_per_rank(local: int) -> int:
    """$OMP_NUM_THREADS when set (per rank), else this machine's cores shared among its ranks."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"])
    return max(1, (os.cpu_count() or 1) // local)


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def group_token(config: EngineConfig) -> str:
    """The secret every rank of this group proves it holds before it is counted (see ``rendezvous``).

    Ranks this process spawns itself (no ``distributed_address``) share a fresh random token; ranks
    started separately read ``$KILN_GROUP_TOKEN`` (the same on every rank), or join without one only
    when ``$KILN_INSECURE_GROUP=1`` says so."""
    if config.distributed_address is None:
        return secrets.token_hex(32)
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token:
        if len(token) < 16:
            raise ConfigError(f"${TOKEN_ENV} is {len(token)} characters; use at least 16 random characters "
                              "(e.g. `openssl rand -hex 32`), the same on every rank of the group")
        return token
    if os.environ.get(INSECURE_ENV, "").strip() == "1":
        log.warning("%s=1: this group's ranks join without a token; any process that reaches %s can join "
                    "as a rank or send the ranks steps", INSECURE_ENV, config.distributed_address)
        return ""
    raise ConfigError(f"ranks started separately (distributed_address {config.distributed_address}) need "
                      f"${TOKEN_ENV}: the same secret on every rank (e.g. `openssl rand -hex 32`); "
                      f"{INSECURE_ENV}=1 joins without one")


def _join(config: EngineConfig, rank: int, address: str, token: str) -> None:
    """Join the world as ``rank``: rank 0 serves the rendezvous store, the others connect to it.

    Joining waits up to ``join_timeout_s`` (pods start minutes apart); every collective
    after that waits at most ``distributed_timeout_s``.
    """
    host, port = _split_address(address)
    world = config.world_size
    who = "waiting for the other ranks to join" if rank == 0 else f"joining the leader at {address}"
    try:
        store = dist.TCPStore(host, port, world, is_master=rank == 0,
                              timeout=datetime.timedelta(seconds=config.join_timeout_s), wait_for_workers=False)
        # Every rank is here, each proven to hold the token, before the process groups form.
        rendezvous.rendezvous(store, rank, world, token, time.monotonic() + config.join_timeout_s)
        store.set_timeout(datetime.timedelta(seconds=config.distributed_timeout_s))
    except rendezvous.JoinRefusedError as exc:
        raise rendezvous.JoinRefusedError(f"rank {rank} of {world} (leader {address}): {exc}") from None
    except Exception as exc:
        raise RuntimeError(f"rank {rank} of {world}: {who} failed within join_timeout_s "
                           f"({config.join_timeout_s:.0f}s): {exc}") from None
    parallel.init_distributed(rank, config.tensor_parallel_size, config.pipeline_parallel_size, config.device,
                              store=store, timeout_s=config.distributed_timeout_s)


def _set_local_device(config: EngineConfig, local_index: int, spawned: bool) -> None:
    if config.device == "cpu":
        if spawned or config.local_ranks > 1:  # the ranks share this machine's cores
            torch.set_num_threads(_threads_per_rank(config.local_ranks))
    else:
        torch.cuda.set_device(local_index)


class RankGroup:
    """Rank 0's handle on the other ranks: local children, the heartbeat, the lock every step holds."""

    def __init__(self, config: EngineConfig) -> None:
        if dist.is_initialized():
            raise ConfigError("this process already runs a parallel engine; shut it down (LLM.shutdown()) "
                              "before starting another, or use tensor_parallel_size=1 and pipeline_parallel_size=1")
        self.config = config
        self.address = config.distributed_address or f"127.0.0.1:{free_local_port()}"
        token = group_token(config)
        self.procs = spawn_local_ranks(config, self.address, token)
        self.lock = threading.Lock()  # held by each step and each heartbeat: one collective at a time
        self.last_sent = time.monotonic()
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        _set_local_device(config, 0, spawned=False)
        try:
            _join(config, 0, self.address, token)
        except BaseException:
            self._kill_children()
            raise

    # -- liveness -----------------------------------------------------------------------------
    def start_heartbeat(self) -> None:
        """Ping the ranks when no step ran for a while (they time out waiting otherwise)."""
        if self.config.world_size > 1 and self._thread is None:
            self._thread = threading.Thread(target=self._heartbeat, name="kiln-heartbeat", daemon=True)
            self._thread.start()

    def _heartbeat(self) -> None:
        interval = self.config.heartbeat_interval_s
        while not self._stop.wait(interval / 2):
            with self.lock:
                if self._stop.is_set() or self.error is not None:
                    return
                if time.monotonic() - self.last_sent < interval:
                    continue
                try:
                    parallel.broadcast_json(PING)
                    self.last_sent = time.monotonic()
                except Exception as exc:
                    self.fail(f"a rank stopped answering the heartbeat: {exc}")
                    return

    def fail(self, why: str) -> None:
        if self.error is None:
            self.error = why
            log.error("parallel engine failed: %s", why)

    def check(self) -> None:
        """Raise if any rank is known to be gone: the engine cannot continue without it."""
        for proc in self.procs:
            if not proc.is_alive():
                self.fail(f"rank process {proc.name} exited (code {proc.exitcode})")
        if self.error is not None:
            raise RuntimeError(f"the parallel engine lost a rank and cannot continue: {self.error}")

    def step_done(self) -> None:
        self.last_sent = time.monotonic()

    # -- shutdown -------------------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()
        with self.lock:
            if self.error is None:
                try:
                    parallel.broadcast_json(None)
                except Exception as exc:  # a rank is gone: nobody to tell
                    log.warning("could not tell the ranks to stop: %s", exc)
        for p in self.procs:
            p.join(timeout=30)
        self._kill_children()
        parallel.destroy_distributed()

    def _kill_children(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)


def spawn_local_ranks(config: EngineConfig, address: str, token: str) -> list[mp.process.BaseProcess]:
    """Start the ranks this process hosts after its first one, as child processes."""
    ctx = mp.get_context("spawn")
    first = config.rank_offset
    procs = [ctx.Process(target=rank_main, args=(config, rank, address, rank - first, token), daemon=True,
                         name=f"kiln-rank-{rank}") for rank in range(first + 1, first + config.local_ranks)]
    for p in procs:
        p.start()
    return procs


def rank_main(config: EngineConfig, rank: int, address: str, local_index: int, token: str,
              spawned: bool = True) -> None:
    """One non-driver rank: join, load this rank's shard, run the steps rank 0 broadcasts."""
    from kiln.engine.lora import wire as lora_wire
    from kiln.engine.model_runner import ModelRunner

    _set_local_device(config, local_index, spawned)
    _join(config, rank, address, token)
    clean = False
    try:
        runner = ModelRunner(config)
        while True:
            kind, payload = parallel.recv_message()
            if kind == parallel.STEPS:
                runner.run_stage(decode_steps(payload))
                continue
            msg = parallel.decode_json(payload)
            if msg is None:
                clean = True
                break
            if isinstance(msg, dict) and lora_wire.SLOT_KEY in msg and runner.lora is not None:
                runner.lora.load_weights(msg[lora_wire.SLOT_KEY], msg.get("int_id", 0), lora_wire.recv_slot(msg))
                continue
            if msg != PING:
                raise RuntimeError(f"rank 0 sent an unknown control message {msg!r}")
    finally:
        if clean:
            parallel.destroy_distributed()


def run_worker_node(config: EngineConfig) -> int:
    """A process started separately that hosts ranks ``rank_offset..`` (not rank 0): run until rank 0
    says stop (exit code 0) or the group breaks (1: a rank or the leader is gone, a collective timed
    out). It never serves requests; rank 0's process does."""
    if config.rank_offset == 0 or config.distributed_address is None:
        raise ConfigError("run_worker_node is for ranks other than 0 with a distributed_address; "
                          "rank 0 runs the engine (LLM / AsyncLLM / kiln serve)")
    address = config.distributed_address
    token = group_token(config)
    procs = spawn_local_ranks(config, address, token)
    code = 0
    try:
        rank_main(config, config.rank_offset, address, 0, token, spawned=False)
        log.info("rank %d: the leader stopped the engine; exiting", config.rank_offset)
    except rendezvous.JoinRefusedError as exc:
        log.error("%s", exc)
        code = 1
    except Exception as exc:
        log.error("rank %d of %d: the engine group broke (%s); exiting 1 so the group restarts",
                  config.rank_offset, config.world_size, exc)
        code = 1
    for p in procs:
        p.join(timeout=10 if code == 0 else 1)
        if p.is_alive():
            p.terminate()
        elif p.exitcode:
            code = 1
    parallel.destroy_distributed()
    return code
