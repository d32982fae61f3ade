"""The adapter's quality gate: what will be served against transformers + PEFT with the adapter as published.

Reference: the base checkpoint in float32 with the *original* adapter applied by PEFT (unmerged). Candidate:
the base in the engine's dtype with the *converted* adapter merged into its weights (``merge_and_unload``),
which is what a LoRA slot computes (``W x + B A x * alpha / r``) up to rounding. Both are teacher-forced
over the calibration prompts (:func:`kiln.builder.quality.teacher_forced_metrics`: mean KL and greedy
agreement), and judged by ``spec.build.qualityGate``.

The runtime half: kiln's own engine (``LLM(..., enable_lora=True)``, the converted adapter as a per-request
``LoRARequest``) continues each prompt greedily, and its tokens must agree with the reference's argmax, as
the engine's gate checks the runtime (:func:`kiln.builder.quality.runtime_agreement`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from kiln.builder.errors import QualityGateFailed
from kiln.builder.quality import (
    CALIBRATION_PROMPTS,
    RUNTIME_NEW_TOKENS,
    failure_message,
    judge,
    runtime_agreement,
    runtime_continuations,
    teacher_forced_metrics,
    thresholds,
    tokenize_prompts,
)


class _HFLogProbs:
    """A transformers model as the gate's ``log_probs(token_lists)``."""

    def __init__(self, model) -> None:
        self.model = model.eval()

    @torch.no_grad()
    def log_probs(self, token_lists: list[list[int]]) -> list[torch.Tensor]:
        out = []
        for ids in token_lists:
            logits = self.model(input_ids=torch.tensor([ids])).logits[0].float()
            out.append(torch.log_softmax(logits, -1))
        return out


def _token_lists(base_dir: Path, spec, vocab: int) -> list[list[int]]:
    prompts = spec.build.calibration_prompts or CALIBRATION_PROMPTS
    try:
        from transformers import AutoTokenizer

        return tokenize_prompts(AutoTokenizer.from_pretrained(base_dir), prompts[:8], spec)
    except (OSError, ValueError):  # a checkpoint without a tokenizer (toy models): fixed pseudo-random ids
        gen = torch.Generator().manual_seed(0)
        return [torch.randint(0, vocab, (16,), generator=gen).tolist() for _ in range(4)]


def adapter_metrics(base_dir: Path, original: Path, converted: Path, spec) -> dict[str, Any]:
    """Teacher-forced KL and agreement of the merged, converted adapter against PEFT's original."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                          original)
    dtype = getattr(torch, spec.dtype)
    candidate = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype),
                                          converted).merge_and_unload()
    vocab = reference.config.vocab_size
    token_lists = _token_lists(base_dir, spec, vocab)
    metrics = teacher_forced_metrics(_HFLogProbs(reference), _HFLogProbs(candidate), token_lists, vocab)
    del candidate
    continuations = _runtime_continuations(base_dir, converted, spec, token_lists)
    metrics.update(runtime_agreement(_HFArgmax(reference), token_lists, continuations))
    return {**metrics, "reference": "transformers+peft (float32, unmerged)",
            "candidate": f"transformers ({spec.dtype}, converted adapter merged)",
            "runtime": f"kiln LLM ({spec.dtype}, the converted adapter in a LoRA slot)"}


class _HFArgmax:
    """A transformers model as :func:`kiln.builder.quality.runtime_agreement`'s ``argmax(token_lists)``."""

    def __init__(self, model) -> None:
        self.model = model.eval()

    @torch.no_grad()
    def argmax(self, token_lists: list[list[int]]) -> list[list[int]]:
        return [self.model(input_ids=torch.tensor([ids])).logits[0].argmax(-1).tolist() for ids in token_lists]


def _runtime_continuations(base_dir: Path, converted: Path, spec, token_lists: list[list[int]]) -> list[list[int]]:
    """Greedy continuations of each prompt by kiln's engine with the converted adapter."""
    from kiln.engine import LLM  # deferred: the engine (torch) only when an adapter is gated
    from kiln.engine.lora import LoRARequest

    longest = max(len(ids) for ids in token_lists) + RUNTIME_NEW_TOKENS
    llm = LLM(str(base_dir), dtype=spec.dtype, enable_lora=True, max_loras=1, max_lora_rank=spec.lora.max_lora_rank,
              max_seq_len=longest + 1, max_input_len=longest, max_batch_size=len(token_lists),
              max_num_tokens=max(256, len(token_lists)), num_kv_blocks=len(token_lists) * (longest // 16 + 2),
              device=None if spec.gpu_spec.arch != "cpu" else "cpu")
    try:
        lora = LoRARequest("gate", 1, str(converted))
        return runtime_continuations(llm, token_lists, lora_request=lora)
    finally:
        llm.shutdown()


def gate_adapter(base_dir: Path, original: Path, converted: Path, spec, name: str) -> dict[str, Any]:
    """The verdict; :class:`QualityGateFailed` (exit 4, nothing published) when it fails."""
    max_kl, min_agree = thresholds(spec)
    verdict = judge(adapter_metrics(base_dir, original, converted, spec), max_kl, min_agree)
    if not verdict["passed"]:
        raise QualityGateFailed(f"adapter {name}: " + failure_message(verdict), verdict)
    return verdict
