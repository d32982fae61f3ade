"""``kiln bench --lora N``: what serving N LoRA adapters in mixed batches costs in throughput.

One engine with ``enable_lora`` (``max_loras`` = N), N random rank-16 PEFT-format adapters on every
attention and MLP projection (made here, B damped as the tests do), and at each batch size (1, 4, 16) the
same greedy workload twice per repeat in alternating order (ABBA, so a shared machine's drift cancels): every
request on the base, and the requests spread round-robin over the N adapters. Every request makes exactly
``max_tokens`` tokens (EOS ignored), so both runs do the same work but the LoRA shrink/expand. Throughput
is output tokens per second; the table shows medians. Target (docs/lora.md): a mixed batch of 3 adapters
keeps >= 0.8x the base-only throughput at batch 16.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BATCHES = (1, 4, 16)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: Path, out: Path, n: int, rank: int = 16) -> list[Path]:
    """N random PEFT adapters for ``model_dir`` (adapter_config.json + adapter_model.safetensors)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    from kiln.engine.lora.adapter import module_shapes

    shapes = module_shapes(cfg)
    dirs = []
    for i in range(n):
        d = out / f"adapter-{i}"
        d.mkdir(parents=True, exist_ok=True)
        g = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(cfg["num_hidden_layers"]):
            for module in TARGETS:
                fan_in, fan_out = shapes[module]
                part = "self_attn" if module in TARGETS[:4] else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.3 / rank ** 0.5
        save_file(tensors, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS,
            "base_model_name_or_path": str(model_dir)}))
        dirs.append(d)
    return dirs


def run(model_dir: Path, dtype: str, threads: int, device: str, num_adapters: int, work_dir: Path,
        max_tokens: int = 64, prompt_len: int = 32, repeats: int = 3,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    import torch
    from kiln.engine import LLM, SamplingParams
    from kiln.engine.lora import LoRARequest

    torch.set_num_threads(threads)
    adapters = make_adapters(model_dir, work_dir, num_adapters)
    loras = [LoRARequest(f"adapter-{i}", i + 1, str(d)) for i, d in enumerate(adapters)]
    llm = LLM(str(model_dir), dtype=dtype, device=device, max_batch_size=max(BATCHES), max_num_tokens=2048,
              max_seq_len=prompt_len + max_tokens + 8, max_input_len=prompt_len, enable_lora=True,
              max_loras=num_adapters, enable_prefix_caching=False)
    vocab = llm.engine.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(5, vocab) for _ in range(prompt_len)] for _ in range(max(BATCHES))]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def timed(batch: int, mixed: bool) -> float:
        lr = [loras[i % len(loras)] for i in range(batch)] if mixed else None
        started = time.perf_counter()
        outs = llm.generate(prompts[:batch], params, lora_request=lr)
        elapsed = time.perf_counter() - started
        tokens = sum(len(o.token_ids) for o in outs)
        assert tokens == batch * max_tokens
        return tokens / elapsed

    timed(max(BATCHES), True)  # warm-up: adapters into host memory and the slots, first-call costs
    runs: dict[str, dict[str, list[float]]] = {str(b): {"base": [], "mixed": []} for b in BATCHES}
    for r in range(repeats):
        for b in BATCHES:
            for name in (("base", "mixed") if r % 2 == 0 else ("mixed", "base")):
                runs[str(b)][name].append(timed(b, name == "mixed"))
            log(f"lora: repeat {r + 1}/{repeats} batch {b}: base {runs[str(b)]['base'][-1]:.1f}, "
                f"{num_adapters} adapters {runs[str(b)]['mixed'][-1]:.1f} tok/s")
    llm.shutdown()
    medians = {b: {k: statistics.median(v) for k, v in d.items()} for b, d in runs.items()}
    return {"num_adapters": num_adapters, "rank": 16, "max_tokens": max_tokens, "prompt_len": prompt_len,
            "repeats": repeats, "threads": threads, "device": device, "dtype": dtype, "model_dir": str(model_dir),
            "runs": runs, "median_tok_s": medians,
            "ratio": {b: m["mixed"] / m["base"] for b, m in medians.items()}}


def text(doc: dict[str, Any]) -> str:
    lines = [f"LoRA: {doc['num_adapters']} rank-{doc['rank']} adapters (all projections) mixed vs base, "
             f"{doc['max_tokens']} tokens/request ({doc['device']}, {doc['dtype']}, {doc['threads']} threads, "
             f"medians of {doc['repeats']} interleaved runs)",
             f"  {'batch':>5}{'base tok/s':>14}{'mixed tok/s':>14}{'mixed/base':>12}"]
    for b, m in doc["median_tok_s"].items():
        lines.append(f"  {b:>5}{m['base']:>14.1f}{m['mixed']:>14.1f}{doc['ratio'][b]:>11.2f}x")
    return "\n".join(lines)
