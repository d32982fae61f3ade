"""The build's ``quality_reference`` stage: the quality gate's first half, on reference models.

The source checkpoint and the converted weights (the envelope's dtype and quantization) each run in a
streamed reference model (:class:`kiln.builder.reference.StreamedCausalLM`, one unit of weights at a
time), teacher-forced over the calibration prompts; the gate (:func:`kiln.builder.quality.gate`) fails
the build before anything is sharded when they drift apart. The conversion happens here, as the gate
streams the weights (its summary is the report's ``convert``). With a draft model, the draft is
checked against the target's tokenizer first (:func:`kiln.builder.draft_model.check_draft`).
"""

from __future__ import annotations

import logging

from kiln.builder import quality
from kiln.builder.context import BuildContext
from kiln.builder.draft_model import check_draft, draft_kv_bytes_per_token
from kiln.builder.reference import StreamedCausalLM, choose_cpu_threads
from transformers import AutoTokenizer

log = logging.getLogger("kiln.build")


def run(ctx: BuildContext) -> None:
    """Tokenize the calibration prompts, check the draft, measure the converted weights and gate them."""
    spec = ctx.spec
    ctx.tokenizer = AutoTokenizer.from_pretrained(str(ctx.checkpoint.path), trust_remote_code=False)
    if ctx.has_draft_model:
        draft_facts = check_draft(spec, ctx.draft_checkpoint, ctx.tokenizer)
        ctx.report.record("draft_model", draft_facts.to_dict())
        ctx.draft_kv_bytes_per_token = draft_kv_bytes_per_token(draft_facts, spec)
    ctx.prompts = spec.build.calibration_prompts or quality.CALIBRATION_PROMPTS
    ctx.token_lists = quality.tokenize_prompts(ctx.tokenizer, ctx.prompts, spec)
    _measure_converted(ctx)
    quality.gate(spec, ctx.metrics, ctx.report)


def _measure_converted(ctx: BuildContext) -> None:
    """Teacher-forced metrics of the converted weights against the source; the source stays for the runtime gate."""
    spec = ctx.spec
    if ctx.device == "cpu":
        choose_cpu_threads()
    ctx.source = StreamedCausalLM(ctx.checkpoint.path, ctx.device)
    converted = StreamedCausalLM(ctx.checkpoint.path, ctx.device, spec.dtype, spec.quantization)
    ctx.metrics = quality.teacher_forced_metrics(ctx.source, converted, ctx.token_lists, ctx.facts.vocab_size)
    ctx.metrics["num_prompts"] = len(ctx.token_lists)
    ctx.metrics["calibration_prompts"] = "spec" if spec.build.calibration_prompts else "builtin"
    summary = converted.convert_summary
    ctx.report.record("convert", summary)
    log.info("converted %d tensors to %s (%d quantized, %s) as the gate streamed them", summary["num_tensors"],
             spec.dtype, summary["num_quantized_tensors"], spec.quantization)
    del converted
