"""A TP=2 artifact: two per-rank files that load on two gloo ranks and reproduce the source model."""

from __future__ import annotations

import json

from builder_helpers import PROMPTS, engine_json, hf_greedy, version_of
from safetensors import safe_open

NEW_TOKENS = 6


def test_tp2_artifact_loads_on_two_gloo_ranks(toy_model, write_manifest, kiln_build, tmp_path):
    from kiln.engine import LLM, SamplingParams

    model = toy_model("llama-tiny")
    # A step longer than one MLP slice (256 rows): rank 0 alone cannot time the slice, whose all-reduces every
    # rank must match (this build once died in the tactics stage with a gloo size mismatch).
    manifest = write_manifest(f"file://{model}", tensorParallel=2, maxInputLen=512, maxSeqLen=768, maxNumTokens=512)
    store = f"file://{tmp_path / 'store'}"
    result = kiln_build("-f", str(manifest), "--store", store)
    assert result.exit_code == 0, result.output
    artifact, doc = engine_json(store, version_of(manifest), tmp_path / "fetched")
    assert doc["engine_config"]["tensor_parallel_size"] == 2
    files = sorted(p.name for p in (artifact / "weights").iterdir())
    assert files == ["rank-0-of-2.safetensors", "rank-1-of-2.safetensors"]
    with safe_open(str(artifact / "weights" / files[0]), framework="pt") as f:
        qkv = next(k for k in f.keys() if k.endswith("qkv_proj.weight"))
        # llama-tiny: 4 heads + 2 + 2 KV heads of 16 -> 128 rows in all, 64 per rank.
        assert f.get_slice(qkv).get_shape() == [64, 64]
    assert doc["build_report"]["quality"]["runtime_token_agreement"] == 1.0
    tactics = json.loads((artifact / "tactics.json").read_text())
    assert tactics["model"]["mlp_rows"]["winner"] is None  # the default slice, on every rank

    llm = LLM.from_artifact(artifact)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    finally:
        llm.shutdown()
    assert [o.token_ids for o in outs] == hf_greedy(model, PROMPTS, NEW_TOKENS)
