"""The quality gate: does the converted engine still compute the source model?

Two measurements on calibration prompts (``spec.build.calibrationPrompts`` or the
built-in :data:`CALIBRATION_PROMPTS`), both against the source checkpoint run by
transformers in float32, the definition of correct:

1. Teacher-forced, full vocabulary: the converted weights (dequantized, in the
   envelope's dtype) in the same transformers architecture, over the same tokens.
   Per position: KL(source || converted) of the next-token distributions, and
   whether both argmaxes agree. Also perplexity of both on the text.
2. The runtime itself (when the engine can load the staged artifact): greedy
   continuations of each prompt by ``LLM.from_artifact``; the source model, fed
   the same sequence, must pick the same next token at every generated position.

Both reference models are :class:`kiln.builder.reference.StreamedCausalLM`: one unit of
weights resident at a time, never a whole model (let alone two) on one device.

The gate fails when the mean KL exceeds ``qualityGate.maxKLDivergence`` or the
greedy agreement (the runtime's when measured, else the teacher-forced one) is
below ``qualityGate.minTokenAgreement``.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from kiln.builder.errors import QualityGateFailed
from kiln.builder.report import BuildReport
from kiln.engine import SamplingParams

log = logging.getLogger("kiln.build.quality")

CALIBRATION_PROMPTS = [
    "The quick brown fox jumps over the lazy dog while the farmer watches from the old wooden fence.",
    "In 1969, two astronauts landed on the Moon and spent about twenty-one hours on its surface.",
    "To make bread, mix flour, water, salt and yeast, knead the dough, let it rise, then bake it until golden.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "The mitochondria is the part of the cell that turns nutrients into energy the cell can use.",
    "Dear team, the release is scheduled for Thursday; please finish your reviews by Wednesday noon.",
    "A paged KV cache stores attention keys and values in fixed-size blocks so memory is not wasted.",
    "Rain fell all night over the harbour, and by morning the fishing boats had returned to shore.",
]
DEFAULT_MAX_KL = 0.05
DEFAULT_MIN_AGREEMENT = 0.9
MAX_TOKENS_PER_PROMPT = 128
RUNTIME_NEW_TOKENS = 12


def tokenize_prompts(tokenizer, prompts: list[str], spec) -> list[list[int]]:
    """Token ids per prompt, cut so the runtime can take them and still generate within the envelope."""
    limit = min(MAX_TOKENS_PER_PROMPT, spec.max_input_len, spec.max_seq_len - RUNTIME_NEW_TOKENS)
    out = []
    for p in prompts:
        ids = tokenizer(p, add_special_tokens=True)["input_ids"][:limit]
        if len(ids) >= 2:
            out.append(ids)
    if not out:
        raise ValueError("calibration prompts are all shorter than two tokens")
    return out


# Both models' log-probabilities of one chunk of prompts are held at once ([positions, vocab] float32
# each): chunks keep that under this, whatever the calibration set (256 prompts x 128 tokens at a
# 128k vocabulary would otherwise be ~31 GiB of host memory).
LOGPROB_BUDGET_BYTES = 1 << 30


def prompt_chunks(token_lists: list[list[int]], vocab_size: int | None) -> list[list[list[int]]]:
    """Consecutive prompts whose log-probabilities of both models fit :data:`LOGPROB_BUDGET_BYTES`."""
    if not vocab_size:
        return [token_lists]
    max_positions = max(1, LOGPROB_BUDGET_BYTES // (2 * 4 * vocab_size))
    chunks: list[list[list[int]]] = [[]]
    used = 0
    for ids in token_lists:
        if chunks[-1] and used + len(ids) > max_positions:
            chunks.append([])
            used = 0
        chunks[-1].append(ids)
        used += len(ids)
    return chunks


def teacher_forced_metrics(source, converted, token_lists: list[list[int]], vocab_size: int | None = None
                           ) -> dict[str, Any]:
    """Mean per-position KL(source || converted), argmax agreement and both perplexities.

    ``source`` and ``converted``: :class:`~kiln.builder.reference.StreamedCausalLM` (anything with
    ``log_probs(token_lists)``); each chunk of prompts (:func:`prompt_chunks`, one for the built-in
    set at a small vocabulary) is one pass over each model's weights.
    """
    kl_sum = agree = positions = 0.0
    nll_src = nll_conv = 0.0
    targets = 0
    for chunk in prompt_chunks(token_lists, vocab_size):
        for ids, lp_src, lp_conv in zip(chunk, source.log_probs(chunk), converted.log_probs(chunk), strict=True):
            kl = (lp_src.exp() * (lp_src - lp_conv)).sum(-1).clamp(min=0)
            kl_sum += kl.sum().item()
            agree += (lp_src.argmax(-1) == lp_conv.argmax(-1)).sum().item()
            positions += len(ids)
            nxt = torch.tensor(ids[1:])
            nll_src -= lp_src[:-1].gather(1, nxt[:, None]).sum().item()
            nll_conv -= lp_conv[:-1].gather(1, nxt[:, None]).sum().item()
            targets += len(ids) - 1
    return {
        "kl_divergence": kl_sum / positions, "teacher_forced_agreement": agree / positions,
        "num_positions": int(positions), "perplexity_source": math.exp(nll_src / targets),
        "perplexity_converted": math.exp(nll_conv / targets),
    }


def runtime_continuations(llm, token_lists: list[list[int]], max_new_tokens: int = RUNTIME_NEW_TOKENS,
                          lora_request=None) -> list[list[int]]:
    """Greedy continuations of each prompt by the runtime (``ignore_eos``: always ``max_new_tokens``), under
    ``lora_request`` when given (an adapter's gate)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    extra = {"lora_request": lora_request} if lora_request is not None else {}
    return [list(out.token_ids) for out in llm.generate(token_lists, params, **extra)]


def runtime_agreement(source, token_lists: list[list[int]], continuations: list[list[int]]) -> dict[str, Any]:
    """The runtime's continuations checked token by token against the source's argmax (one pass)."""
    predicted_all = source.argmax([ids + gen for ids, gen in zip(token_lists, continuations, strict=True)])
    agree = total = exact = 0
    for ids, gen, argmax in zip(token_lists, continuations, predicted_all, strict=True):
        predicted = argmax[len(ids) - 1: len(ids) - 1 + len(gen)]
        agree += sum(int(a == b) for a, b in zip(predicted, gen, strict=True))
        total += len(gen)
        exact += int(predicted == gen)
    return {"runtime_token_agreement": agree / max(total, 1), "runtime_num_tokens": total,
            "runtime_sequences_identical": exact, "runtime_num_sequences": len(token_lists)}


def thresholds(spec) -> tuple[float, float]:
    gate = getattr(spec.build, "quality_gate", None)
    max_kl = getattr(gate, "max_kl_divergence", None)
    min_agree = getattr(gate, "min_token_agreement", None)
    return (DEFAULT_MAX_KL if max_kl is None else float(max_kl),
            DEFAULT_MIN_AGREEMENT if min_agree is None else float(min_agree))


def judge(metrics: dict[str, Any], max_kl: float, min_agreement: float) -> dict[str, Any]:
    """Add the verdict to ``metrics``: the gated agreement and whether both limits hold."""
    agreement = metrics.get("runtime_token_agreement", metrics["teacher_forced_agreement"])
    if "runtime_token_agreement" in metrics:
        agreement = min(agreement, metrics["teacher_forced_agreement"])
    passed = metrics["kl_divergence"] <= max_kl and agreement >= min_agreement
    return {**metrics, "token_agreement": agreement, "max_kl_divergence": max_kl,
            "min_token_agreement": min_agreement, "passed": passed}


def gate(spec, metrics: dict[str, Any], report: BuildReport) -> dict[str, Any]:
    """Judge ``metrics`` by the spec's thresholds, into the report; :class:`QualityGateFailed` on a fail."""
    max_kl, min_agree = thresholds(spec)
    verdict = judge(metrics, max_kl, min_agree)
    report.record("quality", verdict)
    log.info("quality: KL %.3g (max %s), greedy agreement %.4f (min %s) -> %s", verdict["kl_divergence"],
             max_kl, verdict["token_agreement"], min_agree, "pass" if verdict["passed"] else "FAIL")
    if not verdict["passed"]:
        raise QualityGateFailed(failure_message(verdict), verdict)
    return verdict


def failure_message(verdict: dict[str, Any]) -> str:
    parts = []
    if verdict["kl_divergence"] > verdict["max_kl_divergence"]:
        parts.append(f"KL divergence {verdict['kl_divergence']:.3g} > "
                     f"spec.build.qualityGate.maxKLDivergence {verdict['max_kl_divergence']}")
    if verdict["token_agreement"] < verdict["min_token_agreement"]:
        parts.append(f"greedy token agreement {verdict['token_agreement']:.3f} < "
                     f"spec.build.qualityGate.minTokenAgreement {verdict['min_token_agreement']}")
    return ("quality gate failed: " + "; ".join(parts) +
            f" (over {verdict['num_positions']} calibration positions; nothing was published). Use a "
            "higher-precision dtype/quantization, or relax spec.build.qualityGate if this drift is acceptable")
