"""The Triton paged-attention kernels against a plain PyTorch reference, and the engine on them.

Without CUDA every kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, set here before
triton is imported) on CPU tensors, at small shapes; with CUDA the same tests run natively, plus a
``gpu`` test at a real decode shape that reports the kernel's achieved bandwidth.
"""

from __future__ import annotations

import os
import random
import time

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install 'kiln[test]')")

from engine_testlib import random_prompts  # noqa: E402
from kiln.engine import SamplingParams  # noqa: E402
from kiln.engine.kernels.paged_attention_decode import paged_decode  # noqa: E402
from kiln.engine.kernels.paged_attention_prefill import paged_prefill  # noqa: E402
from kiln.engine.layers.attention import Attention  # noqa: E402
from kiln.engine.layers.paged_metadata import num_splits  # noqa: E402

pytestmark = pytest.mark.kernels
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(q, k_cache, v_cache, block_tables, query_start, seq_lens, scale):
    """Each sequence's queries (rows query_start[i]:query_start[i+1], the last tokens of its
    seq_lens[i]) attend its context causally, keys looked up block by block; float32 math."""
    kvh, _, block_size, _ = k_cache.shape
    group = q.shape[1] // kvh
    out = torch.empty_like(q)
    for i, ctx in enumerate(seq_lens.tolist()):
        start, end = int(query_start[i]), int(query_start[i + 1])
        pos = torch.arange(ctx, device=q.device)
        blocks = block_tables[i].long()[pos // block_size]
        keys = k_cache[:, blocks, pos % block_size].float().repeat_interleave(group, 0)  # [heads, ctx, d]
        vals = v_cache[:, blocks, pos % block_size].float().repeat_interleave(group, 0)
        scores = q[start:end].float().transpose(0, 1) @ keys.transpose(1, 2) * scale  # [heads, q, ctx]
        q_pos = ctx - (end - start) + torch.arange(end - start, device=q.device)
        scores.masked_fill_(pos[None, :] > q_pos[:, None], float("-inf"))
        out[start:end] = (torch.softmax(scores, -1) @ vals).transpose(0, 1).to(q.dtype)
    return out


def make_pool(seq_lens, kv_heads, block_size, head_dim, dtype, seed=0):
    """A pool with one shuffled, distinct block list per sequence (plus unused blocks), filled with noise."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(perm[at:at + n])
        at += n
    shape = (kv_heads, num_blocks, block_size, head_dim)
    k = torch.randn(shape, generator=g).to(DEVICE, dtype)
    v = torch.randn(shape, generator=g).to(DEVICE, dtype)
    return k, v, tables.to(DEVICE)


TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,splits,dtype", [
    (4, 2, 16, 16, 1, torch.float32),   # GQA, the toy models' head size
    (4, 4, 32, 32, 4, torch.float32),   # MHA, split-K with empty splits for short rows
    (8, 1, 64, 16, 2, torch.float16),   # MQA, half precision
    (6, 2, 24, 32, 3, torch.float32),   # a head size that is not a power of two, an odd split count
])
def test_decode_matches_reference(heads, kv_heads, head_dim, block_size, splits, dtype):
    seq_lens = [1, 17, 64, 100, 33, 129]  # ragged: one token, block edges, several tiles
    k, v, tables = make_pool(seq_lens, kv_heads, block_size, head_dim, dtype)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = paged_decode(q, k, v, tables, lens, head_dim ** -0.5, splits, torch.empty_like(q))
    query_start = torch.arange(len(seq_lens) + 1)
    torch.testing.assert_close(out, reference(q, k, v, tables, query_start, lens, head_dim ** -0.5), **TOL[dtype])


@pytest.mark.parametrize("heads,kv_heads,block_size,chunks", [
    # (q_len, seq_len) per packed chunk: a whole prompt, a prefix hit, a middle chunk of a chunked prefill
    (4, 2, 16, [(5, 5), (7, 40), (20, 52), (1, 9)]),
    (2, 2, 32, [(13, 13), (3, 70), (33, 65)]),
    (4, 1, 16, [(70, 90), (9, 9)]),  # a chunk long enough for 64-query tiles
])
def test_prefill_matches_reference(heads, kv_heads, block_size, chunks):
    head_dim = 16
    k, v, tables = make_pool([n for _, n in chunks], kv_heads, block_size, head_dim, torch.float32, seed=2)
    rows = 3 + sum(q for q, _ in chunks)  # three leading rows stand for the step's decodes
    q = torch.randn(rows, heads, head_dim, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    starts = [3]
    for q_len, _ in chunks:
        starts.append(starts[-1] + q_len)
    query_start = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([n for _, n in chunks], dtype=torch.int32, device=DEVICE)
    out = torch.zeros_like(q)
    paged_prefill(q, k, v, tables, query_start, lens, max(c for c, _ in chunks), 0.25, out)
    expected = reference(q, k, v, tables, query_start, lens, 0.25)
    torch.testing.assert_close(out[3:], expected[3:], rtol=1e-4, atol=1e-4)
    assert out[:3].abs().max() == 0  # rows outside the chunks are not written


def test_num_splits_rule():
    assert num_splits(64, 8, 1024) == 1  # 512 programs already
    assert num_splits(1, 8, 1024) == 4  # capped by the 256-token minimum split (4 x 256)
    assert num_splits(1, 1, 1 << 20) == 32  # capped by the maximum
    assert num_splits(4, 2, 100) == 1


def test_engine_triton_equals_torch(toy_model, make_llm, monkeypatch):
    """Greedy tokens of a mixed batch, chunked prefill and a prefix hit, are the same on both backends."""
    launches = []  # (decode rows, longest prefill chunk) of every layer call on the Triton path
    paged = Attention._forward_paged
    monkeypatch.setattr(Attention, "_forward_paged", lambda self, q, nd, md: (
        launches.append((nd, md.max_prefill_len)), paged(self, q, nd, md))[1])
    model_dir = toy_model("llama-tiny")
    shared = random_prompts([40], seed=7)[0][1:]
    prompts = random_prompts([45, 52], seed=2, prefix=shared) + random_prompts([9, 23], seed=3)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 4, 7, 5)]
    kwargs = dict(num_kv_blocks=32, block_size=16, max_num_tokens=24, max_batch_size=4, device=DEVICE)
    outs = {}
    for backend in ("torch", "triton"):
        llm = make_llm(model_dir, attention_backend=backend, **kwargs)
        assert llm.engine.runner.attention_backend == backend
        first = llm.generate(prompts[:1], params[:1])  # fills the prefix cache
        rest = llm.generate(prompts[1:], params[1:])
        assert rest[0].num_cached_tokens == 32  # two full blocks of the shared prefix
        outs[backend] = [o.token_ids for o in first + rest]
    assert outs["triton"] == outs["torch"]
    assert any(nd and chunk for nd, chunk in launches)  # mixed steps: both kernels in one layer call
    assert any(chunk == 24 for _, chunk in launches)  # a prompt split by the 24-token budget


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_bandwidth_at_real_shape():
    """64 sequences x 1k context, 32 query / 8 KV heads, d=128, bf16: matches the reference, and the
    kernel's achieved bandwidth (bytes of K+V read / time) is printed (docs/gpu.md)."""
    seqs, ctx, heads, kv_heads, d, bs = 64, 1024, 32, 8, 128, 16
    rng = random.Random(0)
    lens = [ctx] * seqs
    k, v, tables = make_pool(lens, kv_heads, bs, d, torch.bfloat16)
    q = torch.randn(seqs, heads, d, device=DEVICE, dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    splits = num_splits(seqs, kv_heads, ctx)
    out = paged_decode(q, k, v, tables, seq_lens, d ** -0.5, splits, torch.empty_like(q))
    query_start = torch.arange(seqs + 1)
    pick = rng.sample(range(seqs), 4)  # the reference is slow: check a few rows
    ref = reference(q, k, v, tables, query_start, seq_lens, d ** -0.5)
    torch.testing.assert_close(out[pick], ref[pick], **TOL[torch.bfloat16])
    for _ in range(3):
        paged_decode(q, k, v, tables, seq_lens, d ** -0.5, splits, out)
    torch.cuda.synchronize()
    iters = 50
    start = time.perf_counter()
    for _ in range(iters):
        paged_decode(q, k, v, tables, seq_lens, d ** -0.5, splits, out)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / iters
    kv_bytes = 2 * seqs * ctx * kv_heads * d * k.element_size()
    print(f"\npaged decode {seqs}x{ctx} {heads}q/{kv_heads}kv d={d} bf16, {splits} split(s): "
          f"{seconds * 1e6:.1f} us, {kv_bytes / seconds / 1e9:.0f} GB/s")
