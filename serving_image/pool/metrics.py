"""The pool's series, on the server's own registry (``ServingMetrics.registry``), labelled by engine:
loads, evictions (by reason: ``lru``, ``idle``, ``removed``), load seconds, engines loaded, memory in use and
the budget. The gauges are read when Prometheus scrapes.

``kiln:num_requests_waiting``, what KEDA and the HPA scale on (docs/scale-out.md), is the pool's in one family: each
loaded engine's queue under its name (``model_name``), and the requests waiting for their engine to be placed or
loaded under the server's own name, so ``sum(kiln:num_requests_waiting)`` over a pod counts both."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kiln.serving.pool.slot import LOADED
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

LOAD_BUCKETS = (0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class PoolMetrics:
    def __init__(self, registry: CollectorRegistry, pool: Any) -> None:
        r = registry
        self.loads = Counter("kiln:pool_engine_loads", "Engines loaded into the pool.", ["engine"], registry=r)
        self.evictions = Counter("kiln:pool_engine_evictions", "Engines unloaded from the pool, by reason (lru: "
                                 "room for another, idle: --idle-unload-after, removed: left the engines file, "
                                 "failed: its step loop died).",
                                 ["engine", "reason"], registry=r)
        self.load_seconds = Histogram("kiln:pool_engine_load_seconds", "From the local cache (fetched when absent) "
                                      "to an engine warmed up.", ["engine"], buckets=LOAD_BUCKETS, registry=r)
        Gauge("kiln:pool_engines_loaded", "Engines loaded now.", registry=r).set_function(lambda: pool.num_loaded)
        Gauge("kiln:pool_memory_in_use_bytes", "What the engines loaded, loading or unloading count against the "
              "budget.", registry=r).set_function(lambda: pool.memory_in_use)
        Gauge("kiln:pool_memory_budget_bytes", "The pool's memory budget.", registry=r).set_function(
            lambda: pool.budget)
        Gauge("kiln:pool_queue_length", "Requests waiting for an engine to be placed.", registry=r).set_function(
            lambda: pool.num_queued)
        r.register(WaitingCollector(pool))

    def loaded(self, engine: str, seconds: float) -> None:
        self.loads.labels(engine=engine).inc()
        self.load_seconds.labels(engine=engine).observe(seconds)

    def evicted(self, engine: str, reason: str) -> None:
        self.evictions.labels(engine=engine, reason=reason).inc()


class WaitingCollector(Collector):
    """``kiln:num_requests_waiting`` in a pool (the single engine's collector has no engine there): a row per
    loaded engine, its engine's queue, and the pool's row, the requests no engine has admitted yet."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily]:
        own = self.pool.metrics.labels
        family = GaugeMetricFamily("kiln:num_requests_waiting", "Requests queued in an engine, not yet running; "
                                   "under the pool's name: requests waiting for their engine to be placed or "
                                   "loaded.", labels=list(own))
        rows: dict[tuple[str, ...], float] = {tuple(own.values()): float(self.pool.num_waiting)}
        for slot in [*self.pool.slots.values(), *self.pool.leaving]:
            engine = slot.state.engine
            if slot.status == LOADED and engine is not None:  # one row per label set: an engine named as the pool,
                key = tuple(slot.metrics.labels.values())  # or a slot draining beside its successor, sums into it
                rows[key] = rows.get(key, 0.0) + float(engine.stats().num_waiting)
        for values, waiting in rows.items():
            family.add_metric(list(values), waiting)
        yield family
