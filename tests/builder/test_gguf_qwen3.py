"""Qwen3 from a GGUF file: the qwen3-tiny toy (per-head q/k RMSNorms, head_dim 32 wider than hidden / heads, tied
embeddings) written as llama.cpp's convert_hf_to_gguf.py would (its tensor names, no q/k row permutation for
qwen3, its metadata and byte-level BPE tokenizer), fetched by kiln, compared weight for weight with the toy, and
served greedy-equal to transformers on the toy."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from kiln.builder.checkpoint import fetch_checkpoint
from kiln.engine.random_checkpoint import CHAT_TEMPLATE
from safetensors.torch import load_file

gguf = pytest.importorskip("gguf")
LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = hf.split(".", 3)  # model.layers.N.<module>.weight
    return f"blk.{layer}.{LAYER[rest.removesuffix('.weight')]}.weight"


def write_qwen3_gguf(toy: Path, path: Path, linear_type: str = "F32") -> dict[str, torch.Tensor]:
    """The toy as a qwen3 GGUF; returns the weights the file holds (dequantized), under the toy's names."""
    cfg = json.loads((toy / "config.json").read_text())
    tok = json.loads((toy / "tokenizer.json").read_text())
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_name("qwen3-tiny")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(cfg["vocab_size"]))
    special = {t["id"] for t in tok["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])  # 3 CONTROL, 1 NORMAL
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    held = {}
    for name, t in load_file(str(toy / "model.safetensors")).items():  # tied: no lm_head, no output.weight
        gname, arr = gguf_name(name), t.float().numpy()
        if linear_type != "F32" and gname.split(".")[-2] in LINEARS:
            qtype = gguf.GGMLQuantizationType[linear_type]
            data = gguf.quants.quantize(arr, qtype)
            w.add_tensor(gname, data, raw_dtype=qtype)
            held[name] = torch.from_numpy(gguf.quants.dequantize(data, qtype).reshape(arr.shape))
        else:  # q/k rows as they are: llama.cpp permutes them for llama only, not qwen2/qwen3
            w.add_tensor(gname, np.ascontiguousarray(arr))
            held[name] = t.float()
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def hf_greedy(model_dir: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]


@pytest.mark.parametrize("linear_type", ["F32", "Q8_0"])
def test_qwen3_gguf_fetches_to_the_toy_and_serves_like_transformers(toy_model, tmp_path, linear_type):
    from kiln.engine import LLM, SamplingParams

    toy = toy_model("qwen3-tiny")
    path = tmp_path / f"qwen3-tiny-{linear_type}.gguf"
    held = write_qwen3_gguf(toy, path, linear_type)
    ckpt = fetch_checkpoint(f"file://{path}", None, tmp_path / "work")
    assert ckpt.gguf["architecture"] == "qwen3" and ckpt.gguf["tensor_types"].get(linear_type, 0) > 0

    cfg = json.loads((ckpt.path / "config.json").read_text())
    toy_cfg = json.loads((toy / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    for key in ("head_dim", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "tie_word_embeddings", "max_position_embeddings"):
        assert cfg[key] == toy_cfg[key], key
    assert cfg["rms_norm_eps"] == pytest.approx(toy_cfg["rms_norm_eps"])  # a float32 in the file
    assert cfg["rope_parameters"]["rope_theta"] == toy_cfg["rope_parameters"]["rope_theta"]
    assert cfg["head_dim"] == 32 and "quantization_config" not in cfg

    got = load_file(str(ckpt.path / "model.safetensors"))
    assert set(got) == set(held)  # tied: no lm_head either side
    toy_state = load_file(str(toy / "model.safetensors"))
    for name, t in held.items():
        assert torch.equal(got[name], t), name
        if "_norm." in name or linear_type == "F32":  # plain tensors: the toy's exactly
            assert torch.equal(got[name], toy_state[name]), name
    assert not torch.equal(got["model.layers.0.self_attn.q_norm.weight"], torch.ones(32))

    from transformers import AutoTokenizer

    text = "the kiln fires qwen3 at 1200 degrees <|im_start|>"
    tokenizer = AutoTokenizer.from_pretrained(ckpt.path)
    assert tokenizer.encode(text) == AutoTokenizer.from_pretrained(toy).encode(text)
    assert tokenizer.chat_template == CHAT_TEMPLATE

    g = torch.Generator().manual_seed(1)
    prompts = [[1, *torch.randint(5, 1024, (n - 1,), generator=g).tolist()] for n in (3, 17, 40)]
    reference = toy if linear_type == "F32" else ckpt.path  # Q8_0: transformers on the dequantized weights
    llm = LLM(str(ckpt.path), dtype="float32", max_num_tokens=64, max_batch_size=4, max_seq_len=128)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    finally:
        llm.shutdown()
    assert [o.token_ids for o in outs] == hf_greedy(reference, prompts, 8)
