"""The streamed reference computes what whole transformers models compute, without holding one.

The expected values are the gate's previous definition, written out here: the source through
``from_pretrained(dtype=float32)``, the converted weights in ``copy.deepcopy(source).to(dtype)``, one
prompt per forward.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from kiln.builder import quality
from kiln.builder.convert import convert_state_dict, dequantized_state_dict, load_checkpoint
from kiln.builder.reference import StreamedCausalLM, batches


def whole_models(model_dir, dtype: str, quantization: str):
    from transformers import AutoModelForCausalLM

    source = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    converted, _ = convert_state_dict(load_checkpoint(model_dir), dtype, quantization)
    model = copy.deepcopy(source).to(getattr(torch, dtype))
    model.load_state_dict(dequantized_state_dict(converted, dtype), strict=False)
    return source, model.eval()


class Whole:
    """The old gate's reference: a whole model, one prompt per forward."""

    def __init__(self, model) -> None:
        self.model = model

    @torch.inference_mode()
    def log_probs(self, token_lists):
        return [torch.log_softmax(self.model(torch.tensor([ids])).logits[0].float(), -1) for ids in token_lists]

    def argmax(self, token_lists):
        return [lp.argmax(-1).tolist() for lp in self.log_probs(token_lists)]


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]


@pytest.mark.parametrize("preset,dtype,quantization", [
    ("llama-tiny", "float32", "none"), ("qwen2-tiny", "bfloat16", "none"),  # qwen2-tiny ties its LM head
    ("llama-tiny", "float32", "int8"), ("llama-tiny", "bfloat16", "fp8"),
])
def test_streamed_metrics_equal_whole_models(toy_model, preset, dtype, quantization):
    model_dir = toy_model(preset)
    token_lists = prompts(1024)
    source, converted = StreamedCausalLM(model_dir, "cpu"), StreamedCausalLM(model_dir, "cpu", dtype, quantization)
    got = quality.teacher_forced_metrics(source, converted, token_lists)
    want = quality.teacher_forced_metrics(*map(Whole, whole_models(model_dir, dtype, quantization)), token_lists)
    assert got["num_positions"] == want["num_positions"]
    # One batched forward instead of one per prompt: the same in float32 up to summation order; a bfloat16
    # model rounds its matmuls differently (measured: perplexity 3e-4, KL 3e-3 apart, relative).
    tol = 1e-4 if dtype == "float32" else 1e-2
    for key in ("kl_divergence", "perplexity_source", "perplexity_converted"):
        assert math.isclose(got[key], want[key], rel_tol=tol, abs_tol=1e-7), (key, got[key], want[key])
    # ... which may flip a near-tie of a random model's flat distributions: at most one position.
    assert abs(got["teacher_forced_agreement"] - want["teacher_forced_agreement"]) <= 1 / got["num_positions"]
    if dtype == "float32" and quantization == "none":
        assert got["kl_divergence"] == 0.0  # both passes run the same tensors through the same code
    s = converted.convert_summary
    assert s["num_tensors"] == len(load_checkpoint(model_dir))  # a tied head's tensor is counted once
    assert (s["num_quantized_tensors"] > 0) == (quantization != "none")
    # After a pass no weight stays resident: every parameter is back on the meta device.
    assert all(p.device.type == "meta" for p in converted.model.parameters())


def test_runtime_agreement_uses_the_source_argmax_over_prompt_and_continuation(toy_model):
    model_dir = toy_model("llama-tiny")
    token_lists = prompts(1024)
    whole = Whole(whole_models(model_dir, "float32", "none")[0])
    # Continuations that are the source's own greedy choices agree everywhere; one changed token does not.
    continuations = []
    for ids in token_lists:
        seq = list(ids)
        for _ in range(4):
            seq.append(whole.argmax([seq])[0][-1])
        continuations.append(seq[len(ids):])
    streamed = StreamedCausalLM(model_dir, "cpu")
    assert quality.runtime_agreement(streamed, token_lists, continuations)["runtime_token_agreement"] == 1.0
    continuations[0][0] = (continuations[0][0] + 1) % 1024
    got = quality.runtime_agreement(streamed, token_lists, continuations)
    assert got == quality.runtime_agreement(whole, token_lists, continuations)
    assert got["runtime_sequences_identical"] == len(token_lists) - 1


def test_batches_keep_padded_tokens_within_the_budget():
    lists = [[1] * n for n in (10, 40, 5, 100, 3)]
    out = list(batches(lists, 120))
    assert [x for b in out for x in b] == lists
    assert all(len(b) * max(map(len, b)) <= 120 or len(b) == 1 for b in out)
    assert [len(b) for b in out] == [3, 1, 1]


def test_metrics_in_chunks_equal_one_pass_and_bound_memory(toy_model, monkeypatch):
    """A calibration set too big for the log-probability budget runs in chunks of prompts (one more pass
    over the weights per chunk) with the same metrics as one pass."""
    model_dir = toy_model("llama-tiny")
    token_lists = prompts(1024)
    source, converted = StreamedCausalLM(model_dir, "cpu"), StreamedCausalLM(model_dir, "cpu", "float32", "int8")
    whole = quality.teacher_forced_metrics(source, converted, token_lists)
    budget = 2 * 4 * 1024 * 32  # room for 32 positions of both models at vocab 1024
    monkeypatch.setattr(quality, "LOGPROB_BUDGET_BYTES", budget)
    chunks = quality.prompt_chunks(token_lists, 1024)
    assert [len(c) for c in chunks] == [3, 1]  # lengths 5+17+9 | 30: each chunk within 32 positions
    assert sum(chunks, []) == token_lists
    chunked = quality.teacher_forced_metrics(source, converted, token_lists, vocab_size=1024)
    # Equal up to float32 rounding: torch's GEMM blocks a 3-prompt chunk otherwise than all 4 prompts on some
    # hosts (an AVX2 EPYC: KL 1.34203e-05 vs 1.34224e-05), and a KL near 1e-5 is a difference of nearly equal
    # log-probabilities. A chunk weighted wrongly moves it by far more than 0.1 %.
    for key, value in whole.items():
        assert math.isclose(chunked[key], value, rel_tol=1e-3, abs_tol=1e-8), (key, chunked[key], value)


def test_a_checkpoint_missing_a_tensor_is_named_in_one_line(toy_model, tmp_path):
    """An untied config whose checkpoint lacks lm_head.weight: an invalid-spec error naming the tensor
    (exit 2), not a traceback from inside the gate."""
    import shutil

    from kiln.builder.errors import InvalidSpec
    from safetensors.torch import load_file, save_file

    src = toy_model("llama-tiny")
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    (weights,) = broken.glob("*.safetensors")
    tensors = load_file(weights)
    del tensors["lm_head.weight"]
    save_file(tensors, weights)
    with pytest.raises(InvalidSpec, match=r"the checkpoint has no tensor 'lm_head.weight' that config.json implies"):
        StreamedCausalLM(broken, "cpu")
