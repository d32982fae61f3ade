"""The build's ``quality_runtime`` stage: the quality gate's second half, on the runtime itself.

The staged artifact is loaded by ``LLM.from_artifact`` as a serving pod would; its greedy continuations
of the calibration prompts must agree with the source model's argmax, token by token
(:func:`kiln.builder.quality.runtime_agreement`), so what is published is exactly what was measured.

An int8 CPU engine may also run W8A8 (activations quantized per token: ``kiln-w8a8``), which changes the
numerics: the gate measures the engine with W8A8 forced on as well, and where that fails the model's
thresholds, the engine's ``tactics_exclude`` takes W8A8 out of every tactic table, the build's and each
serving host's (docs/quantization.md). The gated engine itself runs without W8A8. The source model is
freed after this stage.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

from kiln.builder import quality
from kiln.builder.context import BuildContext
from kiln.engine import ConfigError
from kiln.engine.kernels.candidates import ALIASES

log = logging.getLogger("kiln.build")
W8A8 = "w8a8"
W8A8_FORCED = "kiln-w8a8"  # the candidate the gate forces on every int8 linear to measure W8A8


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
    """The engine with W8A8 on every int8 linear, against the source; where it fails the thresholds (or
    cannot run on the build host, so could not be measured), W8A8 is excluded from the artifact's tables."""
    _, min_agreement = quality.thresholds(ctx.spec)
    try:
        continuations = _continuations(ctx, {"tactics": W8A8_FORCED, "tactics_exclude": []})
    except (ConfigError, RuntimeError, ValueError) as exc:
        verdict = {"allowed": False, "why": f"W8A8 does not run on the build host, so was not measured ({exc})"}
    else:
        agreement = quality.runtime_agreement(ctx.source, ctx.token_lists, continuations)
        allowed = agreement["runtime_token_agreement"] >= min_agreement
        verdict = {**agreement, "min_token_agreement": min_agreement, "allowed": allowed,
                   "why": "greedy agreement within the gate" if allowed else
                   "greedy agreement under spec.build.qualityGate.minTokenAgreement"}
    if not verdict["allowed"]:
        ctx.config = {**ctx.config, "tactics_exclude": [W8A8]}
    log.info("quality: W8A8 %s (%s)", "allowed" if verdict["allowed"] else "excluded", verdict["why"])
    return verdict
