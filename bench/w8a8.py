"""W8A8 against weight-only int8 and the float kernels: per linear, and end to end (issue 33).

Per linear (``linears``): at each shape and row count, the candidates of ``kiln.engine.kernels.candidates``
timed interleaved (one sample of each in turn, the order rotating each round; the median of the rounds),
so a neighbour's burst on a shared host slows them all alike:

- ``kiln-w8a8``: int8 weight x int8 activations quantized per row and 32-block of K, on vpdpbusd;
- ``kiln-w8a8-amx``: the same sums on AMX-INT8 tiles (where the host has ``amx_int8``);
- ``torch-w8a8``: torch's dynamic int8 linear (x86 engine), activations quantized per call;
- ``int8-fma`` / ``int8-amx``: today's weight-only int8 (kiln's panels widened per call), and ``int8-aten``
  (torch's int8 x bf16 kernel);
- ``bf16-fma``, ``f32-fma``: kiln's float GEMMs on a bf16 / float32 copy of the same weight.

End to end (``decode``): one engine per setting, generating ``tokens`` greedy tokens for ``batch`` prompts,
decode tok/s as the median over interleaved rounds. ``quality``: the logits' KL divergence and greedy
agreement of an int8 engine running W8A8 (forced) or weight-only int8 against the float engine.

    OMP_NUM_THREADS=1 python -P -m kiln_bench.w8a8 linears --shapes 960x576,576x576,3072x576,576x1536
    OMP_NUM_THREADS=1 python -P -m kiln_bench.w8a8 decode --model DIR --batch 1 32
    KILN_CPU_ISA=x86-64-v3 python -P -m kiln_bench.w8a8 linears --dtype float32   # what an AVX2 host runs
"""

from __future__ import annotations

import argparse
import json
import time

import torch

SMOLLM2 = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate|up, down
LLAMA_BENCH = ((1280, 768), (768, 768), (4096, 768), (768, 2048))


def _interleaved(fns: dict, rounds: int = 15, sample_s: float = 2e-3) -> dict[str, float]:
    """Median microseconds per call of each function, sampled in turn, the order rotating each round."""
    for fn in fns.values():
        fn()
    inner = {}
    for name, fn in fns.items():
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < sample_s:
            fn()
            n += 1
        inner[name] = max(1, n)
    names, samples = list(fns), {n: [] for n in fns}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            for _ in range(inner[name]):
                fns[name]()
            samples[name].append((time.perf_counter() - t0) / inner[name])
    return {n: sorted(s)[len(s) // 2] * 1e6 for n, s in samples.items()}


def linears(shapes, rows=(1, 4, 16, 32), rounds: int = 15, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Per (shape, rows): median microseconds of each candidate this host runs (see the module doc), the
    activations in ``dtype`` (float32 where the host has no bf16 kernels: an AVX2 host, or one capped there)."""
    from kiln.engine.kernels import candidates, native
    from kiln.engine.kernels.quant_linear import quantized_linear
    from kiln.engine.kernels.torch_w8a8 import QLinear
    from kiln.engine.layers.quant import quantize_weight

    kernels = native.kernels()
    gen = torch.Generator().manual_seed(0)
    out = []
    for n, k in shapes:
        w = torch.randn(n, k, generator=gen) * 0.02
        q, s = quantize_weight(w, "int8")
        packs = {}
        i8 = kernels.pack_linear(q, ["fma"] * 16, s, dtype)
        for name, kern in (("kiln-w8a8", "w8a8"), ("kiln-w8a8-amx", "w8a8_amx"), ("int8-fma", "fma"),
                           ("int8-amx", "amx")):
            if kernels.gemm_kernels[dtype][kern] is None:
                packs[name] = (i8, kern)
        fns_for = {}
        for rows_ in rows:
            x = torch.randn(rows_, k, generator=gen).to(dtype)
            fns = {}
            for name, (p, kern) in packs.items():
                def fn(p=p, kern=kern, x=x):
                    if p.tactics[0] != kern:
                        p.set_tactics([kern] * 16)
                    return p(x)
                fns[name] = fn
            fns_for[rows_] = (x, fns)
        qlin = QLinear(q, s) if candidates.why_not("torch-w8a8", dtype, kernels, "int8") is None else None
        bf16 = kernels.pack_linear(w.bfloat16()) if torch.bfloat16 in kernels.linear_dtypes else None
        f32 = kernels.pack_linear(w)
        for rows_, (x, fns) in fns_for.items():
            if qlin is not None:
                fns["torch-w8a8"] = lambda x=x, qlin=qlin: qlin(x)
            if k % 32 == 0:
                fns["int8-aten"] = lambda x=x, q=q, s=s: quantized_linear(x, q, s, None)
            if bf16 is not None:
                fns["bf16-fma"] = lambda xb=x.bfloat16(), bf16=bf16: bf16(xb)
            fns["f32-fma"] = lambda x32=x.float(), f32=f32: f32(x32)
            with torch.inference_mode():
                us = _interleaved(fns, rounds)
            row = {"shape": f"{n}x{k}", "rows": rows_, "us": {k_: round(v, 1) for k_, v in us.items()}}
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def _engine(model: str, batch: int, **kw):
    from kiln.engine.llm import LLM

    return LLM(model, max_batch_size=batch, max_num_tokens=max(256, batch), device="cpu", **kw)


def decode(model: str, batches=(1, 32), tokens: int = 64, rounds: int = 5, prompt_len: int = 16,
           dtype: str = "bfloat16") -> list[dict]:
    """Decode tok/s per setting (the float engine; int8 with the table free to pick; int8 without torch's W8A8;
    int8 without kiln's; int8 without its AMX-INT8 tiles; int8 without any W8A8), the activations in ``dtype``,
    interleaved."""
    import os

    from kiln.engine.sampling_params import SamplingParams

    settings = {"bf16" if dtype == "bfloat16" else "float32": {"dtype": dtype},
                "int8": {"dtype": dtype, "quantization": "int8"},
                # one copy of every weight: the table's one layout per weight (before candidates.SECOND_COPY)
                "int8-one-copy": {"dtype": dtype, "quantization": "int8", "env": {"KILN_TACTICS_SECOND_COPY": "0"}},
                # what a build whose quality gate refused torch's 7-bit W8A8 ships (SmolLM2's: quantization.md)
                "int8-no-torch-w8a8": {"dtype": dtype, "quantization": "int8", "exclude": "torch-w8a8"},
                # what a host without kiln's W8A8 tiles ran (a Skylake-SP before the AVX512BW ones)
                "int8-no-kiln-w8a8": {"dtype": dtype, "quantization": "int8", "exclude": "kiln-w8a8"},
                # an AMX host without its AMX-INT8 tiles (the same as "int8" wherever the CPU has none)
                "int8-no-w8a8-amx": {"dtype": dtype, "quantization": "int8", "exclude": "kiln-w8a8-amx"},
                "int8-weight-only": {"dtype": dtype, "quantization": "int8", "exclude": "w8a8"}}
    out = []
    for batch in batches:
        engines = {}
        for name, kw in settings.items():
            kw = dict(kw)
            env = {**kw.pop("env", {}), **({"KILN_TACTICS_EXCLUDE": kw.pop("exclude")} if "exclude" in kw else {})}
            before = {k: os.environ.pop(k, None) for k in ("KILN_TACTICS_EXCLUDE", *env)}
            os.environ.update(env)
            try:
                engines[name] = _engine(model, batch, **kw)
            finally:
                for k, v in before.items():
                    os.environ.pop(k, None)
                    if v is not None:
                        os.environ[k] = v
        prompts = [[(7 * i + j) % 500 + 10 for j in range(prompt_len)] for i in range(batch)]
        sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        times = {n: [] for n in engines}
        names = list(engines)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                llm = engines[name]
                sp1 = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
                t0 = time.perf_counter()
                llm.generate(prompts, sp1)
                t1 = time.perf_counter()
                llm.generate(prompts, sp)
                t2 = time.perf_counter()
                # decode: the tokens after the first, net of the prefill (the 1-token run's time)
                times[name].append(batch * (tokens - 1) / max(1e-9, (t2 - t1) - (t1 - t0)))
        row = {"batch": batch, "tok_s": {n: round(sorted(v)[len(v) // 2], 1) for n, v in times.items()},
               "tactics": {n: _runs(e) for n, e in engines.items()}}
        out.append(row)
        print(json.dumps(row), flush=True)
        del engines
    return out


def _runs(llm) -> dict[str, int]:
    """How many linears run each candidate at batch-1 rows (what the table bound)."""
    counts: dict[str, int] = {}
    for m in llm.engine.runner.model.modules():
        p = getattr(m, "packed_weight", None)
        if p is None:
            continue
        name = type(p).__name__ if not hasattr(p, "tactics") else f"kiln:{'/'.join(sorted(set(p.tactics[:6])))}"
        counts[name] = counts.get(name, 0) + 1
    return counts


def quality(model: str, prompts: int = 8, prompt_len: int = 48, tokens: int = 32) -> dict:
    """Logits KL(float || int8 engine) at each position of the common greedy prefix (top-20 logprobs), and greedy
    token agreement, for W8A8 (forced) and weight-only int8, both against the float32 engine."""
    import os

    import torch.nn.functional as F
    from kiln.engine.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(10, 2000, (prompt_len,), generator=gen).tolist() for _ in range(prompts)]
    sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=20)
    ref = _engine(model, prompts, dtype="float32")
    ref_out = ref.generate(ids, sp)
    result = {}
    for name, kw, exclude in (("w8a8", {"tactics": "kiln-w8a8"}, None), ("int8-weight-only", {}, "w8a8")):
        if exclude:
            os.environ["KILN_TACTICS_EXCLUDE"] = exclude
        try:
            llm = _engine(model, prompts, dtype="float32", quantization="int8", **kw)
            out = llm.generate(ids, sp)
        finally:
            os.environ.pop("KILN_TACTICS_EXCLUDE", None)
        agree = total = 0
        kls = []
        for a, b in zip(ref_out, out, strict=True):
            ta, tb = a.token_ids, b.token_ids
            first = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), len(ta))
            agree += sum(x == y for x, y in zip(ta, tb, strict=False))
            total += len(ta)
            for la, lb in zip(a.logprobs[:first], b.logprobs[:first], strict=False):  # same prefix: same context
                keys = sorted(set(la) & set(lb))  # over the top-20 both return: a lower bound of the full KL
                pa, pb = (torch.tensor([lp[t] for t in keys]).log_softmax(0) for lp in (la, lb))  # renormalized
                kls.append(F.kl_div(pb, pa, log_target=True, reduction="sum").item())
        result[name] = {"greedy_agreement": round(agree / total, 4), "first_divergence_mean": round(
                            sum(next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False))
                                      if x != y), tokens) for a, b in zip(ref_out, out, strict=True)) / prompts, 2),
                        "kl_top20_mean": round(sum(kls) / max(1, len(kls)), 6), "positions": len(kls)}
    print(json.dumps(result), flush=True)
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="kiln_bench.w8a8", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    lin = sub.add_parser("linears")
    lin.add_argument("--shapes", default="smollm2", help="smollm2, llama-bench, or NxK,NxK,...")
    lin.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32])
    lin.add_argument("--rounds", type=int, default=15)
    for sp in (lin, dec := sub.add_parser("decode")):
        sp.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                        help="the activations' (default: bfloat16 where kiln's kernels multiply it, else float32)")
    dec.add_argument("--model", required=True)
    dec.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    dec.add_argument("--tokens", type=int, default=64)
    dec.add_argument("--rounds", type=int, default=5)
    qual = sub.add_parser("quality")
    qual.add_argument("--model", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.cmd in ("linears", "decode") and args.dtype is None:
        from kiln.engine.kernels import native

        kernels = native.kernels()
        args.dtype = "bfloat16" if kernels is not None and torch.bfloat16 in kernels.linear_dtypes else "float32"
    if args.cmd == "linears":
        named = {"smollm2": SMOLLM2, "llama-bench": LLAMA_BENCH}
        shapes = named.get(args.shapes) or [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
        linears(shapes, tuple(args.rows), args.rounds, getattr(torch, args.dtype))
    elif args.cmd == "decode":
        decode(args.model, tuple(args.batch), args.tokens, args.rounds, dtype=args.dtype)
    else:
        quality(args.model)


if __name__ == "__main__":
    main()
