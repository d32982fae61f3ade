"""GGUF sources without the real model: header checks (architecture, tensor types, sha256) on tiny files
written with the ``gguf`` package, and the local-source safety rules (symlinks, '..' escapes)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
from kiln.builder.checkpoint import fetch_checkpoint
from kiln.builder.errors import FetchError
from kiln.builder.gguf import inspect_gguf, supported_architectures, supported_tensor_types


def write_gguf(path: Path, arch: str = "llama", raw_type: str | None = None) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.ones((4, 8), dtype=np.float32))
    if raw_type is not None:
        qtype = gguf.GGMLQuantizationType[raw_type]
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        w.add_tensor("blk.0.ffn_up.weight", np.zeros((1, type_size), dtype=np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_supported_sets_are_what_the_runtime_and_dequantizer_have():
    assert supported_architectures() == {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                         "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    assert {"F32", "F16", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"} <= set(supported_tensor_types())


def test_header_facts_and_sha256(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", raw_type="Q8_0")
    info = inspect_gguf(path, "file:///x/tiny.gguf")
    assert info.architecture == "llama" and info.tensor_types == {"F32": 1, "Q8_0": 1}
    assert info.sha256 == hashlib.sha256(path.read_bytes()).hexdigest() and info.num_bytes == path.stat().st_size


def test_unsupported_architecture_fails_with_one_line_naming_it(tmp_path):
    path = write_gguf(tmp_path / "g.gguf", arch="gpt2")
    with pytest.raises(FetchError) as info:
        fetch_checkpoint(f"file://{path}", None, tmp_path / "work")
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("spec.model.source: ") and "'gpt2'" in msg and "llama" in msg


def test_unsupported_tensor_type_fails_with_one_line_naming_it(tmp_path):
    unsupported = "Q8_K"  # llama.cpp's internal K-quant activation type: no dequantizer
    assert unsupported not in supported_tensor_types()
    path = write_gguf(tmp_path / "q.gguf", raw_type=unsupported)
    with pytest.raises(FetchError) as info:
        fetch_checkpoint(f"file://{path}", None, tmp_path / "work")
    msg = str(info.value)
    assert "\n" not in msg and "Q8_K" in msg and "cannot dequantize" in msg and "Q4_K" in msg


def test_a_sha256_revision_is_checked_against_the_file(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf")
    wrong = "0" * 64
    with pytest.raises(FetchError, match=r"^spec\.model\.revision: .* has sha256 [0-9a-f]{64}, not 0{64}"):
        fetch_checkpoint(f"file://{path}", wrong, tmp_path / "work")


def test_not_a_gguf_file_is_one_line(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(FetchError) as info:
        fetch_checkpoint(f"file://{path}", None, tmp_path / "work")
    assert "\n" not in str(info.value) and "not a readable GGUF file" in str(info.value)


def test_file_only_goes_with_hf(tmp_path):
    with pytest.raises(FetchError, match=r"^spec\.model\.file: only used with hf://"):
        fetch_checkpoint("s3://bucket/models", None, tmp_path, file="m.gguf")


# --- local sources read in place must be what they say (issue 10) ---

def test_symlinked_checkpoint_directory_is_refused(toy_model, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(toy_model("llama-tiny"), target_is_directory=True)
    with pytest.raises(FetchError) as info:
        fetch_checkpoint(f"file://{link}", None, tmp_path / "work")
    assert str(info.value).startswith(f"spec.model.source: file://{link}") and "symlink" in str(info.value)


def test_symlinked_file_inside_the_checkpoint_is_refused(toy_model, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(toy_model("llama-tiny"), model)
    secret = tmp_path / "elsewhere.json"
    secret.write_text("{}")
    (model / "tokenizer_config.json").unlink()
    (model / "tokenizer_config.json").symlink_to(secret)
    with pytest.raises(FetchError, match=r"^spec\.model\.source: .*contains tokenizer_config\.json, a symlink"):
        fetch_checkpoint(f"file://{model}", None, tmp_path / "work")


def test_dotdot_inside_a_file_path_is_refused(toy_model, tmp_path):
    model = toy_model("llama-tiny")
    sneaky = f"file://{model}/../{model.name}"
    with pytest.raises(FetchError, match=r"^spec\.model\.source: .* has a '\.\.' segment"):
        fetch_checkpoint(sneaky, None, tmp_path / "work")


def test_pvc_escapes_are_refused(toy_model, tmp_path, monkeypatch):
    root = tmp_path / "pvcs"
    (root / "claim").mkdir(parents=True)
    monkeypatch.setenv("KILN_PVC_ROOT", str(root))
    with pytest.raises(FetchError, match=r"^spec\.model\.source: pvc://claim/\.\./other has a '\.\.' segment"):
        fetch_checkpoint("pvc://claim/../other", None, tmp_path / "work")
    os.symlink(toy_model("llama-tiny"), root / "claim" / "model")  # points outside the claim
    with pytest.raises(FetchError, match=r"^spec\.model\.source: pvc://claim/model goes through the symlink"):
        fetch_checkpoint("pvc://claim/model", None, tmp_path / "work")
