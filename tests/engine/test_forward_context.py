"""One ``ForwardContext`` per step (vLLM v1's): the runner sets the step's attention metadata and LoRA work
together, layers read them from it, and nothing of a step is left set between steps."""

from __future__ import annotations

import pytest
import torch
from engine_testlib import random_prompts
from kiln.engine import SamplingParams
from kiln.engine import forward_context as fc
from kiln.engine.layers.attention import AttentionMetadata
from kiln.engine.lora import LoRARequest
from kiln.engine.lora.step import make_lora_step
from lora_testlib import ATTN, make_adapter


def test_a_context_is_set_around_a_step_and_restored():
    md = AttentionMetadata(slot_mapping=torch.zeros(3))
    step = make_lora_step(torch.tensor([-1, 0, 0]), torch.device("cpu"), 2)
    with pytest.raises(RuntimeError, match="outside a step"):
        fc.get_forward_context()
    assert not fc.step_has_lora()
    with fc.set_forward_context(md, step) as ctx:
        assert fc.get_forward_context() is ctx and ctx.attention is md and ctx.lora is step and fc.step_has_lora()
        with fc.set_forward_context(md) as inner:
            assert fc.get_forward_context() is inner and not inner.has_lora
        assert fc.get_forward_context() is ctx
    with pytest.raises(RuntimeError, match="outside a step"):
        fc.get_forward_context()


def test_every_layer_of_a_step_reads_the_one_context(toy_model, make_llm, tmp_path):
    """A base step and an adapter step: every attention layer sees the same context object, which carries
    the step's LoRA work exactly when an adapter row runs."""
    model_dir = toy_model("llama-tiny")
    adapter = make_adapter(model_dir, tmp_path / "a", ATTN, seed=1)
    llm = make_llm(model_dir, device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64,
                   block_size=16, max_num_tokens=128, max_batch_size=4)
    seen: list[list] = []
    layers = [m for m in llm.engine.runner.model.modules() if type(m).__name__ == "Attention"]
    for layer in layers:
        layer.register_forward_pre_hook(lambda m, a: seen[-1].append(fc.get_forward_context()))
    execute = llm.engine.runner.execute

    def step(inputs, intermediate=None):
        seen.append([])
        return execute(inputs, intermediate)

    llm.engine.runner.execute = step
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate(random_prompts([6], seed=1), params)
    llm.generate(random_prompts([6], seed=1), params, lora_request=LoRARequest("a", 1, str(adapter)))
    assert seen and all(len(s) == len(layers) and all(c is s[0] for c in s) for s in seen)
    assert {s[0].has_lora for s in seen} == {False, True}
    with pytest.raises(RuntimeError, match="outside a step"):
        fc.get_forward_context()
