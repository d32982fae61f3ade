"""Request -> engine inputs, without a server: chat templates and limits."""

from __future__ import annotations

import pytest
from kiln.serving.errors import APIError
from kiln.serving.inputs import render_chat
from kiln.serving.protocol import ChatCompletionRequest
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(str(model_dir))


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **kw}
    )


def test_chat_renders_through_the_template_without_a_second_bos(tokenizer):
    ids = render_chat(chat(), tokenizer)
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user\nhi<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    parts = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert render_chat(parts, tokenizer) == ids


def test_model_without_chat_template_is_a_clear_400(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", None)
    with pytest.raises(APIError) as err:
        render_chat(chat(), tokenizer)
    assert err.value.status == 400 and err.value.param == "messages"
    assert "no chat template" in err.value.message and "/v1/completions" in err.value.message


def test_server_and_engine_apply_one_prompt_rule(offline):
    """The server's 400 and the offline engine's RequestError come from kiln.engine.limits: same words."""
    from kiln.engine import RequestError, SamplingParams
    from kiln.serving.inputs import completion_inputs
    from kiln.serving.protocol import CompletionRequest

    cfg = offline.engine_config
    for prompt, max_tokens, param in (([5] * (cfg.max_input_len + 1), 1, "prompt"),
                                      ([5] * 10, cfg.max_seq_len, "max_tokens"),
                                      ([5, 10**6], 1, "prompt")):
        with pytest.raises(APIError) as served:
            completion_inputs(CompletionRequest.model_validate(
                {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens}), offline)
        with pytest.raises(RequestError) as engine:
            offline.generate([prompt], SamplingParams(max_tokens=max_tokens))
        assert served.value.param == engine.value.param == param
        assert served.value.message == str(engine.value)
        assert served.value.code == engine.value.code
