"""``kiln bench --profile`` (issue 41): every component in the table, the rows adding up to the measured step,
and the timers leaving the outputs bit for bit as they are without them. The tactic table is pinned
(``tactics="kiln-fma"``: every linear on kiln's GEMM, so the decoder stack runs in C on any x86-64 host)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from kiln_bench import profile

ROWS = ("gemm", "attention", "kv_write", "norm", "rope", "activation", "bias", "forward_rest", "prepare", "schedule",
        "sample", "output", "other")


@pytest.fixture(scope="module")
def tiny(toy_model):
    return toy_model("llama-tiny")


def _native_or_skip():
    from kiln.engine.kernels.native import kernels

    lib = kernels()
    if lib is None:
        pytest.skip("kiln's CPU kernels do not load here (no C compiler or ISA level)")
    return lib


def _unclaimed(doc: dict) -> dict[tuple[str, str], float]:
    """Each cell's ``other`` as a share of its step."""
    return {(kind, batch): cell["other"] / cell["step"] for kind, by_batch in doc["profile"].items()
            for batch, cell in by_batch.items()}


def test_the_table_has_every_component_and_adds_up_to_the_step(tiny):
    _native_or_skip()

    def measure() -> dict:
        return profile.run(tiny, "float32", threads=1, prompt_len=8, decode_steps=4, tactics="kiln-fma",
                           log=lambda m: None)

    doc = measure()
    assert tuple(doc["rows"]) == ROWS
    assert set(doc["profile"]) == {"decode", "prefill"}
    for kind, by_batch in doc["profile"].items():
        assert sorted(by_batch, key=int) == ["1", "16", "64"], kind
        for batch, cell in by_batch.items():
            parts = sum(cell[r] for r in ROWS)
            assert parts == pytest.approx(cell["step"], rel=1e-9), (kind, batch)
            assert cell["other"] >= 0 and cell["forward_rest"] >= 0, (kind, batch, cell)
            for timed in ("gemm", "attention", "kv_write", "norm", "rope", "activation", "schedule", "prepare",
                          "sample", "output"):
                assert cell[timed] > 0, (kind, batch, timed)
    assert doc["profile"]["decode"]["1"]["steps"] == 4 and doc["profile"]["prefill"]["64"]["steps"] == 1
    # The phases cover the step: what no timer claims is a small share of it. A thread descheduled between two
    # phases (a busy host: 1.9 of 12.6 ms once, in a clean run beside two busy loops) lands there, so a cell over
    # 5 % is measured once more and each cell keeps its smaller share; code outside every phase would be in both.
    shares = _unclaimed(doc)
    if max(shares.values()) > 0.05:
        again = _unclaimed(measure())
        shares = {cell: min(share, again[cell]) for cell, share in shares.items()}
    worst = max(shares, key=shares.get)
    assert shares[worst] <= 0.05, f"the phases leave {100 * shares[worst]:.1f} % of the {worst} step unclaimed"
    doc.update(machine=profile.host(1), model="llama-tiny", notes=[profile.OPENVINO_NOTE])
    table = profile.text(doc)
    for row in ROWS:
        assert profile.LABELS[row] in table
    assert "decode b=64" in table and "prefill b=16 (128 tok)" in table and "OpenVINO GenAI: no column" in table


def test_linears_torch_runs_count_as_gemms_on_the_module_path(tiny):
    """tactics="aten": every linear is torch's, so no decoder stack: the kernels run module by module (their
    timers called through ctypes) and the GEMMs are timed around torch's linears."""
    from kiln.engine.layers.linear import LinearBase

    _native_or_skip()
    linear = LinearBase.__dict__["_linear"]
    doc = profile.run(tiny, "float32", threads=1, batches=(2,), prompt_len=4, decode_steps=2, tactics="aten",
                      log=lambda m: None)
    assert LinearBase.__dict__["_linear"] is linear  # put back
    cell = doc["profile"]["decode"]["2"]
    assert cell["gemm"] > 0 and cell["attention"] > 0 and cell["norm"] > 0
    assert sum(cell[r] for r in ROWS) == pytest.approx(cell["step"], rel=1e-9)


def test_a_timer_claiming_more_than_its_step_is_refused():
    kernels = {"gemm": (900, 3), "attention": (200, 1)}
    phases = {"schedule": 10, "prepare": 10, "forward": 1000, "sample": 10, "output": 10}
    with pytest.raises(profile.ProfileError, match="forward_rest"):
        profile.split(2000, phases, kernels)
    with pytest.raises(profile.ProfileError, match="other"):
        profile.split(1000, phases, {"gemm": (500, 1)})
    row = profile.split(1100, phases, {"gemm": (500, 1)})
    assert row["forward_rest"] == 500 and row["other"] == 60 and row["step"] == 1100


def test_profiling_leaves_the_outputs_bit_identical_and_off_counts_nothing(tiny):
    from kiln.engine import LLM, SamplingParams
    from kiln.engine.step_timer import StepTimer

    lib = _native_or_skip()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    prompts = [[5 + i, 9, 17 + 2 * i, 4, 30, 11 + i] for i in range(5)]
    with LLM(str(tiny), dtype="float32", device="cpu", num_kv_blocks=32, tactics="kiln-fma") as llm:
        lib.timers.take()
        off = llm.generate(prompts, params)
        assert all(ns == 0 and calls == 0 for ns, calls in lib.timers.take().values()), "timers off counted"
        llm.engine.runner.step_timer = timer = StepTimer()
        lib.timers.enable(True)
        try:
            on = llm.generate(prompts, params)
        finally:
            lib.timers.enable(False)
            llm.engine.runner.step_timer = None
        counted = lib.timers.take()
    assert counted["gemm"][1] > 0 and counted["attention"][1] > 0 and timer.take()["forward"] > 0
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.logprobs for o in on] == [o.logprobs for o in off]  # floats, compared exactly


def test_kiln_bench_profile_prints_the_table_and_writes_the_json(tmp_path):
    _native_or_skip()
    from kiln_bench.cli import bench

    out = tmp_path / "profile.json"
    result = CliRunner().invoke(bench, ["--profile", "--quick", "--device", "cpu", "--threads", "1", "--dtype",
                                        "float32", "--model-dir", str(tmp_path / "model"), "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "| **step (measured)** |" in result.output and "vLLM CPU: no column" in result.output
    doc = json.loads(out.read_text())
    assert set(doc["profile"]) == {"decode", "prefill"} and doc["config"]["batches"] == [1, 16, 64]


def test_kiln_bench_profile_refuses_baselines_it_would_not_run(tmp_path):
    from kiln_bench.cli import bench

    result = CliRunner().invoke(bench, ["--profile", "--quick", "--device", "cpu", "--baselines", "openvino",
                                        "--model-dir", str(tmp_path / "model")])
    assert result.exit_code == 2 and "drop --baselines openvino" in result.output


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_the_gpu_row_runs_decode_only_steps_under_the_profiler_and_reports_an_error_instead_of_failing(
        tiny, monkeypatch):
    """``_gpu_busy`` (run on CUDA only) exercised on CPU: the steps it profiles are decodes of every prompt, the
    engine is drained after, and a profiler that cannot run is an error in the table, not a failed profile."""
    import torch
    from kiln.engine import LLM

    # sized as profile.run sizes its engine: the prompt, the decode steps and 8 more
    llm = LLM(str(tiny), dtype="float32", max_batch_size=4, max_num_tokens=64, max_seq_len=4 + 8 + 8,
              enable_prefix_caching=False, tactics="aten")
    try:
        engine = llm.engine
        monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
        seqs = engine.sum_running
        busy = profile._gpu_busy(engine, [[5, 6, 7, 8]] * 3, decode_steps=8)
        assert busy["step_ms"] > 0 and busy["kernels_ms"] == 0  # no GPU: no device time
        assert not engine.has_unfinished()
        assert engine.sum_running - seqs >= 3 * 9  # the prefill and 8 decodes ran with all three in the batch
        monkeypatch.setattr(torch.cuda, "synchronize", lambda: (_ for _ in ()).throw(RuntimeError("no GPU")))
        failed = profile._gpu_busy(engine, [[5, 6, 7]], decode_steps=2)
        assert failed == {"error": "RuntimeError: no GPU"} and not engine.has_unfinished()
    finally:
        llm.shutdown()
    doc = {"machine": {"cpu": "x", "cpu_count": 16, "flags": [], "torch": "2", "loadavg": [0.1]},
           "config": {"threads": 1, "dtype": "bfloat16", "tactics": "auto", "prompt_len": 8, "decode_steps": 4,
                      "repeats": 1, "batches": [], "kernel_timers": False},
           "model": "llama-1b", "notes": [], "rows": [], "profile": {},
           "gpu_busy": {"16": {"step_ms": 4.0, "kernels_ms": 1.0}, "64": failed}}
    assert "GPU, decode b=16: kernels 1.000 ms of a 4.000 ms step under the profiler (25% busy)" in profile.text(doc)
    assert "GPU, decode b=64: RuntimeError: no GPU" in profile.text(doc)
