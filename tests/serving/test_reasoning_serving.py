"""`kiln serve --reasoning-parser deepseek_r1` on a random-weight model whose chat template thinks (its
generation prompt opens ``<think>``, as DeepSeek-R1's does): the thinking comes back apart from the answer
in all three APIs, streamed or not, and is exactly the raw output before ``</think>`` (read here from a
plain completion of the same prompt tokens, without the parser). The template reads two variables as Qwen3's
and a house template would: ``enable_thinking`` (off: an empty thinking in the prompt), ``reasoning_effort``
(as gpt-oss's: each API's effort field sets it) and ``house_rules``,
which the server gives every chat request (``--default-chat-template-kwargs``) and a request's own
``chat_template_kwargs`` override."""

from __future__ import annotations

import json
import shutil

import anthropic
import httpx
import openai
import pytest

M = "tiny"
THINKING_TEMPLATE = (
    "{% if house_rules is defined and not house_rules %}{{ raise_exception('house_rules may not be empty') }}"
    "{% endif %}"
    "{% if house_rules is defined %}{{ '<|im_start|>system\n' + house_rules + '<|im_end|>\n' }}{% endif %}"
    "{% if reasoning_effort is defined %}{{ '<|im_start|>system\nReasoning: ' + reasoning_effort + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}"
    "{% else %}{{ '<think>\n' }}{% endif %}{% endif %}"
)
DEFAULTS = {"house_rules": "Answer in one line."}
ASK = [{"role": "user", "content": "Tell me a story about a lighthouse."}]
SPLIT = "[a-z]{3,8}</think>[a-z]{3,8}"  # a regex that makes even a random model close its thinking


@pytest.fixture(scope="module")
def thinking_model(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("thinking-model") / "model"
    shutil.copytree(model_dir, out)
    (out / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return out


@pytest.fixture(scope="module")
def srv(start_server, thinking_model):
    s = start_server("--max-seq-len", "256", "--max-input-len", "128", "--num-kv-blocks", "256",
                     "--reasoning-parser", "deepseek_r1", "--default-chat-template-kwargs", json.dumps(DEFAULTS),
                     source=["--model", str(thinking_model)])
    s.wait_ready()
    return s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def rendered(thinking_model):
    """The prompt's ids as transformers renders the template with these variables (the server's defaults)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(thinking_model)

    def render(messages=ASK, **variables):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **variables)
        return tok.encode(text, add_special_tokens=False)
    return render


@pytest.fixture(scope="module")
def raw(client, rendered):
    """The greedy output of the rendered prompt, as plain text (a completion: no parser applies)."""
    ids = rendered(**DEFAULTS)
    return client.completions.create(model=M, prompt=ids, max_tokens=12, temperature=0).choices[0].text


def _split(text: str) -> tuple[str, str]:
    thought, marker, answer = text.partition("</think>")
    return thought, answer if marker else ""


def test_chat_returns_the_thinking_apart_streamed_or_not(client, raw):
    thought, answer = _split(raw)
    got = client.chat.completions.create(model=M, messages=ASK, max_tokens=12, temperature=0).choices[0].message
    assert got.model_extra["reasoning_content"] == got.model_extra["reasoning"] == thought
    assert got.content == (answer or None)  # all thinking: no content, as vLLM's parsers give it
    stream = client.chat.completions.create(model=M, messages=ASK, max_tokens=12, temperature=0, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    for name in ("reasoning_content", "reasoning"):  # vLLM's older name and its newer
        assert "".join((d.model_extra or {}).get(name) or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == answer


def test_messages_returns_thinking_blocks_streamed_or_not(srv, raw):
    thought, answer = _split(raw)
    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    kw = dict(model=M, messages=ASK, max_tokens=12, extra_body={"temperature": 0},
              thinking={"type": "enabled", "budget_tokens": 1024})
    got = client.messages.create(**kw)
    assert got.content[0].type == "thinking" and got.content[0].thinking == thought
    assert "".join(b.text for b in got.content if b.type == "text") == answer
    with client.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                   and e.delta.type == "thinking_delta") == thought
    assert final.content[0].thinking == thought
    assert [b.type for b in final.content] == [b.type for b in got.content]  # the same blocks, none empty
    assert all(b.text for b in got.content if b.type == "text")


def test_responses_returns_a_reasoning_item_streamed_or_not(client, raw):
    thought, answer = _split(raw)
    got = client.responses.create(model=M, input=ASK[0]["content"], max_output_tokens=12, temperature=0)
    assert got.output[0].type == "reasoning" and got.output[0].content[0].text == thought
    assert got.output_text == answer
    assert got.usage.output_tokens_details.reasoning_tokens > 0
    events = list(client.responses.create(model=M, input=ASK[0]["content"], max_output_tokens=12, temperature=0,
                                          stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert events[-1].response.output[0].content[0].text == thought


def test_thinking_and_answer_split_at_the_marker(client):
    extra = {"structured_outputs": {"regex": SPLIT}}
    got = client.chat.completions.create(model=M, messages=ASK, max_tokens=40, extra_body=extra).choices[0].message
    thought, answer = got.model_extra["reasoning_content"], got.content
    assert 3 <= len(thought) <= 8 and thought.isalpha() and 3 <= len(answer) <= 8 and answer.isalpha()
    stream = client.chat.completions.create(model=M, messages=ASK, max_tokens=40, extra_body=extra, stream=True,
                                            seed=5, temperature=1.0)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    streamed_thought = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    streamed_answer = "".join(d.content or "" for d in deltas)
    assert streamed_thought.isalpha() and streamed_answer.isalpha()  # the marker went to neither


def test_a_json_answer_is_constrained_from_the_first_token(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    got = client.chat.completions.create(model=M, messages=ASK, max_tokens=30, response_format={
        "type": "json_schema", "json_schema": {"name": "r", "schema": schema}}).choices[0].message
    assert got.model_extra.get("reasoning_content") is None and got.content.startswith("{")


def test_chat_template_kwargs_reach_the_template_over_the_servers_defaults(client, rendered):
    def prompt_tokens(**extra):
        return client.chat.completions.create(model=M, messages=ASK, max_tokens=1, extra_body=extra).usage.prompt_tokens

    assert prompt_tokens() == len(rendered(**DEFAULTS))
    off = {"enable_thinking": False}
    assert prompt_tokens(chat_template_kwargs=off) == len(rendered(**DEFAULTS, **off)) > len(rendered(**DEFAULTS))
    rules = {"house_rules": "Answer in one long paragraph, with care and with examples."}
    assert prompt_tokens(chat_template_kwargs=rules) == len(rendered(**rules)) > len(rendered(**DEFAULTS))
    with pytest.raises(openai.BadRequestError) as err:  # the template's own refusal, naming what was given
        prompt_tokens(chat_template_kwargs={"house_rules": ""})
    assert "house_rules may not be empty" in err.value.message and "chat_template_kwargs ['house_rules']" in \
        err.value.message


def test_messages_thinking_disabled_renders_the_template_without_thinking(srv, rendered):
    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    for kind, enabled in (("disabled", False), ("enabled", True)):
        thinking = {"type": kind, "budget_tokens": 1024} if enabled else {"type": kind}
        counted = client.messages.count_tokens(model=M, messages=ASK, thinking=thinking).input_tokens
        assert counted == len(rendered(**DEFAULTS, enable_thinking=enabled))
    assert len(rendered(**DEFAULTS, enable_thinking=False)) > len(rendered(**DEFAULTS, enable_thinking=True))


@pytest.mark.parametrize("kwargs, param", [
    ({"tools": []}, "chat_template_kwargs.tools"),
    ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
    ({"not-a-name": 1}, "chat_template_kwargs"),
])
def test_chat_template_kwargs_kiln_sets_itself_or_that_are_no_variable_are_refused(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=M, messages=ASK, max_tokens=1, extra_body={"chat_template_kwargs": kwargs})
    assert err.value.body["param"].startswith(param), err.value.body


def test_each_apis_reasoning_effort_is_the_templates_reasoning_effort(srv, client, rendered):
    low = len(rendered(**DEFAULTS, reasoning_effort="low"))
    assert low > len(rendered(**DEFAULTS))
    chat = client.chat.completions.create(model=M, messages=ASK, max_tokens=1, reasoning_effort="low")
    assert chat.usage.prompt_tokens == low
    kwargs = {"chat_template_kwargs": {"reasoning_effort": "high"}}  # the template's variables win
    chat = client.chat.completions.create(model=M, messages=ASK, max_tokens=1, reasoning_effort="low",
                                          extra_body=kwargs)
    assert chat.usage.prompt_tokens == len(rendered(**DEFAULTS, reasoning_effort="high"))
    response = client.responses.create(model=M, input=ASK[0]["content"], max_output_tokens=16,
                                       reasoning={"effort": "low"})
    assert response.usage.input_tokens == low and response.reasoning.effort == "low"
    messages = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0).messages
    assert messages.count_tokens(model=M, messages=ASK, output_config={"effort": "low"}).input_tokens == low
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=M, messages=ASK, max_tokens=1, extra_body={"reasoning_effort": "lots"})
    assert err.value.body["param"] == "reasoning_effort"


def test_version_says_the_chat_settings(srv):
    """What a cluster's kubectl cannot show from outside the pod: the parser and template defaults it serves with."""
    body = httpx.get(f"{srv.url}/version", timeout=10).json()
    assert body["reasoning_parser"] == "deepseek_r1" and body["default_chat_template_kwargs"] == DEFAULTS
