"""Small Llama-family checkpoints with seeded random weights, made locally.

Tests, `make demo` and `kiln bench` need real Hugging Face checkpoint
directories (config.json + safetensors + tokenizer) but no model hub is
reachable. This module writes one from a transformers config: the model with
seeded random weights and a byte-level BPE tokenizer trained on a generated
corpus, so the tokenizer's vocabulary matches the model's. Loading from the
hub stays real code elsewhere; nothing here downloads anything.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import click

# Chat template in the style of ChatML; enough for `/v1/chat/completions`.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]

_COMMON = dict(max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.05, bos_token_id=1, eos_token_id=2)

PRESETS: dict[str, dict[str, Any]] = {
    # Llama with grouped-query attention and untied embeddings.
    "llama-tiny": dict(
        model_type="llama", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=False, **_COMMON,
    ),
    # Llama-3 style rope scaling.
    "llama3-tiny": dict(
        model_type="llama", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=256),
        **_COMMON,
    ),
    # Qwen2: qkv bias, tied embeddings.
    "qwen2-tiny": dict(
        model_type="qwen2", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True,
        use_sliding_window=False, **_COMMON,
    ),
    # Qwen3: per-head q/k RMSNorms, no qkv bias, tied embeddings, and a head_dim wider than hidden / heads
    # (as Qwen3-0.6B's 128 against 1024 / 16).
    "qwen3-tiny": dict(
        model_type="qwen3", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1024, tie_word_embeddings=True,
        use_sliding_window=False, **_COMMON,
    ),
    # SmolLM3: Llama with layers that skip the rotary (NoPE; here the second of two), tied embeddings.
    "smollm3-tiny": dict(
        model_type="smollm3", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True,
        no_rope_layers=[1, 0], use_sliding_window=False, pad_token_id=None, **_COMMON,
    ),
    # Mistral: multi-head attention here (kv heads == heads).
    "mistral-tiny": dict(
        model_type="mistral", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=1024, tie_word_embeddings=False,
        sliding_window=None, **_COMMON,
    ),
    # The demo model: small enough to build and serve on a laptop CPU in seconds.
    "llama-demo": dict(
        model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, vocab_size=4096, tie_word_embeddings=False,
        **{**_COMMON, "max_position_embeddings": 2048},
    ),
    # The default `kiln bench` model: ~100M parameters, Llama architecture (issue 7).
    "llama-bench": dict(
        model_type="llama", hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False,
        **{**_COMMON, "max_position_embeddings": 2048, "initializer_range": 0.02},
    ),
    # The default `kiln bench --device cuda` model: ~1.2B parameters in Llama-3.2-1B's shape (GQA 32/8,
    # head_dim 64), a size whose decode is bound by HBM bandwidth as real serving is.
    "llama-1b": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False,
        **{**_COMMON, "max_position_embeddings": 4096, "initializer_range": 0.02},
    ),
}

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "smollm3": "SmolLM3ForCausalLM", "mistral": "MistralForCausalLM"}


def _corpus(seed: int, num_words: int) -> list[str]:
    """A deterministic corpus of English-ish words plus random strings, so BPE can
    learn as many merges as a realistic vocabulary needs."""
    rng = random.Random(seed)
    base = (
        "the of and to in is that for it as was with be by on not he this are or his from at which but have "
        "an had they you were their one all we can her has there been if more when will would who so no "
        "kiln engine model token batch cache block kernel serve build artifact version request stream "
        "paged attention decode prefill schedule sample greedy tensor parallel rank shard quantize weight"
    ).split()
    letters = "abcdefghijklmnopqrstuvwxyz"
    lines, line = [], []
    for _ in range(num_words):
        if rng.random() < 0.5:
            word = rng.choice(base)
        else:
            word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
        if rng.random() < 0.1:
            word = word.capitalize()
        if rng.random() < 0.05:
            word += rng.choice(".,!?") + " é漢😀"[rng.randint(0, 3)] if rng.random() < 0.2 else "."
        line.append(word)
        if len(line) >= 16:
            lines.append(" ".join(line))
            line = []
    lines.append(" ".join(line))
    return lines


def make_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE tokenizer with exactly ``vocab_size`` entries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    num_words = max(20_000, vocab_size * 12)
    tok.train_from_iterator(_corpus(seed, num_words), trainer=trainer)
    if tok.get_vocab_size() < vocab_size:
        # Pad with plain added tokens so every id the model can emit decodes.
        missing = vocab_size - tok.get_vocab_size()
        tok.add_tokens([f"<extra_{i}>" for i in range(missing)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_random_model(
    out_dir: str | Path, preset: str = "llama-tiny", *, seed: int = 0, dtype: str = "float32",
    **overrides: Any,
) -> Path:
    """Write a checkpoint directory (config.json, model.safetensors, tokenizer) and return its path.

    ``overrides`` replace config fields of the preset, e.g. ``num_attention_heads=3``.
    The same preset, seed and overrides always give the same weights.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(sorted(PRESETS))}")
    fields = {**PRESETS[preset], **overrides}
    model_type = fields.pop("model_type")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.for_model(model_type, architectures=[_ARCHITECTURES[model_type]], **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # Qwen3's per-head norms start at ones: away from them, a weight left unread shows
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer = make_tokenizer(config.vocab_size, seed=seed)
    tokenizer.save_pretrained(out)
    gen_cfg = out / "generation_config.json"
    if gen_cfg.exists():
        gen_cfg.unlink()  # random models have no sampling defaults worth shipping
    (out / "kiln-toy.json").write_text(json.dumps({"preset": preset, "seed": seed, "overrides": overrides}))
    return out


@click.command("make-model")
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="llama-demo", show_default=True)
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True, help="Directory to write.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
def make_model_command(preset: str, out_dir: str, seed: int, dtype: str) -> None:
    """Write a small random-weight Llama-family checkpoint (no hub access)."""
    path = make_random_model(out_dir, preset, seed=seed, dtype=dtype)
    click.echo(f"wrote {preset} (seed {seed}, {dtype}) to {path}")


def make_truncated_draft(model_dir: str | Path, out_dir: str | Path, num_layers: int) -> Path:
    """A draft model for ``model_dir``: its first ``num_layers`` decoder layers under its own embeddings,
    final norm and head (LayerSkip's early exit, untrained), with its tokenizer; a same-family pair
    for speculative decoding where no smaller model of the family is at hand (tests, the bench)."""
    import shutil

    from safetensors.torch import load_file, save_file

    src, out = Path(model_dir), Path(out_dir)
    config = json.loads((src / "config.json").read_text())
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in [1, {config['num_hidden_layers']}], got {num_layers}")
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for path in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(str(path)).items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= num_layers:
                continue
            state[name] = tensor
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers}, indent=2))
    for path in src.iterdir():
        if path.is_file() and (path.name.startswith(("tokenizer", "special_tokens", "generation_config"))
                               or path.name in ("vocab.json", "merges.txt")):
            shutil.copy(path, out / path.name)
    return out


def make_damped_target(model_dir: str | Path, out_dir: str | Path, from_layer: int, scale: float) -> Path:
    """A copy of ``model_dir`` whose decoder layers from ``from_layer`` on write ``scale`` times their output
    into the residual stream (attention ``o_proj`` and MLP ``down_proj`` scaled): with random weights, a
    target that its first ``from_layer`` layers (:func:`make_truncated_draft`) predict most of the time, a
    stand-in for a trained same-family pair whose agreement ``scale`` sets."""
    import shutil

    from safetensors.torch import load_file, save_file

    src, out = Path(model_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if not path.is_file():
            continue
        if path.suffix != ".safetensors":
            shutil.copy(path, out / path.name)
            continue
        state = load_file(str(path))
        for name, tensor in state.items():
            parts = name.split(".")
            if ("layers" in parts and int(parts[parts.index("layers") + 1]) >= from_layer
                    and parts[-2] in ("o_proj", "down_proj")):
                state[name] = tensor * scale
        save_file(state, str(out / path.name), metadata={"format": "pt"})
    return out
