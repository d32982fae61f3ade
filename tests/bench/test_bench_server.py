"""``kiln bench --server``: what can be checked without running the servers (the run itself: the note and
docs/performance.md). The export is a real aiperf 0.13 ``profile_export_aiperf.json`` against kiln serve."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from kiln_bench import server
from kiln_bench.cli import bench

EXPORT = Path(__file__).parent / "data" / "aiperf_export_c4.json"


def test_the_export_gives_throughput_ttft_and_itl_percentiles():
    row = server.read_export(EXPORT)
    assert row["out_tok_s"] == pytest.approx(8.393, abs=1e-3)
    assert row["ttft_p50_ms"] == pytest.approx(9190.92, abs=0.01) and row["ttft_p99_ms"] > row["ttft_p50_ms"]
    assert row["itl_p50_ms"] == pytest.approx(147.43, abs=0.01) and row["itl_p99_ms"] > row["itl_p50_ms"]
    assert row["requests"] == 8 and row["errors"] == 0


def test_every_system_gets_the_same_seeded_prompts():
    def cmd(url):
        return server.aiperf_command(Path("aiperf"), url, "m", Path("/tok"), 16, 128, 64, 7, 4, Path("/o"))

    kiln, vllm = cmd("http://127.0.0.1:1"), cmd("http://127.0.0.1:2")
    assert [a for a in kiln if "127.0.0.1" not in a] == [a for a in vllm if "127.0.0.1" not in a]
    flags = dict(zip(kiln[2::], kiln[3::], strict=False))
    assert flags["--random-seed"] == "7" and flags["--synthetic-input-tokens-stddev"] == "0"
    assert flags["--concurrency"] == "16" and flags["--request-count"] == "64"
    assert "--use-server-token-count" in kiln and "ignore_eos:true" in kiln


def test_the_table_shows_medians_side_by_side_with_the_ratio():
    runs = [{"out_tok_s": v, "ttft_p50_ms": 10.0, "errors": 0} for v in (90.0, 100.0, 400.0)]
    assert server.medians(runs)["out_tok_s"] == 100.0
    doc = {"model": "m", "dtype": "float32", "isl": 128, "osl": 64, "client": "0.13.0", "threads": 1, "repeats": 3,
           "host": "cpu", "concurrencies": [1], "baseline": "vllm", "ratios": {"1": 1.25},
           "systems": {"kiln": {"1": {"out_tok_s": 125.0, "errors": 0}}, "vllm": {"1": {"out_tok_s": 100.0}}}}
    text = server.text(doc)
    assert "| 1 | kiln | 125.0 |" in text and "| 1 | vllm | 100.0 |" in text and "= 1.25x" in text


@pytest.mark.parametrize("args, message", [
    (["--concurrency", "0,4"], "--concurrency '0,4'"),
    (["--baselines", "openvino"], "--baselines vllm"),
])
def test_bad_server_options_name_the_option(args, message, tmp_path):
    model = tmp_path / "m"
    result = CliRunner().invoke(bench, ["--server", "--quick", "--device", "cpu", "--model-dir", str(model), *args])
    assert result.exit_code == 2 and message in result.output, result.output
    shutil.rmtree(model, ignore_errors=True)


def test_dialects_compare_by_requests_when_aiperf_has_no_token_count_for_responses():
    """aiperf 0.13 reads a Responses stream's token count only from response.completed; a reply cut at
    max_output_tokens ends response.incomplete, so its export has no output tok/s (a real one, kiln serve at 16)."""
    row = server.read_export(EXPORT.parent / "aiperf_export_responses_c16.json")
    assert row["out_tok_s"] is None and row["req_s"] == pytest.approx(0.1702, abs=1e-3) and row["requests"] == 64
    chat = {"out_tok_s": 10.9, "req_s": 0.17, "requests": 64}
    responses = server.medians([row])
    table = {"kiln chat": {"16": chat}, "kiln responses": {"16": responses},
             "kiln messages": {"16": {**chat, "req_s": 0.1615}}}
    _, dialects = server._ratios(table, [16], ["chat", "messages", "responses"], None)
    assert dialects == {"messages / chat": {"16": 0.95},
                        "responses / chat": {"16": round(responses["req_s"] / 0.17, 3)}}
    assert responses["req_s"] == pytest.approx(row["req_s"], abs=1e-4)  # medians keep the digits a ratio needs


def test_endpoints_are_compared_with_the_prefix_cache_off():
    """Every run sends the same seeded prompts: with the cache on, only the first endpoint's first run computes
    them (aiperf's first kiln chat run read 3% of its prompts from the cache, the later ones 92%)."""
    on = server.kiln_command(Path("/m"), "float32", 1, 64, 2048)
    off = server.kiln_command(Path("/m"), "float32", 1, 64, 2048, prefix_caching=False)
    assert "--no-enable-prefix-caching" not in on and off == [*on, "--no-enable-prefix-caching"]


def test_the_translation_share_comes_from_kiln_s_counter(monkeypatch):
    """--endpoints reads kiln:dialect_translation_seconds_total around each dialect's run: its CPU per request and
    its share of the run's wall time print beside the requests/s ratio."""
    metrics = ('kiln:dialect_translation_seconds_total{endpoint="/v1/messages",model_name="m"} 0.5\n'
               'kiln:dialect_translation_seconds_total{endpoint="/v1/responses",model_name="m"} 2.0\n')

    class Answer:
        text = metrics

    monkeypatch.setattr(server.httpx, "get", lambda url, timeout: Answer())
    assert server.translation_seconds("http://127.0.0.1:1/v1", "responses") == 2.0
    assert server.translation_seconds("http://127.0.0.1:1/v1", "chat") is None
    row = {"req_s": 0.5, "requests": 64}  # 128 s of run
    assert server.translation_share(1.28, row, 64) == {"translation_ms_per_request": 20.0, "translation_share": 0.01}
    doc = {"model": "m", "dtype": "float32", "isl": 1, "osl": 1, "client": "0.13", "threads": 1, "repeats": 1,
           "host": "h", "concurrencies": [16], "ratios": {}, "baseline": None, "dialect_ratios": {},
           "systems": {"kiln messages": {"16": {"req_s": 0.5, "translation_ms_per_request": 20.0,
                                                "translation_share": 0.01}}}}
    assert "kiln messages translation: 20.00 ms CPU per request, 1.00% of the run's wall time" in server.text(doc)
