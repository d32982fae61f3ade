"""The KV pool tensors: one [2, layers, kv_heads, blocks, block_size, head_dim] allocation.

Its size is ``num_kv_blocks`` when given; otherwise what ``kv_memory_fraction``
of the free device memory holds (RAM on CPU), capped at what
``max_batch_size`` requests of ``max_seq_len`` tokens could ever use.

CUDA graphs are captured after the pool is allocated. An artifact's ``num_kv_blocks``
was planned by ``kiln build`` with the graphs' memory, measured on the build GPU,
left out; without ``num_kv_blocks`` the graphs get only what ``1 - kv_memory_fraction``
of the free memory leaves, so on a GPU pass ``num_kv_blocks`` or ``enforce_eager``
where that is not enough.
"""

from __future__ import annotations

import math
import os

import torch
from kiln.engine.config import EngineConfig
from kiln.engine.host_pages import anonymous
from kiln.engine.layers.attention import Attention
from torch import nn


def bytes_per_block(config: EngineConfig, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    elem = torch.empty(0, dtype=config.kv_torch_dtype).element_size()
    return 2 * num_layers * config.block_size * num_kv_heads * head_dim * elem


def free_memory_bytes(device: str) -> int:
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        return free
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 4 << 30


def plan_num_blocks(config: EngineConfig, block_bytes: int) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    useful = config.max_batch_size * -(-config.max_seq_len // config.block_size)
    affordable = int(free_memory_bytes(config.device) * config.kv_memory_fraction) // block_bytes
    return max(1, min(useful, affordable))


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """A zero tensor; on CPU a private anonymous mapping: the OS hands out zero pages on first touch, so a pool of
    gigabytes costs nothing at start-up (torch.zeros writes every page before the first request: 0.2-2 s of the
    bench model's start) and each page is paid for when a block first fills. In 4 KiB pages, never huge ones: a
    token's K and V land in a page of their own per layer and KV head (``[.., kv_heads, blocks, ..]``), so a first
    token touching 2 MiB huge pages zeroes 2 MiB for each (numpy's zeros, which asked for them: 360 MiB and
    0.4-0.6 s CPU for SmolLM2's first token, 180 huge pages, where 4 KiB pages cost 1.5 ms)."""
    if device != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return anonymous(math.prod(shape) * dtype.itemsize, huge=False).view(dtype).view(shape)


def allocate_kv_cache(model: nn.Module, config: EngineConfig, num_blocks: int) -> torch.Tensor:
    """Allocate the pool and bind each attention layer's views of it."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    a = layers[0]
    shape = (2, len(layers), a.num_kv_heads, num_blocks, config.block_size, a.head_dim)
    cache = _zeroed(shape, config.kv_torch_dtype, config.device)
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = cache[0, i], cache[1, i]
    return cache
