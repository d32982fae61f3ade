"""Helpers the builder tests share (imported as a module; tests/ is not a package)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["The kiln engine", "Once upon a time there was a", "def add(a, b):"]


def manifest_dict(source: str, name: str = "tiny", **spec) -> dict:
    base = {"model": {"source": source}, "gpu": "cpu", "dtype": "float32", "quantization": "none",
            "maxBatchSize": 4, "maxInputLen": 128, "maxSeqLen": 256, "maxNumTokens": 128}
    for key, value in spec.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return {"apiVersion": "serving.kiln.dev/v1alpha1", "kind": "LLMEngine", "metadata": {"name": name},
            "spec": base}


def run_cli(*args: str, env: dict[str, str] | None = None, prefix: list[str] | None = None,
            **kw) -> subprocess.CompletedProcess:
    """``python -m kiln ARGS`` (or ``python PREFIX... ARGS``) from the repository root."""
    return subprocess.run([sys.executable, *(prefix or ["-m", "kiln"]), *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=REPO, **kw)


def hf_greedy(model_dir: Path, prompts: list[str], max_new_tokens: int, dtype: str = "float32") -> list[list[int]]:
    """The source model's greedy continuations through transformers (the definition of correct)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()
    outs = []
    for p in prompts:
        ids = tok(p, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 attention_mask=torch.ones_like(ids), pad_token_id=tok.eos_token_id,
                                 eos_token_id=None, min_new_tokens=max_new_tokens)
        outs.append(gen[0, ids.shape[1]:].tolist())
    return outs


def engine_json(store_uri: str, version: str, dest: Path) -> tuple[Path, dict]:
    """Fetch (and verify) the published artifact; return its directory and engine.json."""
    from kiln.artifacts import ArtifactStore

    path = ArtifactStore.from_uri(store_uri).fetch(version, dest)
    return path, json.loads((path / "engine.json").read_text())


def version_of(manifest: Path) -> str:
    from kiln.envelope import engine_version
    from kiln.manifest import load_manifest

    return engine_version(load_manifest(manifest))
