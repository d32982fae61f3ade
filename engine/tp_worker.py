"""Tensor-parallel worker processes: ranks 1..n-1 run the model; rank 0 (the LLM's process) drives.

Rank 0 owns the scheduler and the sampler. Each step it broadcasts the packed
``StepInputs`` over the gloo group; every rank runs ``ModelRunner.execute``
on its shard, the row-parallel layers all-reduce, and the LM head all-gathers
the vocabulary so rank 0 has full logits. ``None`` tells the workers to exit.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket

import torch
from kiln.engine import parallel
from kiln.engine.config import EngineConfig
from kiln.engine.errors import ConfigError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _threads_per_rank(size: int) -> int:
    return max(1, (os.cpu_count() or 1) // size)


def start_workers(config: EngineConfig) -> list[mp.process.BaseProcess]:
    """Spawn ranks 1..n-1 and join the process group as rank 0 (blocks until all have joined)."""
    size = config.tensor_parallel_size
    if torch.distributed.is_initialized():
        raise ConfigError("this process already runs a tensor-parallel engine; shut it down (LLM.shutdown()) "
                          "before starting another, or use tensor_parallel_size=1")
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker_main, args=(config, rank, init_method), daemon=True,
                         name=f"kiln-tp-rank-{rank}") for rank in range(1, size)]
    for p in procs:
        p.start()
    if config.device == "cpu":
        torch.set_num_threads(_threads_per_rank(size))  # the ranks share the machine's cores
    else:
        torch.cuda.set_device(0)
    parallel.init_distributed(0, size, init_method, config.device)
    return procs


def stop_workers(procs: list[mp.process.BaseProcess]) -> None:
    try:
        parallel.broadcast_object(None)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        parallel.destroy_distributed()


def worker_main(config: EngineConfig, rank: int, init_method: str) -> None:
    from kiln.engine.model_runner import ModelRunner

    if config.device == "cpu":
        torch.set_num_threads(_threads_per_rank(config.tensor_parallel_size))
    else:
        torch.cuda.set_device(rank)
    parallel.init_distributed(rank, config.tensor_parallel_size, init_method, config.device)
    try:
        runner = ModelRunner(config)
        while True:
            inputs = parallel.broadcast_object()
            if inputs is None:
                break
            runner.execute(inputs)
    finally:
        parallel.destroy_distributed()
