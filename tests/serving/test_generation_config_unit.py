"""A request that does not set temperature, top_p, top_k, min_p, repetition_penalty (or a chat's max_tokens) takes
the model's generation_config.json values, as vLLM's --generation-config auto; `vllm` takes OpenAI's neutral ones."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
from kiln.engine.generation_config import eos_token_ids, sampling_defaults
from kiln.serving.inputs import completion_inputs
from kiln.serving.protocol import CompletionRequest

QWEN3 = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": [151645, 151643]}


def engine(folder, source="auto"):
    config = SimpleNamespace(model=str(folder), generation_config=source, max_input_len=64, max_seq_len=128,
                             hf_config={"vocab_size": 1024, "eos_token_id": 2})
    return SimpleNamespace(engine_config=config, tokenizer=None)


def params(eng, **fields):
    req = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2, 3], **fields})
    return completion_inputs(req, eng)[0].params


def test_unset_fields_take_the_model_s_defaults_and_set_ones_win(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({**QWEN3, "repetition_penalty": 1.05}))
    got = params(engine(tmp_path))
    assert (got.temperature, got.top_p, got.top_k, got.min_p, got.repetition_penalty) == (0.6, 0.95, 20, 0.0, 1.05)
    assert got.max_tokens == 16  # a completion's default stays OpenAI's
    own = params(engine(tmp_path), temperature=0, top_k=-1, top_p=1.0, repetition_penalty=1.0)
    assert (own.temperature, own.top_k, own.top_p, own.repetition_penalty) == (0, 0, 1.0, 1.0)  # -1: off
    neutral = params(engine(tmp_path, "vllm"))
    assert (neutral.temperature, neutral.top_p, neutral.top_k, neutral.repetition_penalty) == (1.0, 1.0, 0, 1.0)
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.2, "max_new_tokens": 7}))
    assert sampling_defaults(engine(tmp_path, str(other)).engine_config) == {"temperature": 0.2, "max_tokens": 7}
    assert eos_token_ids(engine(tmp_path).engine_config) == [2, 151645, 151643]


def test_a_value_kiln_cannot_sample_with_is_left_out_naming_it(tmp_path, caplog):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 5.0, "top_k": None}))
    with caplog.at_level(logging.WARNING, logger="kiln.engine"):
        assert sampling_defaults(engine(tmp_path).engine_config) == {"temperature": 0.7}
    assert "top_p 5.0 is not a value kiln samples with" in caplog.text
    assert sampling_defaults(engine(tmp_path / "none").engine_config) == {}  # no file: no defaults


@pytest.mark.parametrize("bad", ["{not json", "[1, 2]"])
def test_an_unreadable_file_gives_no_defaults(tmp_path, bad):
    (tmp_path / "generation_config.json").write_text(bad)
    assert sampling_defaults(engine(tmp_path).engine_config) == {}


def test_a_chat_s_default_max_tokens_is_the_model_s_max_new_tokens(tmp_path):
    from kiln.serving.inputs import chat_inputs
    from kiln.serving.protocol import ChatCompletionRequest
    from test_tool_calls_unit import Tokenizer

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "max_new_tokens": 40}))
    eng = engine(tmp_path)
    eng.tokenizer = Tokenizer("{{ messages }}")
    ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    got = chat_inputs(ChatCompletionRequest.model_validate(ask), eng)[0].params
    assert (got.temperature, got.max_tokens) == (0.6, 40)
    own = chat_inputs(ChatCompletionRequest.model_validate({**ask, "max_tokens": 5}), eng)[0].params
    assert own.max_tokens == 5
