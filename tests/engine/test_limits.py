"""Requests and settings that cannot work fail at once, naming what to change."""

from __future__ import annotations

import json
import shutil

import pytest
from kiln.engine import LLM, ConfigError, RequestError, SamplingParams


@pytest.fixture
def llm(toy_model, make_llm):
    return make_llm(toy_model("llama-tiny"), num_kv_blocks=16, block_size=4, max_seq_len=128, max_input_len=40)


@pytest.mark.parametrize(
    ("prompt", "params", "param", "words"),
    [
        ([], SamplingParams(), "prompt", "empty"),
        ("", SamplingParams(), "prompt", "empty"),
        ([1] * 41, SamplingParams(max_tokens=1), "prompt", "max_input_len (40)"),
        ([1] * 30, SamplingParams(max_tokens=99), "max_tokens", "max_seq_len (128)"),
        ([1] * 30, SamplingParams(max_tokens=40), "max_tokens", "16 blocks"),
        ([1] * 30, SamplingParams(max_tokens=None), "max_tokens", "KV pool"),
        ([1, 5000], SamplingParams(), "prompt", "[0, 1024)"),
        ("hello", "not params", "sampling_params", "SamplingParams"),
    ],
)
def test_bad_requests_are_refused_before_queueing(llm, prompt, params, param, words):
    with pytest.raises(RequestError) as e:
        llm.generate([[1, 2, 3], prompt], [SamplingParams(max_tokens=2), params])
    assert e.value.param == param
    assert words in str(e.value)
    assert llm.stats().num_waiting == 0  # the good prompt in the same call was not queued either


def test_engine_keeps_serving_after_refusals(llm):
    with pytest.raises(RequestError):
        llm.generate([[1] * 41])
    out = llm.generate([1, 9, 8], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3 and out[0].finish_reason == "length"


def test_sampling_params_validation_names_the_field():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(dtype="float64"), "dtype"),
        (dict(max_seq_len=4096), "max_seq_len"),
        (dict(max_input_len=2000, max_seq_len=512), "max_input_len"),
        (dict(block_size=12), "block_size"),
        (dict(max_num_tokens=4, max_batch_size=8), "max_num_tokens"),
        (dict(tensor_parallel_size=3), "tensor_parallel_size"),
        (dict(tensor_parallel_size=4), "tensor_parallel_size"),  # 2 KV heads
        (dict(quantization="int4"), "quantization"),
    ],
)
def test_bad_settings_name_the_kwarg(toy_model, kwargs, name):
    with pytest.raises(ConfigError, match=name):
        LLM(toy_model("llama-tiny"), **kwargs)


def test_unsupported_architecture_lists_supported(toy_model, tmp_path):
    src = toy_model("llama-tiny")
    dst = tmp_path / "gpt"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="GPT2LMHeadModel.*LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        LLM(dst)


def test_string_prompts_and_input_order(llm):
    prompts = ["the kiln engine", [1, 40, 41, 42, 43, 44, 45, 46, 47, 48], "serve"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [o.prompt for o in outs] == ["the kiln engine", None, "serve"]
    assert outs[0].prompt_token_ids == llm.tokenizer.encode("the kiln engine")
    alone = llm.generate(prompts[1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert alone[0].token_ids == outs[1].token_ids
    assert all(o.text == llm.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outs)


def test_sliding_window_models_are_limited_to_the_window(toy_model):
    model_dir = toy_model("mistral-tiny", sliding_window=64)
    with pytest.raises(ConfigError, match="sliding_window"):
        LLM(model_dir)
    assert LLM(model_dir, max_seq_len=64).engine_config.max_seq_len == 64
