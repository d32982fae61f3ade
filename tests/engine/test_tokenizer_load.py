"""The engine's tokenizer load through transformers: the same tokenizer AutoTokenizer gives, without importing the
modeling stack (the load from a record, without transformers at all: test_light_tokenizer.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kiln.engine.tokenizer import load_hf_tokenizer, tokenizer_config_hint

TEXTS = ["Hello world, this is kiln.", "  leading spaces\tand\ttabs\n", "ünïcödé — 東京 🙂", "</s><s> specials"]


def _copy_with(src: Path, dest: Path, model_type: str | None = None, tokenizer_class: str | None = None,
               drop_class: bool = False, auto_map: bool = False) -> Path:
    shutil.copytree(src, dest)
    cfg = json.loads((dest / "config.json").read_text())
    if model_type:
        cfg["model_type"] = model_type
    (dest / "config.json").write_text(json.dumps(cfg))
    tok = json.loads((dest / "tokenizer_config.json").read_text())
    if tokenizer_class:
        tok["tokenizer_class"] = tokenizer_class
    if drop_class:
        tok.pop("tokenizer_class", None)
    if auto_map:
        tok["auto_map"] = {"AutoTokenizer": [None, "tokenization_x.XTokenizerFast"]}
    (dest / "tokenizer_config.json").write_text(json.dumps(tok))
    return dest


def _same(a, b) -> None:
    assert type(a) is type(b)
    for text in TEXTS:
        assert a.encode(text) == b.encode(text)
        assert a.decode(a.encode(text)) == b.decode(b.encode(text))
    assert (a.bos_token_id, a.eos_token_id, a.pad_token_id, a.unk_token_id) == \
           (b.bos_token_id, b.eos_token_id, b.pad_token_id, b.unk_token_id)
    assert a.all_special_ids == b.all_special_ids
    if a.chat_template:
        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        assert a.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
               b.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


# (model_type, tokenizer_class): the class the toy tokenizer saves, a Llama class over a ByteLevel tokenizer
# (AutoTokenizer's own override), a class another model type registers, and a Qwen2 model type.
CASES = [(None, None), ("llama", "LlamaTokenizerFast"), ("llama", "GPT2TokenizerFast"), ("qwen2", "Qwen2TokenizerFast")]


@pytest.mark.parametrize(("model_type", "tokenizer_class"), CASES)
def test_same_tokenizer_as_autotokenizer(toy_model, tmp_path, model_type, tokenizer_class):
    from transformers import AutoTokenizer

    src = toy_model("llama-tiny") if model_type != "qwen2" else toy_model("qwen2-tiny")
    model = _copy_with(src, tmp_path / "m", model_type, tokenizer_class)
    assert tokenizer_config_hint(str(model)) is not None
    _same(load_hf_tokenizer(str(model)), AutoTokenizer.from_pretrained(str(model), trust_remote_code=False))


def test_falls_back_to_autotokenizer_when_the_class_is_not_named(toy_model, tmp_path):
    from transformers import AutoTokenizer

    no_class = _copy_with(toy_model("llama-tiny"), tmp_path / "a", drop_class=True)
    assert tokenizer_config_hint(str(no_class)) is None
    _same(load_hf_tokenizer(str(no_class)), AutoTokenizer.from_pretrained(str(no_class)))
    assert tokenizer_config_hint(str(_copy_with(toy_model("llama-tiny"), tmp_path / "b", auto_map=True))) is None
    broken = _copy_with(toy_model("llama-tiny"), tmp_path / "c")
    (broken / "config.json").write_text("{not json")
    assert tokenizer_config_hint(str(broken)) is None
    assert tokenizer_config_hint(str(tmp_path / "missing")) is None
    assert tokenizer_config_hint("org/some-hub-id") is None


def test_load_does_not_import_the_modeling_stack(toy_model):
    """The reason for the hint: the modeling imports are ~170 MiB of a serving process's memory."""
    probe = ("import sys; from kiln.engine.tokenizer import load_hf_tokenizer; load_hf_tokenizer(sys.argv[1]); "
             "print(sorted(m for m in ('transformers.core_model_loading', 'transformers.models.llama.configuration_llama',"
             " 'sympy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-P", "-c", probe, str(toy_model("llama-tiny"))], capture_output=True,
                         text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_concurrent_first_loads_in_a_fresh_process_all_succeed(toy_model):
    """A pool loads two engines at once: their tokenizers' first import of transformers raced (the second failed with
    "cannot import name 'AutoTokenizer' from 'transformers'", seen by kiln bench --pool). Four threads, fresh process."""
    probe = ("import sys, threading\nfrom kiln.engine.tokenizer import load_hf_tokenizer as load_tokenizer\n"
             "barrier, errors = threading.Barrier(4), []\n"
             "def load():\n    barrier.wait()\n    try:\n        load_tokenizer(sys.argv[1])\n"
             "    except Exception as exc:\n        errors.append(repr(exc))\n"
             "threads = [threading.Thread(target=load) for _ in range(4)]\n"
             "[t.start() for t in threads]; [t.join() for t in threads]\nprint(errors)\n")
    for _ in range(2):
        out = subprocess.run([sys.executable, "-P", "-c", probe, str(toy_model("llama-tiny"))], capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]


def test_a_shelved_tokenizer_goes_to_the_next_engine_of_its_model_one_engine_at_a_time(toy_model, tmp_path,
                                                                                          monkeypatch):
    """A pool's reload takes the tokenizer its engine had (parsing tokenizer.json again held the GIL for 0.35 s
    of SmolLM2's reload), never one another engine holds, and never one of files changed since."""
    from kiln.engine import tokenizer as tk

    monkeypatch.setenv("KILN_LIGHT_TOKENIZER", "0")  # transformers' tokenizer, whose model_max_length is read below
    model = _copy_with(toy_model("llama-tiny"), tmp_path / "m")
    first = tk.load_tokenizer_beside(str(model)).result()
    tk.shelve(str(model), first)
    assert tk.load_tokenizer_beside(str(model)).result() is first
    second = tk.load_tokenizer_beside(str(model)).result()  # the shelf is empty again: a load of its own
    assert second is not first
    _same(first, second)
    tk.shelve(str(model), first)
    tok_cfg = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "model_max_length": 77}))
    third = tk.load_tokenizer_beside(str(model)).result()
    assert third is not first and third.model_max_length == 77
    others = [_copy_with(toy_model("llama-tiny"), tmp_path / f"o{i}") for i in range(tk.SHELF_SIZE)]
    tk.shelve(str(model), third)
    for other in others:  # SHELF_SIZE more: the oldest (model's) is dropped
        tk.shelve(str(other), first)
    assert tk.load_tokenizer_beside(str(model)).result() is not third
    assert tk.load_tokenizer_beside(str(others[-1])).result() is first


def test_an_engine_shut_down_hands_its_tokenizer_to_the_next_engine_of_its_model(toy_model):
    from kiln.engine.llm import LLM
    from kiln.engine.sampling_params import SamplingParams

    model = toy_model("llama-tiny")
    params = SamplingParams(max_tokens=6, temperature=0.0)
    with LLM(str(model), num_kv_blocks=32, block_size=4) as llm:
        tokenizer, before = llm.engine.tokenizer, llm.generate(["Hello world"], params)[0].text
    with LLM(str(model), num_kv_blocks=32, block_size=4) as again:
        assert again.engine.tokenizer is tokenizer
        assert again.generate(["Hello world"], params)[0].text == before
