"""quantization: gguf on toy models written as GGUF in each type kiln runs (Q8_0, Q4_0, Q4_1): the blocks kept
(q/k rows un-permuted), sharded and loaded by the runtime; the artifact's size against the GGUF's; greedy
agreement with the dequantized float engine; the tactic table choosing among the GGUF candidates; refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from kiln.builder.errors import InvalidSpec
from kiln.builder.gguf_artifact import refuse_unrunnable, write_blocks, write_gguf_ranks
from kiln.engine.kernels import gguf_blocks
from safetensors.torch import load_file, save_file

gguf = pytest.importorskip("gguf")
NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:  # llama.cpp's convert_hf_to_gguf permute (rows)
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def make_gguf(toy: Path, out: Path, kind: str, linear_kind: str | None = None) -> tuple[Path, Path]:
    """(GGUF file, checkpoint dir of its dequantized weights) for the toy checkpoint ``toy``."""
    cfg = json.loads((toy / "config.json").read_text())
    state = load_file(str(toy / "model.safetensors"))
    ckpt = out / f"ckpt-{kind}"
    shutil.copytree(toy, ckpt)
    path = out / f"toy-{kind}.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    deq = {}
    for name, t in state.items():
        gname = None
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            for hf, g in NAMES.items():
                if f".{hf}." in name:
                    gname = f"blk.{name.split('.')[2]}.{g}.weight"
        if gname is None:
            deq[name] = t
            w.add_tensor(name.replace("model.", ""), t.float().numpy())
            continue
        this = linear_kind if linear_kind and gname.startswith("blk.") else kind
        blocks = gguf_blocks.quantize(t, this) if this in gguf_blocks.GGUF_TYPES else None
        if blocks is None:  # a type kiln does not run: written by gguf's own quantizer
            qt = gguf.GGMLQuantizationType[this]
            data = gguf.quants.quantize(t.float().numpy(), qt)
            w.add_tensor(gname, data, raw_dtype=qt)
            deq[name] = torch.from_numpy(gguf.quants.dequantize(data, qt)).reshape(t.shape)
            continue
        deq[name] = gguf_blocks.dequantize(blocks, this)
        raw = blocks.numpy()
        if ".attn_q." in gname or ".attn_k." in gname:
            raw = _permute(raw, cfg["num_attention_heads"] if ".attn_q." in gname else cfg["num_key_value_heads"])
        w.add_tensor(gname, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType[this])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    save_file(deq, str(ckpt / "model.safetensors"))
    return path, ckpt


class Spec:
    tensor_parallel, dtype = 1, "float32"


def _engine(ckpt: Path, weights: Path | None, tactics: str = "auto"):
    from kiln.engine import LLM

    kw = dict(dtype="float32", max_num_tokens=64, max_batch_size=8, max_seq_len=128, tactics=tactics)
    return LLM(str(ckpt), weights_dir=str(weights), quantization="gguf", **kw) if weights else LLM(str(ckpt), **kw)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_toy_gguf_builds_runs_and_agrees(toy_model, tmp_path, kind):
    from kiln.engine import SamplingParams

    toy = toy_model("llama-tiny")
    path, ckpt = make_gguf(toy, tmp_path, kind)
    reader = gguf.GGUFReader(str(path))
    write_blocks(reader, "llama", json.loads((ckpt / "config.json").read_text()), ckpt)
    assert refuse_unrunnable(ckpt, True) == {kind: 2 * 7 + 2}
    (path_w,) = [p for p, _ in write_gguf_ranks(ckpt, tmp_path / "weights", Spec, 1)]
    tensor_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    assert path_w.stat().st_size <= 1.2 * tensor_bytes  # the blocks as they are, not 4-8x
    engine = _engine(ckpt, tmp_path / "weights")
    table = engine.engine.runner.tactics
    keys = [k for k in table.linear if f"+{kind.lower()}:" in k]
    assert keys, list(table.linear)
    for key in keys:
        for b in table.linear[key].buckets:
            assert b["runs"] in ("kiln-gguf", "kiln-gguf-f32") and set(b["us"]) <= {"kiln-gguf", "kiln-gguf-f32"}
    del engine
    # Each GGUF kernel against the dequantized float engine, forced on every linear: the timed table mixes them
    # per bucket by host and load, and on the random toy's flat logits one early divergence moves the share
    # (with its cached table's mix, one host saw 0.67 where either kernel alone agreed >= 0.8).
    prompts = [[1, 5, 9, 200, 31], [7, 7, 300, 12], [40, 2, 77, 901, 5, 6], [600, 3], [11, 12, 13, 14], [999, 1]]
    sp = SamplingParams(max_tokens=12, temperature=0.0)
    ref = [o.token_ids for o in _engine(ckpt, None).generate(prompts, sp)]
    for forced in ("kiln-gguf", "kiln-gguf-f32"):
        got = [o.token_ids for o in _engine(ckpt, tmp_path / "weights", forced).generate(prompts, sp)]
        same = sum(a == b for x, y in zip(got, ref, strict=True) for a, b in zip(x, y, strict=False)) / sum(
            len(x) for x in ref)
        assert same >= 0.8, (forced, got, ref)


def test_a_type_kiln_cannot_run_is_refused_naming_the_tensor(toy_model, tmp_path):
    toy = toy_model("llama-tiny")
    path, ckpt = make_gguf(toy, tmp_path, "Q8_0", linear_kind="Q5_0")
    write_blocks(gguf.GGUFReader(str(path)), "llama", json.loads((ckpt / "config.json").read_text()), ckpt)
    with pytest.raises(InvalidSpec, match=r"tensor blk\.0\.attn_k\.weight is Q5_0, which kiln cannot run"):
        refuse_unrunnable(ckpt, True)
    with pytest.raises(InvalidSpec, match="spec.model.source must be a .gguf file"):
        refuse_unrunnable(ckpt, False)


def test_the_api_refuses_gguf_without_a_gguf_source():
    from kiln.api import LLMEngineSpec

    with pytest.raises(ValueError, match="quantization: gguf"):
        LLMEngineSpec(model={"source": "hf://org/model"}, gpu="cpu", quantization="gguf")
    LLMEngineSpec(model={"source": "file:///m/x.Q4_1.gguf"}, gpu="cpu", quantization="gguf")


def test_kiln_bench_writes_the_gguf_baselines_file_as_a_gguf_engine(toy_model, tmp_path):
    """``kiln bench --gguf``'s kiln side: the manifest it builds (``kiln build``) is a ``quantization: gguf``
    CPU engine of that very file, its sha256 pinned (``kiln plan`` accepts it)."""
    import subprocess
    import sys

    from kiln_bench import llamacpp

    path, _ = make_gguf(toy_model("llama-tiny"), tmp_path, "Q8_0")
    manifest = llamacpp.write_manifest(path, tmp_path / "engine.yaml")
    out = subprocess.run([sys.executable, "-P", "-m", "kiln", "plan", "-f", str(manifest)], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    assert "gguf" in out.stdout and str(path.resolve()) in manifest.read_text()


def test_a_gguf_without_a_tokenizer_is_refused_in_one_line(toy_model, tmp_path):
    """A GGUF whose metadata carries no tokenizer (the toy's) stops the build at fetch naming the file and the
    fix, not with transformers' traceback."""
    import subprocess
    import sys

    from kiln_bench import llamacpp

    path, _ = make_gguf(toy_model("llama-tiny"), tmp_path, "Q8_0")
    manifest = llamacpp.write_manifest(path, tmp_path / "engine.yaml")
    out = subprocess.run([sys.executable, "-P", "-m", "kiln", "build", "-f", str(manifest), "--store",
                          f"file://{tmp_path / 'store'}"], capture_output=True, text=True)
    assert out.returncode != 0 and "Traceback" not in out.stdout + out.stderr, out.stderr[-2000:]
    assert f"{path.name} carries no tokenizer kiln can read" in out.stdout + out.stderr
