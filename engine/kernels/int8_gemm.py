"""Weight-only int8 GEMM in Triton: ``y = x @ (W_q * s).T + b`` with the weight int8 in memory.

``x [M, K]`` is fp16, bf16 or fp32; ``W_q [N, K]`` int8 (row-major, as loaded from the
artifact); ``s [N]`` one float32 scale per output channel. Each program computes a
``BLOCK_M x BLOCK_N`` tile of ``y``: it streams ``BLOCK_K``-wide tiles of ``x`` and of ``W_q``,
converts the int8 tile to the activation dtype in registers (exact: ``|q| <= 127``) and
accumulates ``tl.dot`` in float32; the per-channel scale and the bias are applied once, in the
epilogue (the scale of an output channel factors out of its sum over K). The weight is read
from memory as int8 once per M tile, which is what makes decode (M = batch size) faster than
a bf16 GEMM: decode is bound by reading the weights.

Block configurations are autotuned on the GPU per (M bucket, N, K): :func:`m_bucket` rounds M
up to a power of two from 16 (the smallest ``tl.dot`` tile) to 512, so a decode batch of 1..16
rows shares one tuning and prefill chunks share another. Under Triton's interpreter
(``TRITON_INTERPRET=1``, the CPU tests) nothing is timed: :func:`default_config` picks one, and
tests pass each of :data:`CONFIGS` explicitly to check them all.

This module imports triton: only the CUDA path (``kernels/quant_linear.py``) and the tests import it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_GROUP_M = 8  # programs along M that share one band of weight columns (L2 reuse on prefill)

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). Narrow-N tiles for decode (enough programs
# to fill the SMs when M is one tile), wider square-ish tiles for prefill chunks. Every one compiles for
# sm_80, sm_89 and sm_90 within shared memory and without register spills (the ahead-of-time check,
# tests/engine/test_aot_compile.py): 64x128x64 (4 stages) spilled 40 B on sm_89, 128x256x64 24-76 B on
# sm_80/89 and 32x64x128 8 B with fp16 on sm_90, so those are 64x128x32, 128x256x32 and 32x64x64.
_SHAPES = (
    (16, 32, 256, 4, 4), (16, 64, 128, 4, 4), (16, 64, 256, 4, 3), (16, 128, 128, 4, 4),
    (32, 64, 64, 4, 4), (32, 128, 128, 4, 3),
    (64, 64, 64, 4, 4), (64, 128, 32, 4, 4), (128, 128, 64, 8, 3), (128, 256, 32, 8, 3),
)
# float32 activations (an exact fp32 dot): the tiles above need 80-160 KB of shared memory and spill kilobytes
# there, so smaller ones, each spill-free on every capability of the SKU table.
_F32_SHAPES = ((16, 32, 64, 4, 2), (16, 64, 32, 4, 2), (32, 32, 32, 4, 2), (32, 64, 32, 4, 2))


def _configs(shapes) -> list[triton.Config]:
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bm, bn, bk, w, s in shapes]


CONFIGS, F32_CONFIGS = _configs(_SHAPES), _configs(_F32_SHAPES)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def m_bucket(m: int) -> int:
    """The autotuning key for M: a power of two in [16, 512]."""
    return min(512, max(16, triton.next_power_of_2(m)))


def _prune(configs, named_args, **kwargs):
    """Tiles taller than the bucket only compute padding: keep those that fit (at least one)."""
    bucket = named_args["M_BUCKET"]
    fitting = [c for c in configs if c.kwargs["BLOCK_M"] <= bucket]
    return fitting or [min(configs, key=lambda c: c.kwargs["BLOCK_M"])]


def default_config(bucket: int, f32: bool = False) -> triton.Config:
    """The untimed choice (interpreter): the widest-K decode tile for small M, a 64-row tile else (float32
    activations: their own list's)."""
    if f32:
        return F32_CONFIGS[0] if bucket <= 16 else F32_CONFIGS[3]
    return CONFIGS[2] if bucket <= 16 else CONFIGS[7]


@triton.jit
def _int8_weight_only_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr,
    M, N, K, M_BUCKET,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, F32_DOT: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M row tiles walk the same weight columns while they are in L2.
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # a [BLOCK_K, BLOCK_N] view of W^T

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        x = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        w = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0)
        w = w.to(tl.float32)  # dequantize in registers; the per-channel scale waits for the epilogue
        if F32_DOT:
            acc = tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    scale = tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)
    acc = acc * scale[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


_tuned_kernel = triton.autotune(configs=CONFIGS, key=["M_BUCKET", "N", "K"],
                                prune_configs_by={"early_config_prune": _prune})(_int8_weight_only_kernel)
_tuned_kernel_f32 = triton.autotune(configs=F32_CONFIGS, key=["M_BUCKET", "N", "K"],
                                    prune_configs_by={"early_config_prune": _prune})(_int8_weight_only_kernel)


def int8_weight_only_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                            bias: torch.Tensor | None = None, config: triton.Config | None = None) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T + bias`` for ``x [..., K]``, int8 ``weight [N, K]``, float32 ``scale [N]``.

    ``config`` forces one block configuration (tests); otherwise the autotuned kernel runs on a
    GPU and :func:`default_config` under the interpreter.
    """
    n, k = weight.shape
    if x.shape[-1] != k or weight.dtype != torch.int8 or scale.shape != (n,):
        raise ValueError(f"int8 GEMM: x {tuple(x.shape)}, weight {tuple(weight.shape)} {weight.dtype}, "
                         f"scale {tuple(scale.shape)} do not fit")
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*x.shape[:-1], n)
    bucket = m_bucket(m)

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    args = (x2, weight, scale, bias if bias is not None else scale, y, m, n, k, bucket,
            x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1))
    interpreting = _interpreting()
    # fp32 activations: an exact fp32 dot (no TF32). bf16 under the interpreter too: its bf16 dot
    # multiplies the raw bit patterns (triton 3.9); bf16 x int8 products are exact in fp32 anyway.
    f32_dot = x.dtype == torch.float32 or (interpreting and x.dtype == torch.bfloat16)
    flags = {"HAS_BIAS": bias is not None, "F32_DOT": f32_dot, "GROUP_M": _GROUP_M}
    if config is None and interpreting:
        config = default_config(bucket, x.dtype == torch.float32)
    if config is None:
        (_tuned_kernel_f32 if x.dtype == torch.float32 else _tuned_kernel)[grid](*args, **flags)
    else:
        _int8_weight_only_kernel[grid](*args, **flags, **config.all_kwargs())
    return y.view(*x.shape[:-1], n)
