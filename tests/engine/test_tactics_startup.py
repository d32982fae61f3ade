"""Start-up without a table (kiln.engine.tactics.deferred): with ``$KILN_TACTICS_AT_LOAD=background`` an engine
with no table for its host loads on the untimed default, times its own table in the background once the
engine loop ticks, swaps it in between steps (the tokens do not change), and caches it, MLP slice included,
so the next start times nothing; /version's ``origin`` and ``why`` say which table runs and why."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch
from kiln.engine import SamplingParams
from kiln.engine.kernels import candidates, native
from kiln.engine.tactics import deferred, resolve
from kiln.engine.tactics.timing import LinearSite

PROMPT = [[5, 9, 33, 2, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv(resolve.BUDGET_ENV, "2")
    monkeypatch.setattr(resolve, "_memo", {})
    return tmp_path / "cache" / "kiln" / "tactics"


def test_the_default_runs_everywhere_untimed():
    kernels = native.kernels()
    sites = [LinearSite(torch.float32, 64, 32, 48), LinearSite(torch.bfloat16, 96, 64, 8, quant="int8")]
    table = deferred.default_table(sites, kernels)
    for site in sites:
        choice = table.linear[site.key]
        assert choice.layout == "plain" and {b["runs"] for b in choice.buckets} == {"aten"}
        assert candidates.why_not("aten", site.dtype, kernels, site.quant) is None
        assert resolve.packing(choice, site, kernels) == ("plain", None)
    assert table.model["decoder_stack"]["winner"] == "modules" and table.model["mlp_rows"]["winner"] is None


def _wait_swapped(llm, timeout=120.0):
    engine = llm.engine
    deadline = time.monotonic() + timeout
    while engine.runner.tactics_job is not None and time.monotonic() < deadline:
        engine.between_steps.idle()  # the engine loop's idle tick
        time.sleep(0.05)
    assert engine.runner.tactics_job is None, "the background timing did not finish"


def test_background_timing_swaps_between_steps_and_is_cached(toy_model, make_llm, fresh_cache, monkeypatch):
    model_dir = toy_model("llama-tiny")
    reference = make_llm(model_dir, num_kv_blocks=16, device="cpu", tactics="aten").generate(PROMPT, GREEDY)
    monkeypatch.setenv(deferred.MODE_ENV, "background")
    llm = make_llm(model_dir, attention_backend="auto", num_kv_blocks=16, device="cpu")
    info = llm.engine.config.tactics_info
    assert info["source"] == info["origin"] == "default-until-timed" and "background" in info["why"]
    assert set(info["layouts"]) == {"plain"} and not list(fresh_cache.glob("*.json"))  # nothing timed at load
    assert llm.generate(PROMPT, GREEDY)[0].token_ids == reference[0].token_ids
    _wait_swapped(llm)
    info = llm.engine.config.tactics_info
    assert info["source"] == "measured" and info["origin"] == "timed-here" and "swapped in" in info["why"]
    assert llm.generate(PROMPT, GREEDY)[0].token_ids == reference[0].token_ids  # repacked, same tokens
    saved = list(fresh_cache.glob("*.json"))
    assert len(saved) == 1
    slices = llm.engine.runner.tactics.model["mlp_rows"]  # timed on a copy of one MLP, applied to every layer
    assert "copy" in slices["how"] and all(m.mlp_rows == slices["winner"] for m in llm.engine.runner.model.modules()
                                           if hasattr(m, "mlp_rows") and m.rows_per_call)
    calls = []
    real = resolve.measure
    monkeypatch.setattr(resolve, "measure", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(resolve, "_memo", {})
    again = make_llm(model_dir, attention_backend="auto", num_kv_blocks=16, device="cpu")
    info = again.engine.config.tactics_info
    assert info["origin"] == "cache" and info["source"] == "measured (cached)" and not calls
    assert again.engine.runner.tactics_job is None


def test_an_engine_shut_down_while_its_table_is_timed_lets_go_of_its_model(toy_model, fresh_cache, monkeypatch):
    """A pool unloads an engine whose table is still timed in the background: the timing keeps shapes only, so
    the engine's model goes at once (the job held one MLP for the prefill slice, and through the panels it shares
    every weight: a pool's RSS grew 540 MiB a reload of SmolLM2 float32), and the linears it times are cached."""
    from kiln.engine import LLM

    gate = threading.Event()
    real = resolve.measure
    monkeypatch.setattr(resolve, "measure", lambda *a, **k: gate.wait(60) and real(*a, **k))
    monkeypatch.setenv(deferred.MODE_ENV, "background")
    llm = LLM(toy_model("llama-tiny"), attention_backend="auto", num_kv_blocks=16, device="cpu")
    job = llm.engine.runner.tactics_job
    try:  # a job left waiting would hold the process's one timing (deferred._TIMING) for the tests after
        llm.engine.between_steps.idle()  # the engine loop's idle tick starts the job
        assert job.thread is not None and job.thread.is_alive() and job.time_mlp is not None
        mlps = [weakref.ref(m) for m in llm.engine.runner.model.modules() if hasattr(m, "gate_up_proj")]
        llm.shutdown()
        del llm
        gc.collect()
        assert mlps and all(ref() is None for ref in mlps) and job.thread.is_alive()  # gone while the timing runs
    finally:
        gate.set()
    assert job.done.wait(60) and job.result is not None and "mlp_rows" not in job.result.model
    assert len(list(fresh_cache.glob("*.json"))) == 1  # the linears timed, for the model's next engine


def test_a_second_engine_of_the_model_waits_for_the_table_the_first_is_timing(toy_model, make_llm, fresh_cache,
                                                                               monkeypatch):
    """A pool reloads a model before its last engine's background timing ended: the new engine's job waits for
    that table (one timing at a time in a process) and takes it from the cache rather than timing it again."""
    gate, calls = threading.Event(), []
    real = resolve.measure
    monkeypatch.setattr(resolve, "measure", lambda *a, **k: calls.append(1) or (gate.wait(60) and real(*a, **k)))
    monkeypatch.setenv(deferred.MODE_ENV, "background")
    model_dir = toy_model("llama-tiny")
    first = make_llm(model_dir, attention_backend="auto", num_kv_blocks=16, device="cpu")
    first.engine.between_steps.idle()
    second = make_llm(model_dir, attention_backend="auto", num_kv_blocks=16, device="cpu")
    job = second.engine.runner.tactics_job
    assert job is not None  # nothing cached yet: it serves the default too
    second.engine.between_steps.idle()
    try:
        deadline = time.monotonic() + 30
        while not calls and time.monotonic() < deadline:  # the first's timing under way
            time.sleep(0.01)
        time.sleep(0.2)
        assert calls == [1] and not job.done.is_set()  # waiting for the first's table, not timing its own
    finally:
        gate.set()
    _wait_swapped(first)
    _wait_swapped(second)
    info = second.engine.config.tactics_info
    assert calls == [1] and job.reused and info["origin"] == "cache" and "another engine" in info["why"]
    assert first.generate(PROMPT, GREEDY)[0].token_ids == second.generate(PROMPT, GREEDY)[0].token_ids


def test_the_library_still_times_at_load(toy_model, make_llm, fresh_cache, monkeypatch):
    """Without ``$KILN_TACTICS_AT_LOAD=background`` (LLM() in a script, a build) the table is timed at load, and
    the MLP slice chosen there is cached with it: the next start times nothing, not even the slice."""
    monkeypatch.delenv(deferred.MODE_ENV, raising=False)
    model_dir = toy_model("llama-tiny")
    llm = make_llm(model_dir, attention_backend="auto", num_kv_blocks=16, device="cpu")
    info = llm.engine.config.tactics_info
    assert info["origin"] == "timed-here" and info["source"] == "measured" and llm.engine.runner.tactics_job is None
    from kiln.engine.tactics.table import TacticTable

    saved = TacticTable.load(next(fresh_cache.glob("*.json")))
    assert set(saved.model) == set(llm.engine.runner.tactics.model)  # the slice too, where it was timed


def test_an_artifact_on_another_host_serves_the_default_and_caches_the_retimed_table(tmp_path, monkeypatch):
    """The build's table, measured on another kind of host: the default at once, the linears re-timed by the job
    (the build's model-level choices kept) into the artifact's cache, which the next start uses untimed; on the
    build's own kind of host nothing is timed, deferred or not."""
    from kiln.engine.tactics import host_signature
    from kiln.engine.tactics.table import TacticTable, _digest

    sites = [LinearSite(torch.float32, 64, 64, 8)]
    kernels = native.kernels()
    built = resolve.measure(sites, kernels, 5)
    built.model["decoder_stack"] = {"winner": "modules"}
    monkeypatch.setattr(deferred, "wanted", lambda background: True)
    calls = []
    real = resolve.measure
    monkeypatch.setattr(resolve, "measure", lambda *a, **k: calls.append(1) or real(*a, **k))
    same = built.save(tmp_path / "same.json")
    assert resolve.resolve(str(same), sites, kernels, str(tmp_path / "cache"))[1]["origin"] == "artifact"
    doc = built.to_json()
    doc["host"] = {**host_signature.cpu_signature(), "model": "Some Other CPU"}
    del doc["sha256"]
    path = TacticTable.from_json({**doc, "sha256": _digest(doc)}).save(tmp_path / "foreign.json")
    table, info = resolve.resolve(str(path), sites, kernels, str(tmp_path / "cache"))
    assert info["origin"] == "default-until-timed" and not calls and "differs from the build's" in info["why"]
    job = table.pending
    job.start(torch.get_num_threads())
    assert job.done.wait(60) and job.error is None and len(calls) == 1
    assert job.result.model["decoder_stack"] == {"winner": "modules"} and job.cache_path.is_file()
    again, info = resolve.resolve(str(path), sites, kernels, str(tmp_path / "cache"))
    assert info["origin"] == "cache" and info["source"] == "re-timed (cached)" and len(calls) == 1


def test_an_artifacts_table_as_built_on_this_kind_of_host_times_nothing_at_load_not_even_the_mlp_slice(
        toy_model, make_llm, fresh_cache, monkeypatch, tmp_path):
    """A build records the MLP's slice only where its prefill had a choice; a load of that table on the build's kind
    of host keeps the default the build ran (timing it at every load was 0.9 s of SmolLM2 GGUF's 1.3 s cold load)."""
    from kiln.engine.models.llama import CPU_MLP_ROWS
    from kiln.engine.tactics import bind
    from kiln.engine.tactics.table import TacticTable

    monkeypatch.delenv(deferred.MODE_ENV, raising=False)
    model_dir = toy_model("llama-tiny")
    timed = make_llm(model_dir, attention_backend="auto", num_kv_blocks=16, device="cpu")
    saved = TacticTable.load(next(fresh_cache.glob("*.json")))
    saved.model.pop("mlp_rows", None)  # as a build whose prefill had one slice to run records it
    built = saved.save(tmp_path / "tactics.json")
    reference = timed.generate(PROMPT, GREEDY)[0].token_ids
    monkeypatch.setattr(bind, "time_mlp_slices", lambda *a, **k: pytest.fail("the MLP slice was timed at load"))
    monkeypatch.setattr(resolve, "_memo", {})
    llm = make_llm(model_dir, attention_backend="auto", num_kv_blocks=16, device="cpu", tactics=str(built))
    assert llm.engine.config.tactics_info["origin"] == "artifact"
    assert "mlp_rows" not in llm.engine.runner.tactics.model
    assert all(m.mlp_rows == CPU_MLP_ROWS for m in llm.engine.runner.model.modules()
               if hasattr(m, "mlp_rows") and m.rows_per_call)
    assert llm.generate(PROMPT, GREEDY)[0].token_ids == reference
