"""Measure in-flight batching on a mixed workload: average running batch size and KV usage.

``python -m kiln.engine.measure_batching --model DIR`` runs 64 requests (prompts
uniform in 32..256 tokens; outputs long-tailed: 80% in 16..64, 20% in
128..256; all arriving at once; EOS ignored so lengths are fixed) through
``LLM.generate`` and prints what the engine's counters saw per step. This is
the workload of ``kiln bench`` (issue 7) without the baselines.
"""

from __future__ import annotations

import json
import random
import time

import click


def workload(num_requests: int, seed: int, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        prompt_len = rng.randint(32, 256)
        output_len = rng.randint(16, 64) if rng.random() < 0.8 else rng.randint(128, 256)
        out.append(([1] + [rng.randrange(5, vocab_size) for _ in range(prompt_len - 1)], output_len))
    return out


@click.command()
@click.option("--model", "model_dir", required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--num-requests", default=64, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--max-batch-size", default=64, show_default=True)
@click.option("--max-num-tokens", default=2048, show_default=True)
@click.option("--num-kv-blocks", type=int, default=None, help="Default: sized by the engine.")
@click.option("--block-size", default=16, show_default=True)
def main(model_dir: str, num_requests: int, seed: int, dtype: str, max_batch_size: int, max_num_tokens: int,
         num_kv_blocks: int | None, block_size: int) -> None:
    from kiln.engine import LLM, SamplingParams

    llm = LLM(model_dir, dtype=dtype, max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
              num_kv_blocks=num_kv_blocks, block_size=block_size)
    vocab = llm.engine_config.hf_config["vocab_size"]
    reqs = workload(num_requests, seed, vocab)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    elapsed = time.perf_counter() - start
    s = llm.stats()
    report = {
        "requests": num_requests, "prompt_tokens": sum(len(p) for p, _ in reqs),
        "output_tokens": sum(len(o.token_ids) for o in outs), "seconds": round(elapsed, 2),
        "output_tok_per_s": round(sum(len(o.token_ids) for o in outs) / elapsed, 1),
        "steps": s.num_steps, "avg_running_batch_size": round(s.avg_batch_size, 2),
        "avg_kv_usage": round(s.avg_kv_usage, 3), "kv_blocks": s.num_total_blocks, "block_size": block_size,
        "preemptions": s.num_preemptions, "max_batch_size": max_batch_size, "max_num_tokens": max_num_tokens,
        "dtype": dtype,
    }
    click.echo(json.dumps(report, indent=2))
    llm.shutdown()


if __name__ == "__main__":
    main()
