"""``kiln bench --pool`` (issue 42): the pool's budget is chosen for two engines, the workload is skewed and seeded,
and the two checks are evaluated on what was measured: a wrong reference answer fails the greedy equality, and a
budget below the sampled RSS fails the memory check. The whole ``--quick`` run (four tiny engines built into
``.kiln-work``, five servers) is ``slow``."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from click.testing import CliRunner
from kiln_bench import pool, pool_parts

GiB = 2**30


def test_the_budget_holds_the_two_largest_and_says_when_it_needs_max_loaded_engines():
    budget, flags, how = pool.budget_flags({"a": 3 * GiB, "b": 2 * GiB, "c": 2 * GiB, "d": 2 * GiB})
    assert budget == 5 * GiB and flags == ["--memory-budget", str(5 * GiB)] and "no three" in how
    budget, flags, how = pool.budget_flags({"a": 4 * GiB, "b": 3 * GiB, "c": GiB // 4, "d": GiB // 4})
    assert budget == 7 * GiB and flags[-2:] == ["--max-loaded-engines", "2"] and "three smallest" in how


def test_the_workload_is_seeded_and_skewed():
    names = ["a", "b", "c", "d"]
    first = pool_parts.workload(names, 400, 8, seed=3)
    assert first == pool_parts.workload(names, 400, 8, seed=3)
    assert first != pool_parts.workload(names, 400, 8, seed=4)
    counts = Counter(q["engine"] for q in first)
    assert counts["a"] > counts["b"] > counts["c"] > counts["d"] > 0


def test_the_checks_fail_on_a_wrong_answer_and_an_rss_past_the_budget():
    good = [{"engine": "a", "prompt": "p", "pool": "x y", "alone": "x y"}]
    assert pool.equality(good)["passed"]
    assert not pool.equality([{**good[0], "alone": "x z"}])["passed"]
    assert not pool.equality([{**good[0], "pool": None, "alone": None}])["passed"]
    assert not pool.equality([])["passed"]
    assert pool.rss_check(GiB, GiB // 2, GiB // 2)["passed"]
    assert not pool.rss_check(GiB + 1, GiB // 2, GiB // 2)["passed"]
    assert not pool.rss_check(0, GiB, 0)["passed"]  # nothing sampled is not a pass


@pytest.mark.slow
def test_quick_pool_bench_reports_every_figure_and_evaluates_its_checks(tmp_path):
    from kiln_bench.cli import bench

    out = tmp_path / "pool.json"
    result = CliRunner().invoke(bench, ["--pool", "--quick", "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert set(doc["systems"]) == {"pool", "per-engine"} and doc["llamacpp"] is None
    assert doc["pool_flags"][:2] == ["--memory-budget", str(doc["rss"]["budget_bytes"])]
    assert doc["counters"]["loads"] >= 4  # every engine was asked for
    assert doc["equality"]["checked"] >= 4 and doc["rss"]["samples"] > 10
    assert doc["cold_load"]["median_cold_load_to_first_token_s"] > 0
    assert doc["pool_over_per_engine_tok_s"] > 0 and doc["per_engine_rss_over_pool"] > 0
    # (a) is evaluated on the measured answers: one wrong reference answer fails it.
    checks = [dict(c) for c in doc["checks"]]
    checks[0]["alone"] = (checks[0]["alone"] or "") + " wrong"
    assert not pool.equality(checks)["passed"]
    # (b) on the sampled peak: a budget under it fails.
    assert not pool.rss_check(doc["rss"]["max_rss_bytes"], doc["rss"]["max_rss_bytes"] // 2, 0)["passed"]
    assert "(a) greedy equality" in result.output and "(b) pool RSS max" in result.output


def test_start_servers_gives_each_server_its_own_port_and_the_pool_every_engine(tmp_path, monkeypatch):
    """The servers' wiring without starting them (the whole run is ``slow``): it broke once on a renamed import."""
    import kiln_bench.server

    started = []

    class FakeServer:
        def __init__(self, name, cmd, env, port, log, scratch, ready_path):
            self.name, self.cmd, self.env, self.port, self.ready_path = name, cmd, env, port, ready_path
            started.append(self)

        def wait_ready(self, path, timeout):
            assert path == self.ready_path

    monkeypatch.setattr(kiln_bench.server, "Server", FakeServer)
    built = {"smol": {"uri": "file:///s/smol", "kind": "gguf", "gguf": tmp_path / "m.gguf"},
             "tiny": {"uri": "file:///s/tiny", "kind": "kiln"}}
    servers = pool.start_servers(built, ["--max-loaded-engines", "2"], 1, tmp_path, tmp_path / "python", lambda m: None,
                                 ["--batch-invariant"])
    assert set(servers) == {"pool", "alone:smol", "alone:tiny", "llama.cpp"}
    assert len({s.port for s in started}) == 4 and all(s.env["OMP_NUM_THREADS"] == "1" for s in started)
    cmd = servers["pool"].cmd
    assert cmd[cmd.index("--port") + 1] == str(servers["pool"].port) and "--batch-invariant" in cmd
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--engine"] == ["smol=file:///s/smol", "tiny=file:///s/tiny"]
    assert json.loads((tmp_path / "llamacpp.json").read_text())["models"][0]["model_alias"] == "smol"
