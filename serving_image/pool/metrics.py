"""The pool's series, on the server's own registry (``ServingMetrics.registry``), labelled by engine:
loads, evictions (by reason: ``lru``, ``idle``, ``removed``), load seconds, engines loaded, memory in use and
the budget. The gauges are read when Prometheus scrapes."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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

    def loaded(self, engine: str, seconds: float) -> None:
        self.loads.labels(engine=engine).inc()
        self.load_seconds.labels(engine=engine).observe(seconds)

    def evicted(self, engine: str, reason: str) -> None:
        self.evictions.labels(engine=engine, reason=reason).inc()
