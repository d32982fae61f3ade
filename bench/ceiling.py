"""The hardware ceiling: what this machine could do for this model and workload at best.

Two measurements, best of a few trials (a ceiling is the best the machine
achieves, not its average on a noisy day):

- memory bandwidth: read (``sum`` over a buffer far larger than the caches)
  and copy (counted as read + write bytes);
- matmul FLOP/s: the model's own weight shapes in the bench dtype, at decode-like M
  (rows = batch) and prefill-like M (many tokens), the fastest of ``F.linear`` and, on CPU, every
  tactic candidate this host runs (``kiln.engine.kernels.candidates``: kiln's GEMMs, oneDNN prepacked).

Roofline for one decode step at batch B (every weight read once, each
sequence's KV read once):

    step_time(B) >= max(weight_bytes / bandwidth, 2 * matmul_params * B / peak_flops)
                    + B * avg_context * kv_bytes_per_token / bandwidth

and for the whole workload the prefill is compute at peak FLOP/s:
``2 * matmul_params * prompt_tokens / peak_flops``. The workload ceiling in
output tok/s is output tokens over the sum of both at the batch a system
actually ran; its fraction of that says how far the system is from the
machine at that batch.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _best_time(fn, trials: int, device: str = "cpu", min_time: float = 0.05) -> float:
    fn()  # warm caches, allocator, kernel selection
    best = float("inf")
    for _ in range(trials):
        _sync(device)
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            _sync(device)
            elapsed = time.perf_counter() - t0
            if elapsed >= min_time:
                break
        best = min(best, elapsed / n)
    return best


def measure_bandwidth(num_bytes: int = 512 * 2**20, trials: int = 5, device: str = "cpu") -> dict:
    x = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    read = num_bytes / _best_time(lambda: x.sum(), trials, device)
    copy = 2 * num_bytes / _best_time(lambda: y.copy_(x), trials, device)
    return {"read_gb_s": read / 1e9, "copy_gb_s": copy / 1e9, "buffer_mib": num_bytes / 2**20}


def _linear_shapes(facts: dict) -> list[tuple[int, int]]:
    """(out_features, in_features) of one layer's projections plus the LM head."""
    h, d = facts["hidden_size"], facts["head_dim"]
    q, kv, inter = facts["num_heads"] * d, facts["num_kv_heads"] * d, facts["intermediate_size"]
    return [(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter), (facts["vocab_size"], h)]


def measure_matmul(facts: dict, dtype: torch.dtype, rows: list[int], trials: int = 3,
                   device: str = "cpu") -> dict[int, float]:
    """FLOP/s of the model's linears (one layer's worth + LM head) at each M in ``rows``."""
    from kiln.engine.kernels import candidates
    from kiln.engine.kernels.native import ROW_BUCKETS

    native = None
    names: list[str] = []
    if device == "cpu":
        from kiln.engine.kernels.native import kernels

        native = kernels()
        names = [n for n in candidates.LINEAR if candidates.LINEAR[n].layout != "plain"
                 and candidates.why_not(n, dtype, native) is None]

    weights = [torch.randn(o, i, dtype=dtype, device=device) * 0.02 for o, i in _linear_shapes(facts)]
    out = {}
    for m in rows:
        xs = [torch.randn(m, w.shape[1], dtype=dtype, device=device) for w in weights]
        flops = sum(2 * m * w.shape[0] * w.shape[1] for w in weights)

        def run(xs=xs):
            for x, w in zip(xs, weights, strict=True):
                F.linear(x, w)

        runs = [run]
        for name in names:
            cand = candidates.LINEAR[name]
            tactics = [cand.gemm_kernel] * ROW_BUCKETS if cand.gemm_kernel else None
            packed = [candidates.pack(cand.layout, w, native, m, tactics) for w in weights]

            def run_packed(xs=xs, packed=packed):
                for x, p in zip(xs, packed, strict=True):
                    candidates.run(p, x, None)

            runs.append(run_packed)
        with torch.inference_mode():
            out[m] = max(flops / _best_time(fn, trials, device) for fn in runs)
    return out


def measure(facts: dict, dtype: str, batch_sizes: list[float], prefill_rows: int = 512,
            buffer_bytes: int = 512 * 2**20, device: str = "cpu") -> dict:
    torch_dtype = getattr(torch, dtype)
    rows = sorted({max(1, round(b)) for b in batch_sizes} | {prefill_rows})
    flops = measure_matmul(facts, torch_dtype, rows, device=device)
    return {
        "device": device,
        "bandwidth": measure_bandwidth(buffer_bytes, device=device),
        "matmul_gflop_s": {str(m): f / 1e9 for m, f in flops.items()},
        "peak_gflop_s": max(flops.values()) / 1e9,
        "dtype": dtype,
    }


def kv_bytes_per_token(facts: dict, itemsize: int) -> int:
    return 2 * facts["num_layers"] * facts["num_kv_heads"] * facts["head_dim"] * itemsize


def workload_ceiling(hw: dict, facts: dict, itemsize: int, prompt_tokens: int, output_tokens: int,
                     avg_context: float, batch: float) -> dict:
    """Best-case output tok/s for the workload at average decode batch ``batch`` (roofline above)."""
    bw = hw["bandwidth"]["read_gb_s"] * 1e9
    peak = hw["peak_gflop_s"] * 1e9
    weight_bytes = facts["matmul_params"] * itemsize
    weights_t = weight_bytes / bw
    compute_t = 2 * facts["matmul_params"] * batch / peak
    kv_t = batch * avg_context * kv_bytes_per_token(facts, itemsize) / bw
    step_t = max(weights_t, compute_t) + kv_t
    num_steps = output_tokens / batch
    decode_t = num_steps * step_t
    prefill_t = 2 * facts["matmul_params"] * prompt_tokens / peak
    total_t = decode_t + prefill_t
    terms = {
        "prefill compute": prefill_t,
        "decode weight reads": num_steps * weights_t if weights_t >= compute_t else 0.0,
        "decode compute": num_steps * compute_t if compute_t > weights_t else 0.0,
        "decode KV reads": num_steps * kv_t,
    }
    limiter = max(terms, key=terms.get)
    return {
        "batch": batch,
        "decode_step_ms": step_t * 1e3,
        "decode_tok_s": batch / step_t,
        "output_tok_s": output_tokens / total_t,
        "min_time_s": total_t,
        "time_split_s": terms,
        "limiter": limiter,
        "decode_bound": "memory (weight reads)" if weights_t >= compute_t else "compute",
    }
