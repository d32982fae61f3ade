"""The bench model: a seeded random-weight checkpoint, made once into a cache directory.

A directory is reused only if its ``kiln-toy.json`` records the same preset,
seed and dtype, so changing any of them never benchmarks a stale model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_PRESET = "llama-bench"
DEFAULT_GPU_PRESET = "llama-1b"  # --device cuda (resolved) without --preset
QUICK_PRESET = "llama-tiny"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kiln" / "bench-models"


def ensure_model(preset: str, dtype: str, seed: int = 0, model_dir: Path | None = None) -> Path:
    """Return a checkpoint directory for ``preset`` in ``dtype``, writing it if missing or different.

    A ``model_dir`` that already holds a checkpoint kiln bench did not write (``config.json`` +
    ``*.safetensors``: a real model, e.g. a fetched GGUF's) is benchmarked as it is, ``preset`` unused.
    """
    from kiln.engine.random_checkpoint import make_random_model

    out = model_dir or default_cache_dir() / f"{preset}-{dtype}-seed{seed}"
    marker = out / "kiln-bench.json"
    if model_dir is not None and not marker.is_file() and (out / "config.json").is_file():
        if not any(out.glob("*.safetensors")):
            raise ValueError(f"--model-dir {out} has a config.json but no *.safetensors weights; point it at a "
                             "checkpoint directory (config.json, tokenizer, *.safetensors)")
        return out
    want = {"preset": preset, "dtype": dtype, "seed": seed}

    def written() -> bool:  # this preset's model, whole (a writer renames it into place complete)
        return marker.is_file() and json.loads(marker.read_text()) == want and (out / "config.json").is_file()

    if written():
        return out
    if out.exists() and model_dir is None:
        shutil.rmtree(out)  # our own cache entry, stale or half-written
    elif out.exists() and any(out.iterdir()) and not marker.is_file():
        raise ValueError(f"--model-dir {out} exists but is neither a checkpoint (config.json + *.safetensors) nor "
                         "written by kiln bench; pass a checkpoint directory, or an empty or new one")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f"{out.name}.partial-"))  # one per process
    try:
        make_random_model(tmp, preset, seed=seed, dtype=dtype)
        (tmp / "kiln-bench.json").write_text(json.dumps(want))
        if out.exists() and not written():  # another preset's model, or an empty folder
            shutil.rmtree(out, ignore_errors=True)
        try:
            tmp.rename(out)
        except OSError:  # another process wrote the same model first: keep its copy
            if not written():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def model_facts(model_dir: Path) -> dict:
    """Shapes the ceiling and the report need, read from config.json."""
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    layers = cfg["num_hidden_layers"]
    inter = cfg["intermediate_size"]
    vocab = cfg["vocab_size"]
    per_layer = hidden * (heads * head_dim) + 2 * hidden * (kv_heads * head_dim) + (heads * head_dim) * hidden
    per_layer += 3 * hidden * inter
    matmul_params = layers * per_layer + hidden * vocab  # + LM head; the embedding is a lookup, not a matmul
    total_params = matmul_params + hidden * vocab * (0 if cfg.get("tie_word_embeddings") else 1)
    return {
        "hidden_size": hidden, "num_layers": layers, "num_heads": heads, "num_kv_heads": kv_heads,
        "head_dim": head_dim, "intermediate_size": inter, "vocab_size": vocab,
        "matmul_params": matmul_params, "total_params": total_params,
        "special_ids": sorted(_special_ids(model_dir, cfg)),
    }


def _special_ids(model_dir: Path, cfg: dict) -> set[int]:
    """bos/eos/pad from config.json plus every token tokenizer.json marks special."""
    ids = {cfg.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    tok = model_dir / "tokenizer.json"
    if tok.is_file():
        ids |= {t["id"] for t in json.loads(tok.read_text()).get("added_tokens", []) if t.get("special")}
    flat: set[int] = set()
    for i in ids:
        flat |= set(i) if isinstance(i, list) else {i}
    return {i for i in flat if isinstance(i, int)}
