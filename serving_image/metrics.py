"""Prometheus metrics under ``kiln:``, shaped like vLLM's so its dashboards adapt.

Two sources feed them. Request-level series (tokens, finish reasons, latency
histograms) are recorded by the server as each request streams, through a
:class:`RequestTimer`. Engine-level series (running/waiting requests, KV-cache
usage, prefix-cache queries/hits, preemptions, per-step batch sizes, speculative
drafts proposed/accepted) are read
from ``engine.stats()`` when Prometheus scrapes, by a custom collector, so
they are never stale and cost nothing between scrapes. Each app has its own
``CollectorRegistry``: two servers in one process (tests) never share series.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from kiln.engine.prefix_hash import PREFIX_HASH_SCHEME
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)


class EngineStatsCollector(Collector):
    """Reads the engine's counters at scrape time; empty until the engine is loaded."""

    def __init__(self, stats: Callable[[], Any | None], labels: dict[str, str],
                 lora_info: Callable[[], dict[str, Any] | None] = lambda: None) -> None:
        self._stats = stats
        self._labels = labels
        self._lora_info = lora_info  # the engine's running/waiting adapters (LLMEngine.lora_info), None: off

    def collect(self) -> Iterator[Any]:
        stats = self._stats()
        if stats is None:
            return
        names, values = list(self._labels), list(self._labels.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(values, float(value))
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, float(value))
            return family

        yield gauge("kiln:num_requests_running", "Requests in the engine's running batch.", stats.num_running)
        yield gauge(
            "kiln:num_requests_waiting", "Requests queued in the engine, not yet running.", stats.num_waiting
        )
        yield gauge("kiln:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", stats.kv_usage)
        yield gauge("kiln:kv_cache_total_blocks", "Blocks in the KV-cache pool.", stats.num_total_blocks)
        yield counter("kiln:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.prefix_cache_queries)
        yield counter(
            "kiln:prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits
        )
        yield counter("kiln:num_preemptions", "Requests preempted (recomputed) for lack of KV blocks.",
                      getattr(stats, "num_preemptions", 0))
        yield _batch_histogram(stats, names, values)
        yield from _spec_decode_metrics(stats, names, values)
        yield from endpoint_picker_metrics(stats, names, values, self._lora_info())


def _spec_decode_metrics(stats: Any, names: list[str], values: list[str]) -> Iterator[Any]:
    """Speculative decoding's counters, vLLM's ``vllm:spec_decode_*`` under ``kiln:``; absent when it is off.
    The acceptance rate is ``rate(num_accepted_tokens) / rate(num_draft_tokens)``; the gauge is the lifetime one."""
    if getattr(stats, "num_speculative_tokens", None) is None:
        return
    for name, doc, value in (
        ("kiln:spec_decode_num_drafts", "Decode rows that verified drafts.", stats.spec_num_drafts),
        ("kiln:spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", stats.spec_num_draft_tokens),
        ("kiln:spec_decode_num_accepted_tokens", "Draft tokens accepted.", stats.spec_num_accepted_tokens),
        ("kiln:spec_decode_steps_disabled_by_batch_size", "Steps that did not speculate: the build's table "
         "(by_batch) or disable_by_batch_size said off for the running batch.", stats.spec_steps_off_by_batch),
    ):
        family = CounterMetricFamily(name, doc, labels=names)
        family.add_metric(values, float(value))
        yield family
    per_pos = CounterMetricFamily("kiln:spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted at each draft position.", labels=[*names, "position"])
    for position, count in enumerate(stats.spec_accepted_per_position):
        per_pos.add_metric([*values, str(position)], float(count))
    yield per_pos
    rate = GaugeMetricFamily("kiln:spec_decode_draft_acceptance_rate",
                             "Accepted / proposed draft tokens since the engine started.", labels=names)
    rate.add_metric(values, float(stats.spec_acceptance_rate))
    yield rate


ENDPOINT_PICKER_PREFIX = "vllm:"  # the names the endpoint picker reads: one pod, one series each


def endpoint_picker_metrics(stats: Any, names: list[str], values: list[str],
                             lora: dict[str, Any] | None = None) -> Iterator[Any]:
    """The series the Gateway API Inference Extension's endpoint picker scrapes by default
    (its model-server protocol speaks vLLM's names), so an InferencePool over kiln pods
    needs no metric flags: queue depth, running requests, KV-cache usage, the cache's block
    size and size, and LoRA as vLLM exports it (adapters with running / waiting requests, comma-joined, and
    ``max_lora``; 0 with LoRA off; the value is the scrape time)."""
    for name, doc, value in (
        ("vllm:num_requests_waiting", "Same as kiln:num_requests_waiting (endpoint-picker name).", stats.num_waiting),
        ("vllm:num_requests_running", "Same as kiln:num_requests_running (endpoint-picker name).", stats.num_running),
        ("vllm:kv_cache_usage_perc", "Same as kiln:kv_cache_usage_perc (endpoint-picker name).", stats.kv_usage),
    ):
        family = GaugeMetricFamily(name, doc, labels=names)
        family.add_metric(values, float(value))
        yield family
    cache = GaugeMetricFamily("vllm:cache_config_info", "KV-cache configuration (labels); value 1.",
                              labels=[*names, "block_size", "num_gpu_blocks", "prefix_hash_scheme"])
    cache.add_metric([*values, str(getattr(stats, "block_size", 0)), str(stats.num_total_blocks),
                      PREFIX_HASH_SCHEME], 1.0)
    yield cache
    family = GaugeMetricFamily("vllm:lora_requests_info", "Running and waiting LoRA adapters; value: scrape time.",
                               labels=[*names, "running_lora_adapters", "waiting_lora_adapters", "max_lora"])
    lora = lora or {"running": [], "waiting": [], "max_lora": 0}
    family.add_metric([*values, ",".join(lora["running"]), ",".join(lora["waiting"]), str(lora["max_lora"])],
                      time.time())
    yield family


def _batch_histogram(stats: Any, names: list[str], values: list[str]) -> HistogramMetricFamily:
    """``kiln:iteration_batch_size``: requests per engine step.

    With a per-step record (``batch_size_histogram``: ``{batch_size: num_steps}``) the
    buckets are real; with only the engine's running sums (``sum_running`` over
    ``num_steps``) the family carries ``_sum`` and ``_count`` and a ``+Inf`` bucket,
    which is what the mean batch size (``rate(_sum) / rate(_count)``) needs.
    """
    family = HistogramMetricFamily("kiln:iteration_batch_size",
                                   "Requests in each engine step's batch (watch the mean, not the peak).",
                                   labels=names)
    counts = getattr(stats, "batch_size_histogram", None)
    if counts:
        buckets = [(str(float(b)), sum(n for size, n in counts.items() if size <= b)) for b in BATCH_BUCKETS]
        buckets.append(("+Inf", sum(counts.values())))
        total = float(sum(size * n for size, n in counts.items()))
    else:
        buckets = [("+Inf", int(getattr(stats, "num_steps", 0)))]
        total = float(getattr(stats, "sum_running", 0))
    family.add_metric(values, buckets, sum_value=total)
    return family


class ServingMetrics:
    """The app's registry plus the request-level series the server records."""

    def __init__(self, model_name: str, stats: Callable[[], Any | None],
                 lora_info: Callable[[], dict[str, Any] | None] = lambda: None) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self.labels = labels
        names = list(labels)
        r = self.registry
        self.prompt_tokens = Counter("kiln:prompt_tokens", "Prompt tokens processed.", names, registry=r)
        self.generation_tokens = Counter("kiln:generation_tokens", "Tokens generated.", names, registry=r)
        self.request_success = Counter("kiln:request_success", "Requests finished, by finish reason.",
                                       names + ["finished_reason"], registry=r)
        self.requests_rejected = Counter("kiln:requests_rejected", "Requests refused before reaching the "
                                         "engine, by reason (queue_full, draining, not_ready).",
                                         names + ["reason"], registry=r)
        self.ttft = Histogram("kiln:time_to_first_token_seconds", "Arrival to first generated token.",
                              names, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("kiln:inter_token_latency_seconds", "Time between generated tokens.",
                             names, buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("kiln:e2e_request_latency_seconds", "Arrival to last token.",
                             names, buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("kiln:request_queue_time_seconds", "Arrival until first scheduled.",
                                    names, buckets=_LATENCY_BUCKETS, registry=r)
        # Per LoRA adapter (label lora_name): requests finished and tokens generated; adapter load times.
        self.lora_requests = Counter("kiln:lora_requests", "Requests finished under each LoRA adapter.",
                                     names + ["lora_name"], registry=r)
        self.lora_generation_tokens = Counter("kiln:lora_generation_tokens", "Tokens generated under each LoRA "
                                              "adapter.", names + ["lora_name"], registry=r)
        self.lora_load_time = Histogram("kiln:lora_load_seconds", "Reading and checking a LoRA adapter into host "
                                        "memory.", names, buckets=_LATENCY_BUCKETS, registry=r)
        self.endpoint_requests = Counter("kiln:endpoint_requests", "Generation requests received, by endpoint "
                                         "(/v1/chat/completions, /v1/messages, /v1/responses...).",
                                         names + ["endpoint"], registry=r)
        self.dialect_seconds = Counter("kiln:dialect_translation_seconds", "CPU seconds spent translating requests "
                                       "and answers between chat and another API (/v1/messages, /v1/responses), "
                                       "by endpoint.", names + ["endpoint"], registry=r)
        r.register(EngineStatsCollector(stats, labels, lora_info))
        # Create every series up front, so dashboards and rate() see zeros rather than gaps.
        for metric in (
            self.prompt_tokens,
            self.generation_tokens,
            self.ttft,
            self.itl,
            self.e2e,
            self.queue_time,
        ):
            metric.labels(**labels)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(**labels, finished_reason=reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def received(self, endpoint: str) -> None:
        self.endpoint_requests.labels(**self.labels, endpoint=endpoint).inc()

    def rejected(self, reason: str) -> None:
        self.requests_rejected.labels(**self.labels, reason=reason).inc()

    def timer(self, lora_name: str | None = None) -> RequestTimer:
        return RequestTimer(self, lora_name)

    def lora_loaded(self, seconds: float) -> None:
        self.lora_load_time.labels(**self.labels).observe(seconds)


class RequestTimer:
    """Latency bookkeeping of one engine request (one choice), fed as deltas arrive."""

    def __init__(self, metrics: ServingMetrics, lora_name: str | None = None) -> None:
        self.metrics = metrics
        self.lora_name = lora_name
        self.arrival = time.monotonic()
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.num_output_tokens = 0

    def on_tokens(self, num_new: int, queue_time: float | None = None) -> None:
        if num_new <= 0:
            return
        now = time.monotonic()
        m, labels = self.metrics, self.metrics.labels
        if self.first_token is None:
            self.first_token = now
            m.ttft.labels(**labels).observe(now - self.arrival)
            if queue_time is not None:
                m.queue_time.labels(**labels).observe(max(queue_time, 0.0))
            num_gaps = num_new - 1
        else:
            num_gaps = num_new
        if num_gaps and self.last_token is not None:
            # Several tokens in one delta (multi-token step): spread the gap evenly.
            gap = (now - self.last_token) / num_gaps
            for _ in range(num_gaps):
                m.itl.labels(**labels).observe(gap)
        self.last_token = now
        self.num_output_tokens += num_new

    def finish(self, finish_reason: str, num_prompt_tokens: int) -> None:
        m, labels = self.metrics, self.metrics.labels
        m.prompt_tokens.labels(**labels).inc(num_prompt_tokens)
        m.generation_tokens.labels(**labels).inc(self.num_output_tokens)
        m.request_success.labels(**labels, finished_reason=finish_reason).inc()
        m.e2e.labels(**labels).observe(time.monotonic() - self.arrival)
        if self.lora_name is not None:
            m.lora_requests.labels(**labels, lora_name=self.lora_name).inc()
            m.lora_generation_tokens.labels(**labels, lora_name=self.lora_name).inc(self.num_output_tokens)
