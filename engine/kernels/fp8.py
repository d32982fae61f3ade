"""fp8 (e4m3) linears on tensor cores: ``torch._scaled_mm`` with per-token activation scales.

The one rule for where this runs is :func:`fp8_gemm_supported`: CUDA devices of compute
capability >= 8.9 (Ada: L4, L40S; Hopper: H100, H200; and later). The API's GPU table
(``kiln/skus.py``, ``GPUSpec.supports_fp8``) mirrors it, and a test pins that the two agree
(the core imports nothing of the engine). Elsewhere (CPU, A100 and older) an fp8 weight is
dequantized per call instead (``kernels/quant_linear.py``).

The math, for ``x [M, K]`` and an fp8 weight ``W_q [N, K]`` with float32 scales ``s_w [N]``:

- activations are quantized per token (dynamic, every call): ``s_x[m] = max|x[m, :]| / 448``,
  ``x_q = e4m3(x / s_x)``;
- ``y[m, n] = s_x[m] * s_w[n] * sum_k x_q[m, k] * W_q[n, k]``, which is ``_scaled_mm`` with
  row-wise scales ``scale_a = s_x [M, 1]`` and ``scale_b = s_w [1, N]`` (float32, contiguous).

``_scaled_mm`` wants its second operand column-major: ``W_q.t()`` of the row-major ``[N, K]``
weight already is (strides ``(1, K)``), so the weight is stored once, as loaded, and never
copied or transposed again. Its row-wise kernels return bf16 (and fp16 on recent torch) on
sm89 and sm90; fp32 activations therefore take the dequantize path. K and N must be multiples
of 16 (every Llama-family projection is).
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger("kiln.engine.fp8")

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
FP8_MIN_CAPABILITY = (8, 9)
FP8_OUT_DTYPES = (torch.bfloat16, torch.float16)
_MIN_SCALE = 1e-12  # an all-zero row of activations quantizes to zeros, not NaN


def fp8_gemm_supported(capability: tuple[int, int] | None) -> bool:
    """Whether a CUDA device of this compute capability runs fp8 GEMMs natively (None: not CUDA)."""
    return capability is not None and tuple(capability) >= FP8_MIN_CAPABILITY


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int] | None:
    if torch.version.hip is not None:  # ROCm's fp8 is e4m3fnuz, another format: not this path
        return None
    return torch.cuda.get_device_capability(index)


def device_runs_fp8(device: torch.device) -> bool:
    """:func:`fp8_gemm_supported` for a torch device (CPU and meta: False)."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return fp8_gemm_supported(_cuda_capability(index))


@functools.cache
def rowwise_scaled_mm_works(device: torch.device, out_dtype: torch.dtype) -> bool:
    """Whether this torch build's ``_scaled_mm`` takes row-wise scales with ``out_dtype`` output here.

    Which (arch, output dtype) pairs the row-wise kernels accept changed between torch releases
    (older ones: bf16 only; builds without the row-wise kernels: none), so it is asked once per
    device and dtype, with a 16 x 16 call, rather than assumed; a refusal warns once and the
    weight is dequantized per call instead. Runs on the first fp8 call, i.e. in the eager warm-up
    before any CUDA graph is captured.
    """
    a = torch.zeros(16, 16, device=device, dtype=FP8_DTYPE)
    ones = torch.ones(16, 1, device=device, dtype=torch.float32)
    try:
        torch._scaled_mm(a, a.t(), scale_a=ones, scale_b=ones.view(1, 16), out_dtype=out_dtype)
    except (RuntimeError, NotImplementedError) as exc:
        log.warning("fp8: torch %s's _scaled_mm refuses row-wise scales with %s output on %s (%s); fp8 weights "
                    "are dequantized per call instead", torch.__version__, out_dtype, device,
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return False
    return True


def can_use_scaled_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The fp8 GEMM runs this call: an fp8-capable device whose torch takes row-wise scales in ``x``'s
    dtype, bf16/fp16 activations, K and N multiples of 16."""
    return (x.is_cuda and weight.dtype == FP8_DTYPE and x.dtype in FP8_OUT_DTYPES and x.shape[-1] % 16 == 0
            and weight.shape[0] % 16 == 0 and device_runs_fp8(x.device)
            and rowwise_scaled_mm_works(x.device, x.dtype))


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic quantization of ``x [M, K]`` -> (e4m3 ``[M, K]`` row-major, float32 scale ``[M, 1]``)."""
    x32 = x.to(torch.float32)
    scale = (x32.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    q = (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (weight * weight_scale[:, None]).T + bias`` with ``torch._scaled_mm`` (output in ``x.dtype``)."""
    k, n = x.shape[-1], weight.shape[0]
    x_q, x_scale = quantize_activation(x.reshape(-1, k))
    y = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, n),
                         out_dtype=x.dtype)
    y = y.view(*x.shape[:-1], n)
    return y if bias is None else y + bias


def emulate_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """What :func:`fp8_linear` computes, in float32 without ``_scaled_mm`` (the tests' reference)."""
    k = x.shape[-1]
    x_q, x_scale = quantize_activation(x.reshape(-1, k))
    y = (x_q.to(torch.float32) @ weight.to(torch.float32).t()) * x_scale * weight_scale[None, :].to(torch.float32)
    y = y.view(*x.shape[:-1], weight.shape[0])
    return (y if bias is None else y + bias.to(torch.float32)).to(x.dtype)
