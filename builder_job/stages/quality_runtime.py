"""The build's ``quality_runtime`` stage: the quality gate's second half, on the runtime itself.

The staged artifact is loaded by ``LLM.from_artifact`` as a serving pod would; its greedy continuations
of the calibration prompts must agree with the source model's argmax, token by token
(:func:`kiln.builder.quality.runtime_agreement`), so what is published is exactly what was measured.
The source model is freed after this stage.
"""

from __future__ import annotations

import gc

from kiln.builder import quality
from kiln.builder.context import BuildContext


def run(ctx: BuildContext) -> None:
    """Generate with the runtime, compare with the source, gate on both halves' metrics."""
    llm = ctx.load_llm()
    try:
        continuations = quality.runtime_continuations(llm, ctx.token_lists)
    finally:
        llm.shutdown()  # frees the KV pool and, with TP, the worker ranks and process group
    del llm
    gc.collect()
    ctx.metrics.update(quality.runtime_agreement(ctx.source, ctx.token_lists, continuations))
    ctx.source = None
    quality.gate(ctx.spec, ctx.metrics, ctx.report)
