"""``kiln bench``'s options come from one list, BenchOptions' fields (issue 39): each field is one option of the
command, named as click names it, with the field's default; the flags outside checks call keep their names."""

from __future__ import annotations

from dataclasses import fields

import click
from kiln_bench.cli import bench
from kiln_bench.options import BenchOptions, option

# The flags scripts, docs and outside checks call: renaming one breaks them.
FLAGS = ["--num-requests", "--seed", "--arrival-rate", "--shared-prefix", "--preset", "--model-dir", "--dtype",
         "--threads", "--device", "--repeats", "--systems", "--baselines", "--max-batch-size", "--max-num-tokens",
         "--check-requests", "--max-isa", "--json", "--quick", "--strict", "--structured", "--lora", "--gguf",
         "--server", "--concurrency", "--isl", "--osl", "--endpoints", "--speculative", "--profile", "--pool",
         "--batch-invariant", "--draft-model", "--draft-layers", "--pair-scale"]


def test_every_field_is_one_option_with_its_default():
    params = [p for p in bench.params if isinstance(p, click.Option)]
    assert [p.name for p in params] == [f.name for f in fields(BenchOptions)]
    assert [p.opts[0] for p in params] == FLAGS
    defaults = BenchOptions()  # the fields' defaults are what the command parses from no flag at all
    assert BenchOptions(**bench.make_context("bench", []).params) == defaults
    given = BenchOptions(**bench.make_context("bench", ["--server", "--endpoints", "chat,messages", "--json", "-",
                                                        "--concurrency", "16", "--lora", "2"]).params)
    assert (given.server, given.endpoints, given.json_out, given.concurrency, given.lora) == \
        (True, "chat,messages", "-", "16", 2)
    assert given.json_file is None and defaults.peer_names == []


def test_a_field_declared_with_option_is_a_flag_of_the_command():
    declared = option("--pair-scale", type=click.FloatRange(min=0, min_open=True), default=None, help="x")
    assert declared.default is None and declared.metadata["decls"] == ("--pair-scale",)
    assert option("--quick", is_flag=True, help="x").default is False


def test_batch_invariant_goes_to_every_kiln_server_of_the_pool_bench_and_is_refused_elsewhere():
    from click.testing import CliRunner
    from kiln_bench import pool
    from kiln_bench.suite import ALL_SYSTEMS

    assert pool._kiln(["--artifact", "file:///x"], 8000, ["--batch-invariant"])[-1] == "--batch-invariant"
    for args in (["--batch-invariant"], ["--batch-invariant", "--gguf", "/dev/null"]):
        result = CliRunner().invoke(bench, args)
        assert result.exit_code == 2 and "--batch-invariant goes with --pool" in result.output
    assert "kiln-batch-invariant" in ALL_SYSTEMS  # the suite's name for it


def test_kiln_warms_on_cuda_every_shape_a_build_compiles_and_on_cpu_one_request(monkeypatch):
    from types import SimpleNamespace

    from kiln.engine.kernels import cache as kernel_cache
    from kiln_bench import run_kiln

    warmed = []
    monkeypatch.setattr(kernel_cache, "warm_up", lambda llm: warmed.append(llm))
    for device in ("cpu", "cuda"):
        calls = []
        llm = SimpleNamespace(engine_config=SimpleNamespace(device=device),
                              generate=lambda prompts, params, calls=calls: calls.append(len(prompts)))
        run_kiln.warm(llm)
        assert calls == [2]
    assert len(warmed) == 1 and warmed[0].engine_config.device == "cuda"
