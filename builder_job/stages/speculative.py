"""The build's ``speculative`` stage: where speculation pays on the target, as a table.

Runs for ``spec.speculative.method: ngram`` and ``draft_model`` (the draft converted into the staged
artifact's ``draft/`` folder in the ``shard`` stage by :mod:`kiln.builder.draft_model`, loaded once with
the engine). Drafts cost compute: verifying ``k`` of them is about one token's pass while a step is
bound by reading the weights (small batches), and about ``k + 1`` tokens' once it is bound by arithmetic
(large batches, CPUs), so whether speculation pays depends on the running batch and on the hardware.
This stage measures it on the target, through the runtime, on the staged artifact as it will serve
(tuned threads, tactics, compile choice):

- workload: "rewrite" prompts built from the calibration prompts (``spec.build.calibrationPrompts`` or
  the built-in set): a chat turn asking to rewrite the text word for word where the model has a chat
  template, else the text's tokens twice over, so a model that follows the instruction (or continues
  the repetition) copies its prompt and n-gram drafts have something to find (kiln bench
  --speculative's idea, without importing the bench); greedy, ``ignore_eos``, :data:`NEW_TOKENS` new
  tokens per request;
- settings: no speculation, and ``k`` in :data:`K_CANDIDATES` (at most ``numSpeculativeTokens``, which is
  always one of them), switched on one loaded engine (``LLMEngine.set_speculative``), in rotated order,
  after a warm-up, :data:`ROUNDS` rounds or more (up to :data:`MAX_ROUNDS`, while the bucket's share of
  the budget lasts), the best round of each (shared build hosts are noisy);
- batch sizes: :data:`BATCH_SIZES` up to ``maxBatchSize`` (and ``maxBatchSize`` itself), ascending,
  within :data:`BUDGET_S` (``$KILN_SPECULATIVE_BUDGET_S``); after :data:`STOP_AFTER_OFF` buckets in a
  row where it did not pay, or when the budget would run out, the larger buckets are recorded off
  without timing (the gain only shrinks as the batch grows).

A bucket speculates, with the fastest ``k``, when that is at least :data:`MIN_GAIN` faster than no
speculation; otherwise it gets 0. Every setting must produce the same greedy tokens as no speculation;
if one does not, the whole table is off (and the record says why). The result goes into
``engine_config.speculative_config`` (vLLM's names plus ``by_batch``, the table the scheduler follows:
``kiln.engine.spec_decode.config``) and, with every number measured, into ``tuning.speculative`` and
the build report.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from kiln.builder.context import BuildContext
from kiln.builder.stages.package import write_engine
from kiln.engine import SamplingParams
from kiln.engine.spec_decode.config import SpeculativeConfig
from kiln.engine.spec_decode.draft_model import ARTIFACT_DRAFT_DIR

log = logging.getLogger("kiln.build.speculative")

BUDGET_S = 60.0
BUDGET_ENV = "KILN_SPECULATIVE_BUDGET_S"
BATCH_SIZES = (1, 2, 4, 8, 16, 32)
K_CANDIDATES = (2, 4)
MIN_GAIN = 0.05
NEW_TOKENS = 32
INSTRUCTION = "Rewrite the following text exactly as it is, word for word:\n\n"
ROUNDS = 2  # at least, per batch bucket; more while the bucket's share of the budget lasts
MAX_ROUNDS = 9
STOP_AFTER_OFF = 2


def run(ctx: BuildContext) -> None:
    """Where drafts pay, per batch bucket, on the engine as built: the table into the engine config."""
    write_engine(ctx)
    draft_dir = str(ctx.out / ARTIFACT_DRAFT_DIR) if ctx.has_draft_model else None
    workload = rewrite_workload(ctx.tokenizer, ctx.prompts, ctx.spec)
    record, overrides = tune_speculation(ctx.load_llm, ctx.spec, workload, draft_dir)
    ctx.tuning["speculative"] = record
    ctx.report.record("speculative", record)
    ctx.config = {**ctx.config, **overrides}


def batch_sizes(max_batch_size: int) -> list[int]:
    return sorted({b for b in BATCH_SIZES if b <= max_batch_size} | {min(max_batch_size, BATCH_SIZES[-1])})


def k_candidates(max_k: int) -> list[int]:
    return sorted({k for k in K_CANDIDATES if k <= max_k} | {max_k})


def new_tokens_for(spec) -> int:
    return max(1, min(NEW_TOKENS, spec.max_seq_len // 4))


def rewrite_workload(tokenizer, texts: list[str], spec) -> list[list[int]]:
    """One "rewrite this word for word" prompt per calibration text: a chat turn where the tokenizer has a
    chat template, else the text's tokens twice over; each fits ``maxInputLen`` with room for the output."""
    limit = min(spec.max_input_len, spec.max_seq_len - new_tokens_for(spec))
    out = []
    for text in texts:
        ids: list[int] = []
        if getattr(tokenizer, "chat_template", None):
            chat = tokenizer.apply_chat_template([{"role": "user", "content": INSTRUCTION + text}],
                                                 add_generation_prompt=True, tokenize=True)
            ids = list(chat["input_ids"] if hasattr(chat, "keys") else chat)
        if not ids or len(ids) > limit:
            half = tokenizer(text, add_special_tokens=True)["input_ids"][:max(1, limit // 2)]
            ids = half * 2
        out.append(ids)
    return out


def cycle(workload: list[list[int]], count: int) -> list[list[int]]:
    return [workload[i % len(workload)] for i in range(count)]


def speculative_config(spec, by_batch: dict[str, int]) -> dict[str, Any]:
    """``engine_config.speculative_config``: the spec's settings and the measured table (a draft model as
    the artifact's folder, resolved against the artifact at load)."""
    s = spec.speculative
    config = {"method": s.method, "num_speculative_tokens": s.num_speculative_tokens,
              "prompt_lookup_max": s.prompt_lookup_max, "prompt_lookup_min": s.prompt_lookup_min,
              "by_batch": by_batch}
    if s.method == "draft_model":
        config["model"] = ARTIFACT_DRAFT_DIR
    return config


def _budget() -> float:
    try:
        return float(os.environ.get(BUDGET_ENV, BUDGET_S))
    except ValueError:
        return BUDGET_S


def _run(llm, prompts: list[list[int]], setting, new_tokens: int) -> tuple[float, list[list[int]], Any]:
    """(seconds, greedy tokens, spec stats or None) of one batch under ``setting`` (a config or None)."""
    llm.engine.set_speculative(setting)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    proposer = llm.engine.scheduler.proposer
    return seconds, [o.token_ids for o in outs], None if proposer is None else proposer.stats


@dataclass
class _Timings:
    """What the buckets timed so far found: the table, each bucket's record, the first greedy mismatch."""
    sizes: list[int]
    by_batch: dict[str, int] = field(default_factory=dict)
    batches: dict[str, Any] = field(default_factory=dict)
    mismatch: str | None = None
    costs: list[float] = field(default_factory=list)  # seconds of one round at each bucket timed
    num_off: int = 0  # buckets in a row where speculation did not pay

    def __post_init__(self) -> None:
        self.by_batch = {str(b): 0 for b in self.sizes}


def _settings(spec, ks: list[int], draft_dir: str | None) -> dict[str, Any]:
    """"off" (None) and one SpeculativeConfig per ``k``, named ``k<k>``."""
    s = spec.speculative
    settings: dict[str, SpeculativeConfig | None] = {"off": None}
    for k in ks:
        settings[f"k{k}"] = SpeculativeConfig(method=s.method, num_speculative_tokens=k,
                                              prompt_lookup_max=s.prompt_lookup_max,
                                              prompt_lookup_min=s.prompt_lookup_min, model=draft_dir)
    return settings


def tune_speculation(load_llm, spec, workload: list[list[int]], draft_dir: str | None = None
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Measure and decide on ``workload`` (:func:`rewrite_workload`; see the module doc); returns (the
    record, engine_config overrides). ``draft_dir``: the staged draft model (method draft_model)."""
    s = spec.speculative
    new_tokens = new_tokens_for(spec)
    ks = k_candidates(s.num_speculative_tokens)
    settings = _settings(spec, ks, draft_dir)
    budget = _budget()
    found = _Timings(batch_sizes(spec.max_batch_size))
    started = time.perf_counter()
    llm = load_llm(speculative_config=settings[f"k{ks[-1]}"] if draft_dir else None)  # the draft loads once
    try:
        _run(llm, cycle(workload, 1), settings[f"k{ks[-1]}"], 4)  # warm-up
        for i in range(len(found.sizes)):
            left = budget - (time.perf_counter() - started)
            _time_bucket(llm, workload, settings, ks, new_tokens, i, left, found)
    finally:
        llm.shutdown()
    by_batch = found.by_batch
    if found.mismatch is not None:
        log.warning("speculation off at every batch size: %s", found.mismatch)
        by_batch = {b: 0 for b in by_batch}
    record = {"method": s.method, "num_speculative_tokens": s.num_speculative_tokens, "k_candidates": ks,
              "new_tokens": new_tokens, "rounds": ROUNDS, "min_gain": MIN_GAIN, "budget_s": budget,
              "seconds": round(time.perf_counter() - started, 2), "batches": found.batches,
              "by_batch": by_batch,
              "greedy_equal": found.mismatch is None, "mismatch": found.mismatch}
    record["summary"] = summary(record)
    for line in record["summary"]:
        log.info("%s", line)
    return record, {"speculative_config": speculative_config(spec, by_batch)}


def _time_bucket(llm, workload: list[list[int]], settings: dict[str, Any], ks: list[int], new_tokens: int,
                 i: int, left: float, found: _Timings) -> None:
    """Time the ``i``-th batch bucket (``left``: seconds of the budget left) and decide its ``k`` into
    ``found``, or record it untimed where the budget or the buckets below say it cannot pay."""
    sizes, b = found.sizes, found.sizes[i]
    estimate = ROUNDS * _next_round_cost(found.costs, b / sizes[i - 1]) if i else 0.0
    if found.num_off >= STOP_AFTER_OFF or estimate > left:
        why = "budget" if found.num_off < STOP_AFTER_OFF else "no gain below"
        found.batches[str(b)] = {"measured": False, "why": why}
        return
    share = left / (len(sizes) - i)  # this bucket's part of what is left
    t_batch = time.perf_counter()
    prompts = cycle(workload, b)
    tok_s, accepted, rounds = _time_rounds(llm, prompts, settings, new_tokens, t_batch, share, found)
    found.costs.append((time.perf_counter() - t_batch) / rounds)
    best = max(ks, key=lambda k: tok_s[f"k{k}"])
    speedup = tok_s[f"k{best}"] / tok_s["off"]
    chosen = best if speedup >= 1 + MIN_GAIN else 0
    found.by_batch[str(b)] = chosen
    found.num_off = 0 if chosen else found.num_off + 1
    found.batches[str(b)] = {"measured": True, "rounds": rounds,
                             "tok_s": {n: round(v, 1) for n, v in tok_s.items()}, "acceptance_rate": accepted,
                             "best_k": best, "speedup": round(speedup, 3), "k": chosen}
    log.info("speculative: batch %d: off %.1f tok/s, %s -> k=%d", b, tok_s["off"],
             ", ".join(f"k={k} {tok_s[f'k{k}']:.1f} tok/s" for k in ks), chosen)


def _time_rounds(llm, prompts: list[list[int]], settings: dict[str, Any], new_tokens: int, t_batch: float,
                 share: float, found: _Timings) -> tuple[dict[str, float], dict[str, float | None], int]:
    """Rounds of every setting in rotated order, :data:`ROUNDS` or more while ``share`` lasts; (the best
    tokens/s of each, its acceptance rate, the rounds run). A greedy mismatch goes into ``found``."""
    b = len(prompts)
    tok_s: dict[str, float] = {}
    accepted: dict[str, float | None] = {}
    reference = None
    names = list(settings)
    r = 0
    while r < ROUNDS or (r < MAX_ROUNDS and (time.perf_counter() - t_batch) * (r + 1) / r < share):
        for name in names[r % len(names):] + names[:r % len(names)]:
            seconds, tokens, stats = _run(llm, prompts, settings[name], new_tokens)
            reference = reference if reference is not None else tokens
            if tokens != reference and found.mismatch is None:
                found.mismatch = f"batch {b}: {name} produced other greedy tokens than speculation off"
            tok_s[name] = max(tok_s.get(name, 0.0), b * new_tokens / seconds)
            if stats is not None:
                accepted[name] = round(stats.acceptance_rate, 3)
        r += 1
    return tok_s, accepted, r


def _next_round_cost(costs: list[float], batch_ratio: float) -> float:
    """A round's cost at the next bucket: the last one's, grown as it grew from the bucket before (a
    step costs less than ``batch_ratio`` times more while it is bound by reading the weights), at most
    by ``batch_ratio``."""
    if len(costs) < 2:
        return costs[-1] * batch_ratio
    return costs[-1] * min(batch_ratio, max(1.0, costs[-1] / costs[-2]))


def summary(record: dict[str, Any]) -> list[str]:
    """One line per batch bucket: tokens/s off and per k, the speed-up, the k chosen (0 = off)."""
    ks = record["k_candidates"]
    lines = [f"{'batch':>5}  {'off tok/s':>9}  " + "  ".join(f"{f'k={k} tok/s':>10}" for k in ks)
             + f"  {'best x':>6}  {'accepted':>8}  use"]
    for b, row in record["batches"].items():
        use = record["by_batch"][b]
        if not row["measured"]:
            lines.append(f"{b:>5}  {'-':>9}  " + "  ".join(f"{'-':>10}" for _ in ks)
                         + f"  {'-':>6}  {'-':>8}  off (not timed: {row['why']})")
            continue
        t, acc = row["tok_s"], row["acceptance_rate"].get(f"k{row['best_k']}")
        lines.append(f"{b:>5}  {t['off']:>9.1f}  " + "  ".join(f"{t[f'k{k}']:>10.1f}" for k in ks)
                     + f"  {row['speedup']:>6.2f}  {'-' if acc is None else f'{acc:.0%}':>8}  "
                     + (f"k={use}" if use else "off"))
    return lines
