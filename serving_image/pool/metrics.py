"""The pool's series, on the server's own registry (``ServingMetrics.registry``), labelled by engine:
loads, evictions (by reason: ``lru``, ``idle``, ``removed``), load seconds, engines loaded, memory in use and
the budget; and every loaded engine's engine-level series under its name (:class:`EnginesCollector`). The gauges
are read when Prometheus scrapes.

``kiln:num_requests_waiting``, what KEDA and the HPA scale on (docs/scale-out.md), is the pool's in one family: each
loaded engine's queue under its name (``model_name``), and the requests waiting for their engine to be placed or
loaded under the server's own name, so ``sum(kiln:num_requests_waiting)`` over a pod counts both."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from kiln.serving.metrics import ENDPOINT_PICKER_PREFIX, EngineStatsCollector, endpoint_picker_metrics
from kiln.serving.pool.slot import LOADED
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
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
        r.register(EnginesCollector(pool))

    def loaded(self, engine: str, seconds: float) -> None:
        self.loads.labels(engine=engine).inc()
        self.load_seconds.labels(engine=engine).observe(seconds)

    def evicted(self, engine: str, reason: str) -> None:
        self.evictions.labels(engine=engine, reason=reason).inc()


class EnginesCollector(Collector):
    """The engine-level series a single server exports (:class:`kiln.serving.metrics.EngineStatsCollector`: running
    and waiting requests, KV-cache usage, prefix-cache queries and hits, preemptions, batch sizes, speculative
    decoding), a row per loaded engine under its name (the single engine's collector has no engine in a pool), read
    when Prometheus scrapes. ``kiln:num_requests_waiting`` has one more row, under the pool's name: the requests no
    engine has admitted yet. The endpoint picker's ``vllm:`` names are the pod's, one row each under the pool's
    name (:func:`pod_stats`, :func:`pod_models`): the picker scores pods, not engines.

    One family per name, and one sample per label set: an engine named as the pool, or a slot draining beside its
    successor under one name, sum into one row (Prometheus would drop one of two, and an autoscaler read the other);
    of an ``_info`` series, which carries its value in its labels, the first is kept."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        loaded = []
        for slot in [*self.pool.slots.values(), *self.pool.leaving]:
            engine = slot.state.engine
            if slot.status != LOADED or engine is None:
                continue
            stats, lora = engine.stats(), getattr(getattr(engine, "engine", None), "lora_info", lambda: None)()
            loaded.append((slot, stats, lora))  # one reading for the engine's rows and the pod's
            for family in EngineStatsCollector(lambda s=stats: s, slot.metrics.labels, lambda x=lora: x).collect():
                if not family.name.startswith(ENDPOINT_PICKER_PREFIX):  # the pod's own, below
                    _merge(families, family)
        own = self.pool.metrics.labels
        queued = GaugeMetricFamily(WAITING, "Requests queued in an engine, not yet running; under the pool's name: "
                                   "requests waiting for their engine to be placed or loaded.", labels=list(own))
        queued.add_metric(list(own.values()), float(self.pool.num_waiting))
        _merge(families, queued)
        yield from families.values()
        yield from endpoint_picker_metrics(pod_stats(self.pool, loaded), list(own), list(own.values()),
                                           pod_models(self.pool, loaded))


def pod_stats(pool: Any, loaded: list[tuple[Any, Any, Any]]) -> SimpleNamespace:
    """The pod as one model server, for the endpoint picker (an InferencePool over pool pods scores pods, and reads
    one series of each name): every loaded engine's queue plus the requests waiting for their engine to be placed or
    loaded, their running requests, the fullest KV cache, and the first loaded engine's cache shape."""
    stats = [s for _, s, _ in loaded if s is not None]
    return SimpleNamespace(num_waiting=sum(s.num_waiting for s in stats) + pool.num_waiting,
                           num_running=sum(s.num_running for s in stats),
                           kv_usage=max((s.kv_usage for s in stats), default=0.0),
                           block_size=getattr(stats[0], "block_size", 0) if stats else 0,
                           num_total_blocks=stats[0].num_total_blocks if stats else 0)


def pod_models(pool: Any, loaded: list[tuple[Any, Any, Any]]) -> dict[str, Any]:
    """The pod's models as vLLM reports LoRA adapters (``vllm:lora_requests_info``), which is what the endpoint
    picker's LoRA-affinity scorer reads: running, the loaded engines and the adapters running in them; waiting, the
    engines requests wait to see loaded and the adapters waiting in loaded engines; ``max_lora``, how many engines
    the pod holds at once (``--max-loaded-engines``, else every listed engine: the budget decides). So the picker
    sends a model's requests to a pod that has it loaded, else to one with room, as it does for adapters."""
    running = [slot.name for slot, _, _ in loaded]
    waiting = [s.name for s in pool.slots.values() if s.num_waiting and s.status != LOADED]
    for _, _, lora in loaded:
        running += (lora or {}).get("running", [])
        waiting += (lora or {}).get("waiting", [])
    limit = pool.settings.max_loaded_engines or len(pool.slots)
    return {"running": list(dict.fromkeys(running)), "waiting": list(dict.fromkeys(waiting)), "max_lora": limit}


WAITING = "kiln:num_requests_waiting"


def _merge(families: dict[str, Metric], family: Metric) -> None:
    """``family``'s samples into the family of its name in ``families``: a sample whose name and labels are there
    already adds its value to it (an ``_info`` family's is dropped)."""
    into = families.setdefault(family.name, family)
    if into is family:
        return
    index = {(x.name, tuple(sorted(x.labels.items()))): i for i, x in enumerate(into.samples)}
    for sample in family.samples:
        at = index.get((sample.name, tuple(sorted(sample.labels.items()))))
        if at is None:
            index[(sample.name, tuple(sorted(sample.labels.items())))] = len(into.samples)
            into.samples.append(sample)
        elif not family.name.endswith("_info"):
            into.samples[at] = into.samples[at]._replace(value=into.samples[at].value + sample.value)
