"""The GPU engine's greedy tokens against transformers on the same GPU, for every way a GPU engine runs:
attention backend (triton, torch) x eager / CUDA graphs x weights (bf16, int8, fp8 where the capability has
it). Marked ``gpu``: skipped without a CUDA device; ``make gpu-check`` runs it first where one is lent.

The reference is transformers in float32 on the GPU. float32 kiln must equal it token for token. Lower
precisions round in another order than the reference, so they follow vLLM's rule for its own equality
suite (``check_logprobs_close``): tokens equal up to the first place they differ, and there each side's
token is among the other's five most likely, after which the sequences are not compared.
"""

from __future__ import annotations

import pytest
import torch
from engine_testlib import random_prompts
from kiln.engine import SamplingParams

TOKENS, TOP = 12, 5
_REFERENCE: dict = {}


def _fp8_ok() -> bool:
    from kiln.engine.kernels.fp8 import device_runs_fp8

    return torch.cuda.is_available() and device_runs_fp8(torch.device("cuda"))


def reference(model_dir, prompts) -> list[tuple[list[int], list[set[int]]]]:
    """transformers, float32 on the GPU: greedy tokens and the top-5 token ids at each step."""
    from transformers import AutoModelForCausalLM

    key = str(model_dir)
    if key not in _REFERENCE:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda").eval()
        out = []
        for p in prompts:
            with torch.no_grad():
                gen = model.generate(torch.tensor([p], device="cuda"), do_sample=False, max_new_tokens=TOKENS,
                                     pad_token_id=0, output_scores=True, return_dict_in_generate=True)
            tokens = gen.sequences[0, len(p):].tolist()
            out.append((tokens, [set(s[0].topk(TOP).indices.tolist()) for s in gen.scores]))
        _REFERENCE[key] = out
        del model
        torch.cuda.empty_cache()
    return _REFERENCE[key]


def close(kiln_tokens, kiln_top, ref_tokens, ref_top) -> str | None:
    """None when the two greedy outputs agree by vLLM's rule, else why not."""
    for i, (a, b) in enumerate(zip(kiln_tokens, ref_tokens, strict=False)):
        if a != b:
            if a in ref_top[i] and b in kiln_top[i]:
                return None  # a near-tie, rounded the other way: the sequences part here
            return f"step {i}: kiln {a} (not in the reference's top {TOP}) vs reference {b}"
    return None if len(kiln_tokens) == len(ref_tokens) else f"{len(kiln_tokens)} tokens vs {len(ref_tokens)}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8", "fp8"])
def test_gpu_engine_greedy_matches_transformers(weights, backend, graphs, toy_model, make_llm):
    if weights == "fp8" and not _fp8_ok():
        pytest.skip("fp8 GEMMs need compute capability >= 8.9")
    model_dir = toy_model("llama-tiny")
    prompts = random_prompts([3, 17, 40, 9], seed=3)
    dtype = "float32" if weights == "float32" else "bfloat16"
    quant = weights if weights in ("int8", "fp8") else None
    llm = make_llm(model_dir, device="cuda", dtype=dtype, quantization=quant, attention_backend=backend,
                   enforce_eager=not graphs, num_kv_blocks=64, max_batch_size=8, cuda_graph_batch_sizes=[1, 2, 4, 8])
    assert (llm.engine.runner.graphs is not None) == graphs
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=TOP))
    ref = reference(model_dir, prompts)
    for o, (ref_tokens, ref_top) in zip(outs, ref, strict=True):
        if weights == "float32":
            assert o.token_ids == ref_tokens
            continue
        why = close(o.token_ids, [set(step) for step in o.logprobs], ref_tokens, ref_top)
        assert why is None, why


def test_the_closeness_rule_accepts_near_ties_only():
    top = [{1, 2, 3}, {4, 5}, {6}]
    assert close([1, 4, 6], top, [1, 4, 6], top) is None
    assert close([1, 5, 9], top, [1, 4, 6], top) is None  # parted at a near-tie: the rest is not compared
    assert close([1, 7, 6], [{1}, {7}, {6}], [1, 4, 6], top) is not None  # 7 is not in the reference's top
