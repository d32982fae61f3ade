"""What the ahead-of-time check compiles (``aot.compile_all``): each Triton kernel kiln ships, through its own
launch wrapper, at the constexprs real envelopes give it.

- paged decode (split + combine) and prefill attention: head sizes 64 and 128, GQA groups 1, 4 and 8,
  16-token blocks, bf16 / fp16 / float32 caches (``EngineConfig.kv_cache_dtype``: the engine has no fp8
  cache), prefill chunks short (16 x 32 tiles) and long (the capability's and dtype's long-chunk tile);
- the int8 weight-only GEMM: every autotune configuration, bf16 / fp16 / float32 activations.

fp8 linears run ``torch._scaled_mm`` (cuBLAS), not a kiln kernel: nothing to compile here.

``quick``: the set ``make test`` compiles (``slow`` tests and ``kernels_aot`` compile all of it): every
kernel on every capability, every int8 configuration with every activation dtype (one fp16-only spill was
found there), attention at both head sizes and chunk tiles for bf16 and float32 caches at GQA groups 1 and
8. It leaves out the fp16 caches (the tiles of bf16: both 2-byte; the full table shows the same registers
and shared memory) and group 4 (between 1 and 8 in rows per tile).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

HEAD_DIMS = (64, 128)
GQA_GROUPS = (1, 4, 8)
BLOCK_SIZE = 16
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PREFILL_LENGTHS = (16, 512)  # a short chunk and a long one: both tile sizes
KV_HEADS = 2


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _attention(capability: int, head_dim: int, group: int, dtype: torch.dtype) -> list[tuple[str, Callable]]:
    from kiln.engine.kernels.paged_attention_decode import paged_decode
    from kiln.engine.kernels.paged_attention_prefill import paged_prefill

    heads = KV_HEADS * group
    cache = torch.empty(KV_HEADS, 8, BLOCK_SIZE, head_dim, dtype=dtype)
    tables = torch.zeros(2, 8, dtype=torch.int32)
    lens = torch.full((2,), 100, dtype=torch.int32)
    out = []
    tag = f"d{head_dim} g{group} {_name(dtype)}"

    def decode():
        q = torch.empty(2, heads, head_dim, dtype=dtype)
        paged_decode(q, cache, cache, tables, lens, 0.1, 4, torch.empty_like(q), capability=capability)

    out.append((f"decode {tag}", decode))
    for length in PREFILL_LENGTHS:
        def prefill(length=length):
            q = torch.empty(length, heads, head_dim, dtype=dtype)
            starts = torch.tensor([0, length], dtype=torch.int32)
            paged_prefill(q, cache, cache, tables[:1], starts, lens[:1], length, 0.1, torch.empty_like(q),
                          capability=capability)

        out.append((f"prefill {tag} chunk{length}", prefill))
    return out


def _int8(dtype: torch.dtype) -> tuple[str, Callable]:
    from kiln.engine.kernels.int8_gemm import int8_weight_only_linear

    def gemm():
        weight, scale = torch.empty(256, 512, dtype=torch.int8), torch.empty(256, dtype=torch.float32)
        int8_weight_only_linear(torch.empty(512, 512, dtype=dtype), weight, scale)  # M 512: no config pruned

    return f"int8 gemm {_name(dtype)} (every config)", gemm


QUICK_ATTENTION_DTYPES = (torch.bfloat16, torch.float32)
QUICK_GQA_GROUPS = (1, 8)


def variants(capability: int, quick: bool = False) -> list[tuple[str, Callable]]:
    """(what, launch) for every compiled variant on ``capability`` (``quick``: the make-test set, above)."""
    out = []
    for dtype in DTYPES:
        if not quick or dtype in QUICK_ATTENTION_DTYPES:
            for head_dim in HEAD_DIMS:
                for group in QUICK_GQA_GROUPS if quick else GQA_GROUPS:
                    out += _attention(capability, head_dim, group, dtype)
        out.append(_int8(dtype))
    return out
