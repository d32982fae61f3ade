"""The metrics module on its own: engine stats at scrape time, request timers, per-app registries."""

from __future__ import annotations

from types import SimpleNamespace

from kiln.engine.outputs import EngineStats
from kiln.serving.metrics import ServingMetrics
from prometheus_client.parser import text_string_to_metric_families


def samples(metrics: ServingMetrics) -> dict:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def stats(**kw) -> EngineStats:
    base = dict(num_running=3, num_waiting=2, kv_usage=0.25, num_free_blocks=30, num_total_blocks=40,
                prefix_cache_queries=100, prefix_cache_hits=40, num_preemptions=1, num_steps=10,
                num_computed_tokens=500, num_generated_tokens=60, sum_running=25, sum_kv_usage=2.0)
    return EngineStats(**{**base, **kw})


def test_engine_series_are_absent_until_loaded_then_read_at_scrape():
    current = {"stats": None}
    metrics = ServingMetrics("m", lambda: current["stats"])
    assert not any(name.startswith("kiln:num_requests") for name, _ in samples(metrics))
    current["stats"] = stats()
    got = samples(metrics)
    assert got[("kiln:num_requests_running", ())] == 3 and got[("kiln:num_requests_waiting", ())] == 2
    assert got[("kiln:kv_cache_usage_perc", ())] == 0.25
    assert (
        got[("kiln:prefix_cache_queries_total", ())] == 100
        and got[("kiln:prefix_cache_hits_total", ())] == 40
    )
    # Without a per-step record the batch histogram still gives the mean: sum / count.
    assert got[("kiln:iteration_batch_size_count", ())] == 10
    assert got[("kiln:iteration_batch_size_sum", ())] == 25
    current["stats"] = stats(num_running=0)
    assert samples(metrics)[("kiln:num_requests_running", ())] == 0


def test_batch_histogram_buckets_from_a_per_step_record():
    record = SimpleNamespace(**{**vars(stats()), "batch_size_histogram": {1: 3, 4: 2, 100: 1}})
    got = samples(ServingMetrics("m", lambda: record))
    assert got[("kiln:iteration_batch_size_bucket", (("le", "1.0"),))] == 3
    assert got[("kiln:iteration_batch_size_bucket", (("le", "4.0"),))] == 5
    assert got[("kiln:iteration_batch_size_bucket", (("le", "96.0"),))] == 5
    assert got[("kiln:iteration_batch_size_bucket", (("le", "+Inf"),))] == 6
    assert got[("kiln:iteration_batch_size_sum", ())] == 3 + 8 + 100


def test_spec_decode_series_only_when_speculation_is_on():
    assert not any(name.startswith("kiln:spec_decode") for name, _ in samples(ServingMetrics("m", stats)))
    on = stats(num_speculative_tokens=3, spec_num_drafts=5, spec_num_draft_tokens=12, spec_num_accepted_tokens=9,
               spec_accepted_per_position=[5, 3, 1], spec_steps_off_by_batch=2)
    got = samples(ServingMetrics("m", lambda: on))
    assert got[("kiln:spec_decode_num_drafts_total", ())] == 5
    assert got[("kiln:spec_decode_num_draft_tokens_total", ())] == 12
    assert got[("kiln:spec_decode_num_accepted_tokens_total", ())] == 9
    assert got[("kiln:spec_decode_steps_disabled_by_batch_size_total", ())] == 2
    assert got[("kiln:spec_decode_num_accepted_tokens_per_pos_total", (("position", "1"),))] == 3
    assert got[("kiln:spec_decode_draft_acceptance_rate", ())] == 0.75


def test_request_timer_feeds_counters_and_histograms():
    metrics = ServingMetrics("m", lambda: None)
    timer = metrics.timer()
    timer.on_tokens(1, queue_time=0.01)
    timer.on_tokens(2)
    timer.on_tokens(0)
    timer.finish("length", num_prompt_tokens=7)
    got = samples(metrics)
    assert got[("kiln:prompt_tokens_total", ())] == 7
    assert got[("kiln:generation_tokens_total", ())] == 3
    assert got[("kiln:request_success_total", (("finished_reason", "length"),))] == 1
    assert got[("kiln:request_success_total", (("finished_reason", "abort"),))] == 0
    assert got[("kiln:time_to_first_token_seconds_count", ())] == 1
    assert got[("kiln:request_queue_time_seconds_count", ())] == 1
    assert got[("kiln:inter_token_latency_seconds_count", ())] == 2
    assert got[("kiln:e2e_request_latency_seconds_count", ())] == 1


def test_registries_are_per_app():
    a, b = ServingMetrics("a", lambda: None), ServingMetrics("b", lambda: None)
    a.timer().finish("stop", 5)
    assert samples(a)[("kiln:prompt_tokens_total", ())] == 5
    assert samples(b)[("kiln:prompt_tokens_total", ())] == 0
