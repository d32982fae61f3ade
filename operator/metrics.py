"""Prometheus metrics of the operator, on their own registry and port (``--metrics-port``).

Build outcomes are counted per LLMEngine transition (Building -> Built/BuildFailed),
so two engines sharing one build Job count it twice; ``builds_started`` counts Jobs
actually created (one per version, whoever created it).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

REGISTRY = CollectorRegistry(auto_describe=True)

BUILDS_STARTED = Counter("kiln_builds_started", "Build Jobs created.", registry=REGISTRY)
BUILDS_SUCCEEDED = Counter("kiln_builds_succeeded", "Builds that published their artifact.", registry=REGISTRY)
BUILDS_FAILED = Counter("kiln_builds_failed", "Builds whose Job failed.", ["reason"], registry=REGISTRY)
CACHE_HITS = Counter("kiln_artifact_cache_hits", "New engine versions found already built in the store.",
                     registry=REGISTRY)
CACHE_MISSES = Counter("kiln_artifact_cache_misses", "New engine versions that needed a build.",
                       registry=REGISTRY)
BUILD_DURATION = Histogram("kiln_build_duration_seconds", "Build Job run time, start to completion.",
                           buckets=(60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400), registry=REGISTRY)
RECONCILE_ERRORS = Counter("kiln_reconcile_errors", "Reconciles that ended in an error (retried).",
                           ["kind"], registry=REGISTRY)


def serve(port: int, addr: str = "0.0.0.0") -> None:
    start_http_server(port, addr=addr, registry=REGISTRY)
