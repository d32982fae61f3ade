"""The build's ``quality_runtime`` stage: the quality gate's second half, on the runtime itself.

The staged artifact is loaded by ``LLM.from_artifact`` as a serving pod would; its greedy continuations
of the calibration prompts must agree with the source model's argmax, token by token
(:func:`kiln.builder.quality.runtime_agreement`), so what is published is exactly what was measured.

An int8 CPU engine may also run W8A8 (the candidates that quantize activations,
``candidates.ACTIVATION_QUANT``: kiln's per-32-block ``kiln-w8a8``, torch's per-call ``torch-w8a8``), which
changes the numerics, each in its own way: the gate measures the engine with each of them forced on every
int8 linear, and each that fails the model's thresholds (or cannot run on the build host, so could not be
measured) goes into the engine's ``tactics_exclude``, out of every tactic table, the build's and each serving
host's (docs/quantization.md). Where W8A8 runs, an int8 engine's LM head runs int8 too (``lm_head_int8:
auto``, ``tactics.bind.quantize_head``); a candidate that fails so is measured again with the head kept, and
where that passes the engine ships ``lm_head_int8: off``. The gated engine itself runs without W8A8. The
source model is freed after this stage.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import torch
from kiln.builder import quality
from kiln.builder.context import BuildContext
from kiln.engine import ConfigError
from kiln.engine.kernels import candidates, native
from kiln.engine.kernels.candidates import ALIASES

log = logging.getLogger("kiln.build")
W8A8 = "w8a8"


def run(ctx: BuildContext) -> None:
    """Generate with the runtime, compare with the source, gate on both halves' metrics."""
    w8a8 = _gates_w8a8(ctx)
    continuations = _continuations(ctx, {"tactics_exclude": [W8A8]} if w8a8 else {})
    ctx.metrics.update(quality.runtime_agreement(ctx.source, ctx.token_lists, continuations))
    if w8a8:
        ctx.report.record("w8a8_gate", _w8a8_verdict(ctx))
    ctx.source = None
    quality.gate(ctx.spec, ctx.metrics, ctx.report)


def _gates_w8a8(ctx: BuildContext) -> bool:
    return ctx.spec.quantization == "int8" and ctx.device == "cpu" and W8A8 in ALIASES


def _continuations(ctx: BuildContext, overrides: dict[str, Any]) -> list[list[int]]:
    llm = ctx.load_llm(**overrides)
    try:
        return quality.runtime_continuations(llm, ctx.token_lists)
    finally:
        llm.shutdown()  # frees the KV pool and, with TP, the worker ranks and process group
        del llm
        gc.collect()


def _w8a8_verdict(ctx: BuildContext) -> dict[str, Any]:
    """Each W8A8 candidate forced on every int8 linear, against the source; those that fail the thresholds
    (or cannot run on the build host, so could not be measured) are excluded from the artifact's tables."""
    verdicts = {name: _candidate_verdict(ctx, name, {}) for name in ALIASES[W8A8]}
    for name, verdict in list(verdicts.items()):  # measured with the head in int8 (lm_head_int8: auto)
        if not verdict["allowed"] and "runtime_token_agreement" in verdict:
            kept = _candidate_verdict(ctx, name, {"lm_head_int8": "off"})
            if kept["allowed"]:  # passes with the LM head kept in the engine's dtype: ship it so
                verdicts[name] = {**kept, "lm_head": "kept", "with_int8_head": verdict}
                ctx.config = {**ctx.config, "lm_head_int8": "off"}
    refused = sorted(name for name, v in verdicts.items() if not v["allowed"])
    if refused:
        exclude = [W8A8] if len(refused) == len(verdicts) else refused
        ctx.config = {**ctx.config, "tactics_exclude": exclude}
    allowed = sorted(set(verdicts) - set(refused))
    log.info("quality: W8A8 %s", f"allowed on {', '.join(allowed)}" if allowed else "excluded")
    return {"allowed": bool(allowed), "allowed_candidates": allowed, "excluded": refused, "candidates": verdicts}


def _candidate_verdict(ctx: BuildContext, name: str, head: dict[str, str]) -> dict[str, Any]:
    _, min_agreement = quality.thresholds(ctx.spec)
    dtype = getattr(torch, str(ctx.config.get("dtype", "float32")))
    # as the forced engine loads (tactics_exclude: []): forced where it cannot run, it would not run
    why = candidates.why_not(name, dtype, native.kernels(), "int8", exclude=())
    try:
        if why:
            raise ConfigError(why)
        continuations = _continuations(ctx, {"tactics": name, "tactics_exclude": [], **head})
    except (ConfigError, RuntimeError, ValueError) as exc:
        return {"allowed": False, "why": f"{name} does not run on the build host, so was not measured ({exc})"}
    agreement = quality.runtime_agreement(ctx.source, ctx.token_lists, continuations)
    allowed = agreement["runtime_token_agreement"] >= min_agreement
    log.info("quality: %s greedy agreement %.4f (min %s)", name, agreement["runtime_token_agreement"], min_agreement)
    return {**agreement, "min_token_agreement": min_agreement, "allowed": allowed,
            "why": "greedy agreement within the gate" if allowed else
            "greedy agreement under spec.build.qualityGate.minTokenAgreement"}
