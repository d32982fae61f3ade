"""Fixtures of the operator suite: the strict KMock emulator on a real port, and a small sync client.

The emulator runs in its own thread with its own event loop, so kopf (which
KopfRunner runs in another thread) and the synchronous tests both reach it over
HTTP exactly as they would reach an API server.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import kmock
import pytest
from kmock_ext import StrictKubernetesEmulator

# kopf reads these when kiln.operator.handlers is imported (the timer interval is fixed at decoration):
# fast reconciles and short watches keep the KopfRunner scenarios quick.
os.environ.setdefault("KILN_RECONCILE_INTERVAL", "0.3")
os.environ.setdefault("KILN_WATCH_TIMEOUT", "10")

RESOURCES = {
    "serving.kiln.dev/v1alpha1/llmengines": ("LLMEngine", True, {"status"}, {"llme"}),
    "serving.kiln.dev/v1alpha1/llmenginepools": ("LLMEnginePool", True, {"status"}, {"llmep"}),  # engine pools
    "batch/v1/jobs": ("Job", True, {"status"}, set()),
    "apps/v1/deployments": ("Deployment", True, {"status", "scale"}, {"deploy"}),
    # A CRD in a real cluster (kubernetes-sigs/lws); @pytest.mark.without_resources(...) leaves it out.
    "leaderworkerset.x-k8s.io/v1/leaderworkersets": ("LeaderWorkerSet", True, {"status", "scale"}, {"lws"}),
    "policy/v1/poddisruptionbudgets": ("PodDisruptionBudget", True, {"status"}, {"pdb"}),
    "v1/services": ("Service", True, {"status"}, {"svc"}),
    "v1/pods": ("Pod", True, {"status"}, {"po"}),
    "v1/events": ("Event", True, set(), {"ev"}),
    "v1/secrets": ("Secret", True, set(), set()),
    "v1/configmaps": ("ConfigMap", True, set(), {"cm"}),
    "networking.k8s.io/v1/networkpolicies": ("NetworkPolicy", True, set(), {"netpol"}),
    "v1/namespaces": ("Namespace", False, {"status"}, {"ns"}),
    # scale out: the CRDs of KEDA, its HTTP add-on and the Inference Extension, and the HPA (a test can remove
    # one from the emulator to play a cluster without it: kmock_ext answers 404 for undeclared resources)
    "keda.sh/v1alpha1/scaledobjects": ("ScaledObject", True, {"status"}, {"so"}),
    "http.keda.sh/v1alpha1/httpscaledobjects": ("HTTPScaledObject", True, {"status"}, {"httpso"}),
    "autoscaling/v2/horizontalpodautoscalers": ("HorizontalPodAutoscaler", True, {"status"}, {"hpa"}),
    "inference.networking.k8s.io/v1/inferencepools": ("InferencePool", True, {"status"}, set()),
}
VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}
OPERATOR_NS = "kiln-system"  # where the scenario operator "runs": its key pair Secret lives there


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "without_resources(*names): the emulated cluster does not serve these "
                                       "RESOURCES keys (e.g. a CRD that is not installed)")


def declare(handler: StrictKubernetesEmulator, name: str) -> None:
    """Serve RESOURCES[name] (at start, or later: installing a CRD on a running cluster)."""
    kind, namespaced, subresources, short = RESOURCES[name]
    handler.resources[name] = kmock.ResourceInfo(
        kind=kind, namespaced=namespaced, subresources=subresources, shortnames=short, verbs=VERBS)


class EmulatorThread:
    def __init__(self, without: frozenset[str] = frozenset()) -> None:
        self.without = without
        self.url = ""
        self.handler: StrictKubernetesEmulator | None = None
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with StrictKubernetesEmulator() as handler, kmock.Server(handler) as server:
            for name in RESOURCES:
                if name not in self.without:
                    declare(handler, name)
            self.handler, self.url = handler, str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> EmulatorThread:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the KMock emulator did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


class Kube:
    """Paths like ``/apis/batch/v1/namespaces/ns/jobs``; raises on HTTP errors unless ``ok`` lists the code."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=10)

    def call(self, method: str, path: str, body: Any = None, ok: tuple[int, ...] = (),
             content_type: str = "application/merge-patch+json", **params: str) -> httpx.Response:
        headers = {"Content-Type": content_type} if body is not None else {}
        resp = self.http.request(method, path, json=body, params=params or None, headers=headers)
        if resp.status_code >= 400 and resp.status_code not in ok:
            raise AssertionError(f"{method} {path}: {resp.status_code} {resp.text[:300]}")
        return resp

    def get(self, path: str) -> dict[str, Any] | None:
        resp = self.call("GET", path, ok=(404,))
        return None if resp.status_code == 404 else resp.json()

    def list(self, path: str, **params: str) -> list[dict[str, Any]]:
        return self.call("GET", path, **params).json()["items"]

    def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.call("POST", path, body, content_type="application/json").json()

    def patch(self, path: str, body: Any) -> dict[str, Any]:
        return self.call("PATCH", path, body).json()

    def delete(self, path: str) -> httpx.Response:
        return self.call("DELETE", path, ok=(404,))


# How long a scenario waits for the operator to reach a state. A passing test returns as soon as the state holds,
# so this only bounds a failing one; it is generous because CI runs the suite beside the real-cluster suite and
# two lowest-priority busy loops on two cores, where 20 s was seen to run out for a state the operator did reach.
WAIT_S = 60.0


def wait_for(check: Callable[[], Any], timeout: float = WAIT_S, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def emulator(request: pytest.FixtureRequest) -> Iterator[EmulatorThread]:
    marker = request.node.get_closest_marker("without_resources")
    with EmulatorThread(frozenset(marker.args) if marker else frozenset()) as emu:
        yield emu


@pytest.fixture
def kube(emulator: EmulatorThread) -> Iterator[Kube]:
    client = Kube(emulator.url)
    yield client
    client.http.close()


@pytest.fixture
def cluster(emulator: EmulatorThread, kube: Kube, s3_bucket: str, tmp_path, monkeypatch: pytest.MonkeyPatch):
    """The scenario suites' cluster: kopf's kubeconfig and the store pointing at the emulator and moto."""
    from harness import Cluster, write_kubeconfig  # harness imports this module: import it when used

    store_uri = f"s3://{s3_bucket}/kiln"
    kubeconfig = str(write_kubeconfig(tmp_path / "kubeconfig", emulator.url))
    monkeypatch.setenv("KUBECONFIG", kubeconfig)
    # The client library reads KUBECONFIG once, at import; an operator process starts with it set.
    monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", kubeconfig)
    monkeypatch.setenv("KILN_STORE_URI", store_uri)
    monkeypatch.setenv("KILN_STORE_SECRET", "kiln-store")
    monkeypatch.setenv("KILN_SERVING_STORE_SECRET", "kiln-store-ro")
    monkeypatch.setenv("KILN_OPERATOR_NAMESPACE", OPERATOR_NS)
    monkeypatch.setenv("KILN_BUILD_RETRY_DELAY_SECONDS", "0.5")
    return Cluster(kube, store_uri, tmp_path)
