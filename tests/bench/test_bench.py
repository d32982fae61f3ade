"""`kiln bench`: the workload is what issue 7 specifies, the figures are computed one way for
all systems, and a --quick run of every system completes with a passing equality check.
No timing assertions: benchmarks are scripts that print numbers."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest
from kiln_bench.ceiling import workload_ceiling
from kiln_bench.records import RequestRecord, RunRecord, figures, percentile
from kiln_bench.workload import Workload, WorkloadSpec, make_workload

SPECIAL = {0, 1, 2, 3, 4}


def test_default_workload_matches_the_issue():
    wl = make_workload(WorkloadSpec(), vocab_size=32000, special_ids=SPECIAL)
    assert len(wl.requests) == 64
    assert all(32 <= len(r.prompt_token_ids) <= 256 for r in wl.requests)
    long = [r for r in wl.requests if r.output_len >= 128]
    assert len(long) == round(0.2 * 64)
    assert all(128 <= r.output_len <= 256 for r in long)
    assert all(16 <= r.output_len <= 64 for r in wl.requests if r not in long)
    assert all(r.arrival_time == 0 for r in wl.requests)
    assert not SPECIAL & {t for r in wl.requests for t in r.prompt_token_ids}
    assert all(0 <= t < 32000 for r in wl.requests for t in r.prompt_token_ids)


def test_workload_is_deterministic_and_seeded(tmp_path):
    a = make_workload(WorkloadSpec(seed=3), 1000, SPECIAL)
    b = make_workload(WorkloadSpec(seed=3), 1000, SPECIAL)
    c = make_workload(WorkloadSpec(seed=4), 1000, SPECIAL)
    assert a.to_json() == b.to_json()
    assert a.to_json() != c.to_json()
    a.save(tmp_path / "w.json")
    assert Workload.load(tmp_path / "w.json").to_json() == a.to_json()


def test_poisson_arrivals_and_shared_prefix():
    wl = make_workload(WorkloadSpec(num_requests=200, arrival_rate=10.0, shared_prefix_len=40), 1000, SPECIAL)
    times = [r.arrival_time for r in wl.requests]
    assert times == sorted(times) and times[0] == 0
    mean_gap = times[-1] / (len(times) - 1)
    assert 0.07 < mean_gap < 0.14  # 1/rate = 0.1 s
    prefix = wl.requests[0].prompt_token_ids[:40]
    assert all(r.prompt_token_ids[:40] == prefix for r in wl.requests)
    assert all(40 + 32 <= len(r.prompt_token_ids) <= 40 + 256 for r in wl.requests)


@pytest.mark.parametrize("field,value,option", [
    ("num_requests", 0, "--num-requests"), ("arrival_rate", -1.0, "--arrival-rate"),
    ("shared_prefix_len", -2, "--shared-prefix"),
])
def test_bad_workload_options_name_the_option(field, value, option):
    with pytest.raises(ValueError, match=option):
        WorkloadSpec(**{field: value}).check()


def test_figures_count_only_own_output_and_reject_wrong_lengths():
    reqs = [RequestRecord(0, 0.0, 0.5, 2.0, [7] * 4), RequestRecord(1, 0.0, 0.5, 2.0, [7] * 8)]
    run = RunRecord(system="x", duration_s=2.0, num_steps=8, requests=reqs)
    fig = figures(run, prompt_lens={0: 10, 1: 10}, output_lens={0: 4, 1: 8})
    assert fig["output_tok_s"] == 12 / 2.0
    assert fig["total_tok_s"] == 32 / 2.0
    assert fig["avg_batch"] == 12 / 8
    assert fig["ttft_p50_s"] == 0.5 and fig["e2e_p99_s"] == 2.0
    with pytest.raises(RuntimeError, match="expected exactly 5"):
        figures(run, prompt_lens={0: 10, 1: 10}, output_lens={0: 5, 1: 8})


def test_percentile_interpolates():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert percentile(list(range(101)), 99) == 99


def test_ceiling_switches_from_bandwidth_to_compute_bound():
    facts = {"matmul_params": 100_000_000, "num_layers": 12, "num_kv_heads": 4, "head_dim": 64}
    hw = {"bandwidth": {"read_gb_s": 20.0}, "peak_gflop_s": 400.0}
    small = workload_ceiling(hw, facts, 2, prompt_tokens=0, output_tokens=1000, avg_context=100, batch=1)
    big = workload_ceiling(hw, facts, 2, prompt_tokens=0, output_tokens=1000, avg_context=100, batch=64)
    assert small["decode_bound"].startswith("memory") and big["decode_bound"] == "compute"
    # batch 1: 200 MB of weights at 20 GB/s = 10 ms, plus 100 tokens of KV
    assert small["decode_step_ms"] == pytest.approx(10 + 100 * 2 * 12 * 4 * 64 * 2 / 20e9 * 1e3)
    assert big["output_tok_s"] > small["output_tok_s"]


def test_unknown_system_is_a_usage_error():
    proc = subprocess.run([sys.executable, "-m", "kiln", "bench", "--systems", "kiln,vllm"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--systems" in proc.stderr and "vllm" in proc.stderr and "Traceback" not in proc.stderr


def _quick(tmp_path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        # A relative --model-dir, as users type it: the systems run from scratch directories.
        [sys.executable, "-m", "kiln", "bench", "--quick", "--model-dir", "model",
         "--json", str(out), "--strict", *extra],
        capture_output=True, text=True, timeout=280, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def _check_doc(doc: dict, systems: set[str]) -> None:
    assert set(doc["systems"]) == systems
    for entry in doc["systems"].values():
        med = entry["median"]
        for key in ("output_tok_s", "total_tok_s", "ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s",
                    "peak_rss_mib", "avg_batch"):
            assert med[key] > 0, key
        assert med["output_tokens"] == doc["workload"]["num_output_tokens"]
    assert set(doc["ratios"]) == systems - {"kiln"}
    assert doc["equality"]["passed"] is True and doc["equality"]["num_requests"] == 4
    assert doc["ceiling"]["hardware"]["bandwidth"]["read_gb_s"] > 0
    assert doc["ceiling"]["per_system"]["kiln"]["fraction"] > 0
    for key in ("cpu", "cpu_count", "torch", "torch_threads"):
        assert key in doc["machine"]


@pytest.mark.timeout(300)
def test_quick_bench_kiln_vs_static_passes_equality(tmp_path):
    # On x86-64 this run is also capped at AVX2 (--max-isa): kiln loads the kernels an AVX2-only host loads.
    cap = ["--max-isa", "avx2"] if platform.machine() == "x86_64" else []
    proc, doc = _quick(tmp_path, "--systems", "kiln,hf-static-b8", *cap)
    assert "greedy equality" in proc.stdout and "PASS" in proc.stdout
    assert "kiln x" in proc.stdout and "hardware:" in proc.stdout
    _check_doc(doc, {"kiln", "hf-static-b8"})
    if cap:
        assert doc["config"]["max_isa"] == "avx2" and "ISA capped at avx2" in proc.stdout
        (extra,) = doc["systems"]["kiln"]["extra"]
        assert extra["attention_backend"] != "native" or extra["cpu_kernels_level"] == "x86-64-v3"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_bench_runs_every_system(tmp_path):
    _, doc = _quick(tmp_path)
    _check_doc(doc, {"kiln", "hf-static-b8", "hf-static-b32", "hf-generate-batch"})


def test_the_gpu_preset_is_a_billion_parameter_llama():
    """`kiln bench --device cuda` defaults to llama-1b: a GPU figure on a 100M model would measure launch
    overhead, not the HBM-bound decode a GPU user serves."""
    import torch
    from kiln.engine.random_checkpoint import PRESETS
    from kiln_bench.model import DEFAULT_GPU_PRESET
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(PRESETS[DEFAULT_GPU_PRESET])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    params = sum(p.numel() for p in model.parameters())
    assert 1.0e9 <= params <= 2.0e9, params
    assert cfg["num_attention_heads"] > cfg["num_key_value_heads"]  # GQA, as the decode kernel is built for
