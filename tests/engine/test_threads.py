"""Threads for a server (kiln.engine.cpu_target.serving, configure_openmp; the tune stage's choice): compute
threads leave a core to the server's own threads, explicit settings still win, OpenMP waits passively where
it is configured before torch loads, and the build's serving count is the best that leaves that core."""

from __future__ import annotations

import os
import subprocess
import sys

from kiln.engine import cpu_target as ct


def test_a_server_leaves_a_core_to_its_own_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(ct.THREADS_ENV, raising=False)
    monkeypatch.setattr(ct, "cgroup_cpu_quota", lambda: None)
    monkeypatch.setattr(ct, "available_cpus", lambda: 2)
    monkeypatch.setattr(ct, "measure_threads", lambda *a: {1: 10.0, 2: 30.0})
    assert ct.choose_threads()[0] == 2  # the library, the model alone: measured
    with ct.serving():
        threads, why = ct.choose_threads()
        assert threads == 1 and "left to the server" in why
        here = {"model": ct.cpu_model(), "cpus": 2, "flags": [f for f in ct.RELEVANT_FLAGS if f in ct.cpu_flags()]}
        assert ct.choose_threads(2, here)[0] == 1  # an older build's hint, measured without the server
        monkeypatch.setattr(ct, "cgroup_cpu_quota", lambda: 4.0)
        monkeypatch.setattr(ct, "available_cpus", lambda: 8)
        assert ct.choose_threads()[0] == 3
        monkeypatch.setenv(ct.THREADS_ENV, "2")
        assert ct.choose_threads() == (2, f"${ct.THREADS_ENV}=2")  # the operator's word wins
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert ct.choose_threads()[0] is None
    monkeypatch.setattr(ct, "available_cpus", lambda: 1)
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.delenv(ct.THREADS_ENV)
    monkeypatch.setattr(ct, "cgroup_cpu_quota", lambda: None)
    with ct.serving():
        assert ct.choose_threads() == (1, "one CPU available")


def test_openmp_waits_passively_only_when_set_before_torch_loads():
    env = {}
    assert "torch" in sys.modules and ct.configure_openmp(env) == {} and env == {}  # too late here: no leak
    code = ("import os, sys; from kiln.engine import cpu_target as ct; print(ct.configure_openmp()); "
            "import torch; print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)")
    clean = {k: v for k, v in os.environ.items() if k not in ct.OPENMP_ENV}
    out = subprocess.run([sys.executable, "-P", "-c", code], env=clean, capture_output=True, text=True, check=True)
    assert "'OMP_WAIT_POLICY': 'PASSIVE'" in out.stdout and "PASSIVE True" in out.stdout
    mine = subprocess.run([sys.executable, "-P", "-c", code], env={**clean, "OMP_WAIT_POLICY": "ACTIVE"},
                          capture_output=True, text=True, check=True)
    assert "ACTIVE True" in mine.stdout  # the operator's setting stays


def test_serve_cli_configures_openmp_before_torch():
    code = "import os; import kiln.serving.cli; print(os.environ.get('OMP_WAIT_POLICY'))"
    clean = {k: v for k, v in os.environ.items() if k not in ct.OPENMP_ENV}
    out = subprocess.run([sys.executable, "-P", "-c", code], env=clean, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "PASSIVE"


def test_the_build_tunes_for_a_server(monkeypatch):
    """The tune stage measures 1, half, all but one and all the cores, and keeps the best that leaves the
    server its core (model_alone_threads records the model-only winner)."""
    import torch
    from kiln.builder.stages import tune as tune_stage

    monkeypatch.setattr(tune_stage, "available_cpus", lambda: 4)
    monkeypatch.setattr(tune_stage, "describe_host", lambda: {"model": "m", "cpus": 4})
    rates = {1: 10.0, 2: 18.0, 3: 25.0, 4: 30.0}
    monkeypatch.setattr(tune_stage, "measure", lambda llm, spec, v: {
        "prefill_tokens_per_s": 1.0, "decode": [{"decode_tokens_per_s": rates[torch.get_num_threads()]}]})

    class _LLM:
        def shutdown(self):
            pass

    class _Spec:
        tensor_parallel = 1

    tuning: dict = {}
    before = torch.get_num_threads()
    tune_stage._tune_cpu_threads(lambda: _LLM(), _Spec(), 100, tuning)
    assert torch.get_num_threads() == before
    assert sorted(int(n) for n in tuning["threads"]) == [1, 2, 3, 4]
    assert tuning["torch_num_threads"] == 3 and tuning["model_alone_threads"] == 4 and tuning["server_cores"] == 1
