"""kiln's light tokenizer (kiln.engine.light_tokenizer) against transformers' own, loaded from the same files:
encode, decode, the vocabulary, special tokens and chat templates must agree, or it is not used."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
from kiln.engine import light_tokenizer
from kiln.engine.chat_template import render
from kiln.engine.light_tokenizer import LightTokenizer, record_key, save_record, why_not_recordable
from kiln.engine.random_checkpoint import make_tokenizer
from kiln.engine.tokenizer import load_hf_tokenizer, load_tokenizer

# A template with what real ones use: namespace, tojson with options, loop controls, raise_exception, dict(),
# the {% generation %} tag, tools, documents and reasoning, and the special tokens as variables.
RICH_TEMPLATE = """{{ bos_token }}{% set ns = namespace(n=0, sys='') %}
{% if tools %}<tools>{% for t in tools %}{{ t | tojson(indent=2, sort_keys=True) }}{% if not loop.last %},{% endif %}
{% endfor %}</tools>
{% endif %}{% if documents %}{% for d in documents %}[{{ d.title }}] {{ d.text }}
{% endfor %}{% endif %}{% for m in messages %}{% set ns.n = ns.n + 1 %}
{% if m.role not in ['system', 'user', 'assistant', 'tool'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}
{% if m.role == 'stop' %}{% break %}{% endif %}<|im_start|>{{ m.role }}
{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}
{% if m.role == 'assistant' %}{% generation %}{{ m.content | default('', true) }}{% endgeneration %}
{% else %}{{ m.content }}{% endif %}{% if m.tool_calls is defined %}{% for c in m.tool_calls %}
{{ dict(name=c.function.name, arguments=c.function.arguments) | tojson }}{% endfor %}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}{{ ns.n }} {{ eos_token }} {{ extra | default('') }}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there, what is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo  wörld 中文 🙂\n\ttabs"},
     {"role": "assistant", "content": "Hi!", "reasoning_content": "they greet"}, {"role": "user", "content": "x"}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
     {"role": "tool", "content": "sunny"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
TEXTS = ["", "hello", " leading and trailing ", "<|im_start|>user\nhi<|im_end|>", "</s><s><unk>x",
         "héllo wörld 中文 🙂", "a\n\n\tb  c", "1234567890 !?.,;:'\"", "<|im_start|" + "x" * 50]


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("KILN_LIGHT_TOKENIZER", raising=False)
    return tmp_path / "cache"


def _saved(tmp_path, template=None, **config) -> str:
    tok = make_tokenizer(1024)
    if template is not None:
        tok.chat_template = template
    model_dir = tmp_path / "model"
    tok.save_pretrained(model_dir)
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 1024}))
    if config:
        if "chat_template" in config:  # the template goes in tokenizer_config.json, not a file beside it
            (model_dir / "chat_template.jinja").unlink(missing_ok=True)
        path = model_dir / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return str(model_dir)


def _pair(model_dir: str):
    first = load_tokenizer(model_dir)
    second = load_tokenizer(model_dir)
    assert not isinstance(first, LightTokenizer), "the first load on a host goes through transformers"
    assert isinstance(second, LightTokenizer), "the second load of the same files comes from the record"
    return first, second


def _agree_on_text(hf, light) -> None:
    rng = random.Random(3)
    for text in TEXTS:
        for special in (True, False):
            assert light.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)
    for _ in range(200):
        ids = [rng.randrange(len(hf)) for _ in range(rng.randrange(0, 16))]
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        assert light.convert_ids_to_tokens(ids, skip_special_tokens=True) == \
            hf.convert_ids_to_tokens(ids, skip_special_tokens=True)
    assert light.decode(5) == hf.decode(5)
    assert light.get_vocab() == hf.get_vocab()
    assert (len(light), light.vocab_size) == (len(hf), hf.vocab_size)
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id", "unk_token_id",
                 "pad_token_id", "all_special_ids", "all_special_tokens", "special_tokens_map", "chat_template"):
        assert getattr(light, name) == getattr(hf, name), name


def _agree_on_chats(hf, light, **kwargs) -> None:
    for chat in CONVERSATIONS:
        for gen in (True, False):
            for extra in ({}, {"tools": TOOLS}, {"documents": [{"title": "T", "text": "body"}], "extra": "E"}):
                args = {"add_generation_prompt": gen, **extra, **kwargs}
                try:
                    want = hf.apply_chat_template(chat, tokenize=False, **args)
                except Exception as exc:  # the template refuses it: so must ours, the same way
                    with pytest.raises(type(exc)) as ours:
                        light.apply_chat_template(chat, tokenize=False, **args)
                    assert str(ours.value) == str(exc)
                    continue
                assert light.apply_chat_template(chat, tokenize=False, **args) == want
                assert light.apply_chat_template(chat, **args) == hf.encode(want, add_special_tokens=False)


def test_the_record_gives_transformers_tokenizer_back(tmp_path, cache):
    hf, light = _pair(_saved(tmp_path))
    _agree_on_text(hf, light)
    _agree_on_chats(hf, light)
    assert list(cache.glob("kiln/tokenizers/*.json")), "the record is on the host's cache"


def test_a_rich_template_renders_as_transformers_renders_it(tmp_path, cache):
    hf, light = _pair(_saved(tmp_path, RICH_TEMPLATE))
    _agree_on_chats(hf, light)
    bad = [{"role": "robot", "content": "beep"}]
    with pytest.raises(Exception, match="bad role robot") as theirs:
        hf.apply_chat_template(bad, tokenize=False)
    with pytest.raises(type(theirs.value), match="bad role robot"):
        light.apply_chat_template(bad, tokenize=False)
    with pytest.raises(NotImplementedError, match="continue_final_message"):
        light.apply_chat_template(CONVERSATIONS[0], tokenize=False, continue_final_message=True)


def test_named_templates_pick_as_transformers_picks(tmp_path, cache):
    body = "{% for m in messages %}{{ m.content }}{% endfor %}"
    named = [{"name": "default", "template": "D" + body},
             {"name": "tool_use", "template": "T{{ (tools or []) | length }}" + body}]
    hf, light = _pair(_saved(tmp_path, chat_template=named))
    assert isinstance(light.chat_template, dict) and light.chat_template == hf.chat_template
    _agree_on_chats(hf, light)
    assert light.apply_chat_template(CONVERSATIONS[0], tokenize=False, tools=TOOLS).startswith("T1")
    assert light.apply_chat_template(CONVERSATIONS[0], tokenize=False, chat_template="tool_use").startswith("T0")


def test_changed_files_or_the_switch_go_through_transformers(tmp_path, cache, monkeypatch):
    model_dir = _saved(tmp_path)
    _pair(model_dir)
    key = record_key(model_dir)
    path = tmp_path / "model" / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token": "<|im_end|>"}))
    assert record_key(model_dir) != key
    hf = load_tokenizer(model_dir)
    assert not isinstance(hf, LightTokenizer) and hf.eos_token == "<|im_end|>"
    assert load_tokenizer(model_dir).eos_token == "<|im_end|>"  # its own record now
    (tmp_path / "model" / "model.safetensors").write_bytes(b"weights are not keyed")
    assert isinstance(load_tokenizer(model_dir), LightTokenizer)
    monkeypatch.setenv("KILN_LIGHT_TOKENIZER", "0")
    assert not isinstance(load_tokenizer(model_dir), LightTokenizer)


def test_an_artifacts_own_record_serves_its_first_load_while_its_files_and_versions_hold(tmp_path, cache,
                                                                                         monkeypatch):
    """The builder writes the record into the artifact (light_tokenizer.save_artifact_record): a fresh host loads
    without transformers, unless a file it names changed or this host's libraries are not the builder's."""
    model_dir = _saved(tmp_path)
    hf, key = load_hf_tokenizer(model_dir), record_key(model_dir)
    names = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json", "missing.json"]
    assert light_tokenizer.save_artifact_record(model_dir, hf, names) is not None
    assert record_key(model_dir) == key  # the record file is not part of the host's key
    light = light_tokenizer.load_light(model_dir, record_key(model_dir))
    assert isinstance(light, LightTokenizer) and light.get_vocab() == hf.get_vocab()
    _agree_on_chats(hf, light)
    assert not list(cache.glob("kiln/tokenizers/*.json")), "nothing needed writing on the host"
    real = light_tokenizer._versions()
    monkeypatch.setattr(light_tokenizer, "_versions", lambda: {**real, "tokenizers": "0.0.1"})
    assert light_tokenizer.load_light(model_dir, "0" * 64) is None
    monkeypatch.setattr(light_tokenizer, "_versions", lambda: real)
    path = tmp_path / "model" / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token": "<|im_end|>"}))
    assert light_tokenizer.load_light(model_dir, "0" * 64) is None


def test_a_broken_record_is_not_used(tmp_path, cache):
    model_dir = _saved(tmp_path)
    _pair(model_dir)
    for path in cache.glob("kiln/tokenizers/*.json"):
        path.write_text("{not json")
    assert not isinstance(load_tokenizer(model_dir), LightTokenizer)
    assert isinstance(load_tokenizer(model_dir), LightTokenizer)  # rewritten by that load


def test_tokenizers_that_do_more_than_their_backend_get_no_record(tmp_path, cache):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    hf = load_hf_tokenizer(_saved(tmp_path))

    class Shouting(type(hf)):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    shouting = Shouting(tokenizer_object=hf.backend_tokenizer, eos_token=hf.eos_token)
    assert "overrides _decode" in why_not_recordable(shouting)
    assert save_record("k" * 64, shouting) is None
    piece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, ".": 2}, unk_token="[UNK]"))
    cleaning = PreTrainedTokenizerFast(tokenizer_object=piece, clean_up_tokenization_spaces=True)
    assert "clean" in why_not_recordable(cleaning)
    assert why_not_recordable(hf) is None


def test_structured_outputs_see_the_same_vocabulary(tmp_path, cache):
    import llguidance.hf
    from kiln.engine.structured.compiler import ll_tokenizer

    hf, light = _pair(_saved(tmp_path))
    ours, theirs = ll_tokenizer(light, 1024, [2]), llguidance.hf.from_tokenizer(hf, n_vocab=1024, eos_token=[2])
    for text in TEXTS:
        assert ours.tokenize_str(text) == theirs.tokenize_str(text)
    assert (ours.vocab_size, ours.eos_token) == (theirs.vocab_size, theirs.eos_token)


def test_a_load_from_the_record_imports_no_transformers(tmp_path, cache):
    """What the record is for: a fresh process loads the tokenizer, renders a chat and decodes without it."""
    model_dir = _saved(tmp_path)
    _pair(model_dir)
    probe = ("import sys\nfrom kiln.engine.tokenizer import load_tokenizer\nfrom kiln.engine.detokenizer import "
             "raw_decoder\nt = load_tokenizer(sys.argv[1])\nids = t.apply_chat_template([{'role': 'user', "
             "'content': 'hi'}], add_generation_prompt=True)\nraw_decoder(t)(ids)\n"
             "print(type(t).__name__, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-P", "-c", probe, model_dir], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "XDG_CACHE_HOME": str(cache)})
    assert out.stdout.strip() == "LightTokenizer False", out.stdout + out.stderr[-2000:]


def test_render_takes_plain_data_only():
    class Thing:
        pass

    out = render("{{ messages[0].content }}|{{ x }}", [{"role": "user", "content": "hi"}], {}, x=Thing())
    assert out == "hi|<Thing>"
