"""``kiln bench --speculative``: speculation against plain decoding, batch 1 and batch 32.

Drafts come from prompt lookup, or with ``--draft-model DIR`` / ``--draft-layers N`` from a draft
model: a checkpoint of the same tokenizer, or the benchmarked model's first ``N`` layers under its
own head (``kiln.engine.random_checkpoint.make_truncated_draft``: an untrained early exit, the one same-family
draft at hand where the registry holds one model).

A repetitive workload: each request asks to rewrite a paragraph unchanged, so a model that
copies its prompt gives n-gram drafts something to find. A model with a chat template (SmolLM2,
``--model-dir``) gets the instruction and the paragraph as a chat turn; a random-weight toy model
gets a random phrase repeated (its greedy output repeats parts of it). Every request is greedy,
so the three engines produce the same tokens (checked) and do the same work:

- ``off``: no speculation;
- ``on``: ``num_speculative_tokens`` drafts, off above ``disable_by_batch_size`` running requests;
- ``always``: the same drafts with no load rule (what the rule saves at batch 32).

At each batch size the engines run in rotating order ``repeats`` times; the table shows median
output tokens per second, the speed-up over ``off`` and the acceptance rate.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PARAGRAPHS = [
    "The operator turns a checkpoint into a compiled engine once per build envelope, stores it under a "
    "content-addressed version, and rolls out serving pods that keep the old version until the new one is ready.",
    "A paged KV cache holds fixed-size blocks in one pool; each sequence has a block table, and blocks are "
    "freed the step a request finishes, so memory follows the live requests instead of the longest one.",
    "Prefix caching hashes each full block with its parent's key, so two prompts that share a system message "
    "share its blocks, and the tails of prefixes are evicted before their heads.",
    "In-flight batching re-forms the batch every step: running decodes first, then prefill chunks that fit the "
    "token budget, then waiting requests while blocks and the batch size allow.",
    "Speculative decoding proposes several tokens and verifies them in one forward pass; at low batch the pass "
    "costs about the same as one token, so every accepted draft is a token for free.",
    "The build measures each operation's implementations on the target and ships the winners as a table, so "
    "a serving host that matches the build uses them without timing anything at start.",
    "Greedy output must equal the reference implementation token for token, for any batch mix, chunking, "
    "prefix-cache hit or preemption, which is what the equality suite checks on every change.",
    "A request that could never fit the pool is refused before it is queued, with a message that names the "
    "field to change, so one bad request never blocks the queue or crashes the engine.",
]
INSTRUCTION = "Rewrite the following text exactly as it is, word for word:\n\n"


def prompts_for(tokenizer: Any, vocab: int, special: set[int], count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    if getattr(tokenizer, "chat_template", None):
        out = []
        for i in range(count):
            text = INSTRUCTION + PARAGRAPHS[i % len(PARAGRAPHS)]
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True)
            out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        return out
    out = []
    for _ in range(count):
        phrase = [t for t in (rng.randrange(5, vocab) for _ in range(16)) if t not in special][:rng.randint(6, 12)]
        out.append((phrase * (96 // len(phrase) + 1))[:96])
    return out


def run(model_dir: Path, dtype: str, threads: int, device: str, batches: tuple[int, ...] = (1, 32),
        max_tokens: int = 96, repeats: int = 3, k: int = 4, disable_by_batch_size: int = 4,
        log: Callable[[str], None] = print, draft_dir: Path | None = None) -> dict[str, Any]:
    import torch
    from kiln.engine import LLM, SamplingParams

    torch.set_num_threads(threads)
    common = dict(dtype=dtype, device=device, max_batch_size=max(batches), max_num_tokens=4096, max_seq_len=512)
    spec: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": k}
    if draft_dir is not None:
        spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": k}
    engines = {"off": LLM(str(model_dir), **common),
               "on": LLM(str(model_dir), **common,
                         speculative_config={**spec, "disable_by_batch_size": disable_by_batch_size}),
               "always": LLM(str(model_dir), **common, speculative_config=spec)}
    first = engines["off"].engine
    special = set(first.eos_token_ids) | set(getattr(first.tokenizer, "all_special_ids", []))
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    results: dict[str, Any] = {}
    for batch in batches:
        prompts = prompts_for(first.tokenizer, first.vocab_size, special, batch, seed=batch)
        runs: dict[str, list[float]] = {name: [] for name in engines}
        accepted: dict[str, list[int]] = {name: [0, 0] for name in engines}
        reference = None
        for r in range(repeats + 1):  # round 0 warms every engine up and is not counted
            order = list(engines)[r % 3:] + list(engines)[:r % 3]
            for name in order:
                llm = engines[name]
                before = llm.stats()
                started = time.perf_counter()
                outs = llm.generate(prompts, params)
                elapsed = time.perf_counter() - started
                after = llm.stats()
                tokens = [o.token_ids for o in outs]
                reference = reference or tokens
                if tokens != reference:
                    raise RuntimeError(f"batch {batch}: engine {name!r} produced different greedy tokens")
                if r:
                    runs[name].append(sum(map(len, tokens)) / elapsed)
                    accepted[name][0] += after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
                    accepted[name][1] += after.spec_num_draft_tokens - before.spec_num_draft_tokens
                    log(f"speculative: batch {batch} repeat {r}/{repeats} {name}: {runs[name][-1]:.1f} tok/s")
        medians = {name: statistics.median(v) for name, v in runs.items()}
        results[str(batch)] = {
            "median_tok_s": medians, "runs": runs,
            "speedup": {name: medians[name] / medians["off"] for name in engines},
            "acceptance_rate": {name: (a / d if d else None) for name, (a, d) in accepted.items()},
            "output_tokens": sum(map(len, reference)),
        }
    for llm in engines.values():
        llm.shutdown()
    return {"model_dir": str(model_dir), "draft_dir": None if draft_dir is None else str(draft_dir),
            "dtype": dtype, "device": device, "threads": threads, "repeats": repeats,
            "max_tokens": max_tokens, "num_speculative_tokens": k, "disable_by_batch_size": disable_by_batch_size,
            "batches": results}


def text(doc: dict[str, Any]) -> str:
    source = "prompt-lookup" if not doc.get("draft_dir") else f"draft-model ({Path(doc['draft_dir']).name})"
    lines = [f"{source} speculation (k={doc['num_speculative_tokens']}, on = off above "
             f"{doc['disable_by_batch_size']} running), {Path(doc['model_dir']).name}, {doc['device']}, "
             f"{doc['dtype']}, {doc['threads']} threads, medians of {doc['repeats']} rotated runs",
             f"  {'batch':>5}  {'off tok/s':>10}  {'on tok/s':>10}  {'on x':>6}  {'always tok/s':>12}  "
             f"{'always x':>8}  {'accepted':>8}"]
    for batch, res in doc["batches"].items():
        m, s, acc = res["median_tok_s"], res["speedup"], res["acceptance_rate"]["always"]
        lines.append(f"  {batch:>5}  {m['off']:>10.1f}  {m['on']:>10.1f}  {s['on']:>6.2f}  {m['always']:>12.1f}  "
                     f"{s['always']:>8.2f}  {'-' if acc is None else f'{acc:.0%}':>8}")
    return "\n".join(lines)


def draft_for(model_dir: Path, draft_model: Path | None, draft_layers: int | None) -> Path | None:
    """The draft checkpoint: ``draft_model`` as given, or the model's first ``draft_layers`` layers (written
    once beside the model's cache, ``<model>-draft-<N>``), or None (prompt lookup)."""
    if draft_model is not None:
        return draft_model
    if draft_layers is None:
        return None
    from kiln.engine.random_checkpoint import make_truncated_draft

    out = model_dir.parent / f"{model_dir.name}-draft-{draft_layers}"
    if not (out / "config.json").is_file():
        make_truncated_draft(model_dir, out, draft_layers)
    return out


def damped_pair(model_dir: Path, draft_layers: int, scale: float) -> tuple[Path, Path]:
    """(target, draft) of a random-weight pair: a copy of ``model_dir`` whose layers past ``draft_layers``
    add ``scale`` times their output (``make_damped_target``), and its first ``draft_layers`` layers."""
    from kiln.engine.random_checkpoint import make_damped_target

    target = model_dir.parent / f"{model_dir.name}-damped-{draft_layers}-{scale:g}"
    if not (target / "config.json").is_file():
        make_damped_target(model_dir, target, draft_layers, scale)
    return target, draft_for(target, None, draft_layers)


def main(model_dir: Path, dtype: str, threads: int, device: str, quick: bool, repeats: int, json_out: str | None,
         echo: Callable[[str], None], log: Callable[[str], None], draft_dir: Path | None = None) -> None:
    doc = run(model_dir, dtype, threads, device, batches=(1, 4) if quick else (1, 32),
              max_tokens=24 if quick else 96, repeats=repeats, log=log, draft_dir=draft_dir)
    echo(json.dumps(doc, indent=2) if json_out == "-" else text(doc))
    if json_out and json_out != "-":
        Path(json_out).write_text(json.dumps(doc, indent=2))
