"""Peak memory of a build, from its own report, bounded relative to the checkpoint's size.

A random Llama whose weights dominate everything else (8 decoder layers of 12.6 MB, ~100 MB of float32
safetensors) goes through the quality gate's reference passes (fast) and through a whole `kiln build`
(slow), each in a fresh process, so the figures are the gate's own and not this test process's. That
process imports torch and transformers' Llama modules before the stage starts:
their fixed cost (~100 MB of code and tables) would otherwise land in whichever stage imports them first,
and this test is about what the *weights* cost. ``MALLOC_MMAP_THRESHOLD_`` pins glibc's threshold for
serving allocations from mmap: this model's 1-3 MB tensors would otherwise fall under glibc's sliding
threshold and their freed memory stay resident (a 70B model's tensors, >32 MB, are always mmapped and
returned on free), so RSS here measures what is live, as it would for a real checkpoint.

The quality gate streams one decoder layer at a time (kiln.builder.reference), so the reference stage
adds about two layers (one in float32, one converted) plus activations, far below one checkpoint; holding
the model whole (as the gate did before) adds two float32 copies or more. What a stage adds beyond the
weights (activations, transformers' first-forward setup, the allocator's arenas) depends on the host:
59 MiB on the development host, 77 on a CI host, for the same model. So the test that bounds the weights' share
compares the 8-layer model with a 2-layer one of the same width: streamed, the six extra layers add
almost nothing; held whole, they add three times their size.
"""

from __future__ import annotations

import json
import mmap
from pathlib import Path

import pytest
import yaml
from builder_helpers import manifest_dict, run_cli

LAYERS, FEW_LAYERS = 8, 2
# What the streaming gate may add beyond its start, as a fraction of the checkpoint: about three layers
# (a unit in its checkpoint dtype, quantized, dequantized: 3/8 of this model) plus the tokenizer,
# activations and transformers' first-forward setup (the host-dependent part: 0.59-0.77 measured).
# Holding the model whole measured 3.1x (see below).
STREAMING_STAGE_LIMIT = 1.0
# What the layers beyond FEW_LAYERS may add to the stage, as a fraction of their own bytes: streamed,
# none of them is resident at the peak (~0 measured); held whole, 3x.
STREAMING_PER_LAYER_LIMIT = 0.25
ENV = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}

PRELOAD = """
import json, sys
import torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama import modeling_llama
"""
PRELOAD_AND_BUILD = PRELOAD + """
from kiln.builder.cli import build
sys.argv[0] = "kiln build"
build()
"""
# The gate's reference stage as pipeline.run_build runs it, on the built-in calibration prompts.
PRELOAD_AND_GATE = PRELOAD + """
from kiln.builder import quality
from kiln.builder.reference import StreamedCausalLM
from kiln.builder.report import BuildReport
model = sys.argv[1]
report = BuildReport("gate")
with report.stage("quality_reference"):
    ids = [AutoTokenizer.from_pretrained(model)(p)["input_ids"] for p in quality.CALIBRATION_PROMPTS]
    source, converted = StreamedCausalLM(model), StreamedCausalLM(model, "cpu", "float32", "int8")
    metrics = quality.teacher_forced_metrics(source, converted, ids)
print(json.dumps({"memory": report.memory, "metrics": metrics}))
"""


def random_llama(tmp_path_factory, layers: int) -> tuple[Path, int]:
    from kiln.engine.random_checkpoint import make_random_model

    model = make_random_model(tmp_path_factory.mktemp(f"layers{layers}"), "llama-tiny", hidden_size=512,
                              intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=8,
                              num_key_value_heads=4)
    return model, sum(f.stat().st_size for f in model.glob("*.safetensors"))


@pytest.fixture(scope="module")
def big_model(tmp_path_factory) -> tuple[Path, int]:
    model, checkpoint_bytes = random_llama(tmp_path_factory, LAYERS)
    assert checkpoint_bytes > 90 * 2**20  # weights dominate: the bound means something
    return model, checkpoint_bytes


def gate_stage(model: Path) -> tuple[dict, dict]:
    """The reference stage's memory report and the gate's metrics, from a fresh process."""
    result = run_cli(str(model), prefix=["-P", "-c", PRELOAD_AND_GATE], env=ENV, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.splitlines()[-1])
    stage = out["memory"]["quality_reference"]
    assert stage["host_peak_scope"] == "stage"  # Linux: the stage's own window
    return stage, out["metrics"]


def test_streamed_gate_adds_a_fraction_of_the_checkpoint(big_model, tmp_path_factory):
    model, checkpoint_bytes = big_model
    few, few_bytes = random_llama(tmp_path_factory, FEW_LAYERS)
    stage, metrics = gate_stage(model)
    few_stage, _ = gate_stage(few)
    extra, few_extra = stage["host_extra_bytes"], few_stage["host_extra_bytes"]
    print(f"\ncheckpoint {checkpoint_bytes / 2**20:.1f} MiB; quality_reference peak RSS "
          f"{stage['host_peak_rss_bytes'] / 2**20:.1f} MiB (+{extra / 2**20:.1f}); with {FEW_LAYERS} layers "
          f"({few_bytes / 2**20:.1f} MiB) +{few_extra / 2**20:.1f}")
    assert 0 < extra < STREAMING_STAGE_LIMIT * checkpoint_bytes, (stage, checkpoint_bytes)
    assert extra - few_extra < STREAMING_PER_LAYER_LIMIT * (checkpoint_bytes - few_bytes), (stage, few_stage)
    assert metrics["num_positions"] > 100 and metrics["kl_divergence"] > 0  # int8 was measured


@pytest.mark.slow  # ~50 s on a 2-core host, most of it the CPU tuning
def test_whole_build_reports_peak_memory_per_stage(big_model, tmp_path):
    """This build before the gate streamed (it loaded the checkpoint and held the float32 source and
    converted models whole): convert +131.5 MiB, quality_reference +309.0 MiB (3.1x the checkpoint), build
    peak 858.8 MiB; streaming: quality_reference +58.0 MiB, build peak 645.4 MiB (shard)."""
    model, checkpoint_bytes = big_model
    # Memory, not quality, is under test: a random model's near-flat distributions may flip int8 near-ties.
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump(manifest_dict(
        f"file://{model}", quantization="int8", maxBatchSize=2, maxInputLen=64, maxSeqLen=96, maxNumTokens=64,
        build={"qualityGate": {"maxKLDivergence": 10.0, "minTokenAgreement": 0.0}})))
    result = run_cli("-f", str(manifest), "--store", f"file://{tmp_path / 'store'}", "--work-dir",
                     str(tmp_path / "work"), prefix=["-P", "-c", PRELOAD_AND_BUILD],
                     env={**ENV, "KILN_TERMINATION_LOG": str(tmp_path / "term")}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (doc_path,) = (tmp_path / "store" / "engines").glob("*/engine.json")
    memory = json.loads(doc_path.read_text())["build_report"]["memory"]
    stages = memory["stages"]
    print("\ncheckpoint %.1f MiB; per stage: peak RSS / extra (MiB)\n" % (checkpoint_bytes / 2**20) + "\n".join(
        f"  {name:18s} {m['host_peak_rss_bytes'] / 2**20:8.1f} {m['host_extra_bytes'] / 2**20:8.1f}"
        for name, m in stages.items()))
    assert all(m["host_peak_scope"] == "stage" for m in stages.values())  # Linux: per-stage windows
    assert memory["peak_host_rss_bytes"] == max(m["host_peak_rss_bytes"] for m in stages.values())
    extra = stages["quality_reference"]["host_extra_bytes"]
    assert 0 < extra < STREAMING_STAGE_LIMIT * checkpoint_bytes, (extra, checkpoint_bytes)
    # The runtime's gate loads the int8 artifact (~0.3 of the float32 checkpoint) and streams the source again.
    assert stages["quality_runtime"]["host_extra_bytes"] < (STREAMING_STAGE_LIMIT + 0.3) * checkpoint_bytes


def test_report_summary_names_the_peak_stage():
    from kiln.builder.report import BuildReport, summary_lines

    report = BuildReport("v1")
    with report.stage("small"):
        pass
    with report.stage("big"):
        # A fresh anonymous mapping, touched page by page: malloc could hand back pages an earlier test
        # freed but the allocator kept resident, which would add nothing to RSS.
        block = mmap.mmap(-1, 64 * 2**20)
        for offset in range(0, len(block), mmap.PAGESIZE):
            block[offset] = 1
        block.close()
    doc = report.to_dict()
    big, small = doc["memory"]["stages"]["big"], doc["memory"]["stages"]["small"]
    assert big["host_extra_bytes"] >= 60 * 2**20 > small["host_extra_bytes"]
    assert doc["memory"]["peak_host_rss_stage"] == "big"
    assert any(line.startswith("  peak memory: host RSS") and "(big)" in line for line in summary_lines(doc))
