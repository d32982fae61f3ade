"""The scenario harness: kopf for real (KopfRunner) against the strict emulator, store on moto S3.

Tests play the cluster's other actors: the builder (publish an artifact with
ArtifactStore.publish, as `kiln build` would, then mark the Job complete or
failed), the Deployment controller (mark replicas updated and available) and the
LeaderWorkerSet controller (groups updated and ready, or a group recreated after a
pod failure, as kubernetes-sigs/lws v0.10 reports it).
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from conftest import OPERATOR_NS, WAIT_S, Kube, wait_for
from kopf.testing import KopfRunner

from kiln.api import LLMEngineSpec
from kiln.artifact_manifest import BUILT_BY_ENV, BuiltBy
from kiln.artifacts import ArtifactStore
from kiln.envelope import build_envelope
from kiln.signing import Signer

NS = "ml"
ENGINES = f"/apis/serving.kiln.dev/v1alpha1/namespaces/{NS}/llmengines"
POOLS = f"/apis/serving.kiln.dev/v1alpha1/namespaces/{NS}/llmenginepools"
CONFIGMAPS = f"/api/v1/namespaces/{NS}/configmaps"
JOBS = f"/apis/batch/v1/namespaces/{OPERATOR_NS}/jobs"  # build Jobs run where the private key is (operator.keys)
BUILD_PODS = f"/api/v1/namespaces/{OPERATOR_NS}/pods"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
LWSS = f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{NS}/leaderworkersets"
SERVICES = f"/api/v1/namespaces/{NS}/services"
PDBS = f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets"
PODS = f"/api/v1/namespaces/{NS}/pods"
EVENTS = f"/api/v1/namespaces/{NS}/events"
VERSION_LABEL = "serving.kiln.dev/engine-version"  # a label (bounded) and an annotation (the full version)

SPEC = {"model": {"source": "s3://models/llama-tiny", "revision": "v1"}, "gpu": "cpu", "dtype": "float32",
        "maxBatchSize": 8, "maxInputLen": 256, "maxSeqLen": 512, "maxNumTokens": 512,
        "serving": {"replicas": 2, "port": 8000}}


def manifest(name: str, **spec_overrides: Any) -> dict[str, Any]:
    spec = copy.deepcopy(SPEC)
    spec.update(spec_overrides)
    return {"apiVersion": "serving.kiln.dev/v1alpha1", "kind": "LLMEngine",
            "metadata": {"name": name, "namespace": NS}, "spec": spec}


def write_kubeconfig(path: Path, url: str) -> Path:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": url}}],
        "users": [{"name": "kmock", "user": {"token": "kmock-token"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": NS}}],
    }))
    return path


@contextlib.contextmanager
def running_operator() -> Iterator[KopfRunner]:
    """kopf in a thread; on exit, the run must have been clean. KILN_TEST_VERBOSE=1: kopf debug logs, printed
    in full when the block fails."""
    args = ["run", *(["--verbose"] if os.environ.get("KILN_TEST_VERBOSE") else []), "--standalone", "--namespace", NS, "-m", "kiln.operator.handlers"]
    error: BaseException | None = None
    with KopfRunner(args, timeout=30) as runner:
        try:
            yield runner
        except BaseException as exc:  # noqa: BLE001  (re-raised below, after the operator stopped)
            error = exc
    if error is not None:  # the operator's log explains most scenario failures
        lines = [ln for ln in runner.output.splitlines() if "HTTP Request" not in ln and "aiohttp.access" not in ln]
        print("\n".join(lines if os.environ.get("KILN_TEST_VERBOSE") else lines[-200:]))
        raise error
    assert runner.exception is None, runner.output
    assert runner.exit_code == 0, runner.output
    assert "Traceback" not in runner.output, runner.output


class Cluster:
    """What a test does to and reads from the emulated cluster."""

    def __init__(self, kube: Kube, store_uri: str, tmp: Path) -> None:
        self.kube, self.store, self.tmp = kube, ArtifactStore.from_uri(store_uri), tmp

    def engine(self, name: str) -> dict[str, Any]:
        return self.kube.get(f"{ENGINES}/{name}") or {}

    def status(self, name: str) -> dict[str, Any]:
        return self.engine(name).get("status") or {}

    def condition(self, name: str, type_: str) -> dict[str, Any]:
        return next((c for c in self.status(name).get("conditions") or [] if c["type"] == type_), {})

    def jobs(self) -> list[dict[str, Any]]:
        return self.kube.list(JOBS)

    def wait_status(self, name: str, what: str, timeout: float = WAIT_S, **fields: Any) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            status = self.status(name)
            return status if all(status.get(k) == v for k, v in fields.items()) else None
        try:
            return wait_for(check, timeout, what)
        except AssertionError:
            raise AssertionError(f"{what}: status is {json.dumps(self.status(name), indent=1)}") from None

    def wait_job(self, version: str | None = None) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            jobs = [j for j in self.jobs() if version is None or j["metadata"]["annotations"][VERSION_LABEL] == version]
            return jobs[0] if jobs else None
        return wait_for(check, what=f"a build Job for {version or 'any version'}")

    def signer(self) -> Signer | None:
        """The operator's signing key, as its build Jobs get it (None before the operator made its pair)."""
        pair = self.kube.get(f"/api/v1/namespaces/{OPERATOR_NS}/secrets/kiln-signing-key")
        if pair is None:
            return None
        key = self.tmp / "operator-signing-key.pem"
        key.write_bytes(base64.b64decode(pair["data"]["signing-key.pem"]))
        return Signer.from_pem(key)

    def publish(self, version: str, spec: dict[str, Any], built_by: BuiltBy | None, memory: int | None = None) -> None:
        """Publish as a build Job does: signed by the operator's key. ``memory``: the bytes its build measured
        (engine.json's build_report, what an engine pool counts)."""
        src = self.tmp / f"artifact-{version}"
        (src / "weights").mkdir(parents=True, exist_ok=True)
        engine_json: dict[str, Any] = {"format_version": 1, "engine_version": version}
        if memory is not None:
            engine_json |= {"tuning": {"device": "cpu"},
                            "build_report": {"memory": {"stages": {"tune": {"host_extra_bytes": memory}}}}}
        (src / "engine.json").write_text(json.dumps(engine_json))
        (src / "weights" / "rank-0-of-1.safetensors").write_bytes(version.encode() * 64)
        self.store.publish(version, src, build_envelope(LLMEngineSpec.model_validate(spec)), built_by=built_by,
                           signer=self.signer())

    def build(self, job: dict[str, Any], spec: dict[str, Any], memory: int | None = None) -> str:
        """Be the builder: publish the artifact of the Job's version, recording who built it as the Job's build
        container says (``$KILN_BUILT_BY``, as `kiln build` does), then mark the Job complete."""
        version = job["metadata"]["annotations"][VERSION_LABEL]
        build = next(c for c in job["spec"]["template"]["spec"]["containers"] if c["name"] == "build")
        env = {e["name"]: e.get("value") for e in build["env"]}
        self.publish(version, spec, BuiltBy.model_validate_json(env[BUILT_BY_ENV]), memory)
        self.kube.patch(f"{JOBS}/{job['metadata']['name']}/status", {"status": {
            "startTime": "2026-01-01T00:00:00Z", "completionTime": "2026-01-01T00:05:00Z", "succeeded": 1,
            "conditions": [{"type": "Complete", "status": "True", "reason": "CompletionsReached"}]}})
        return version

    def fail(self, job: dict[str, Any], message: str, exit_code: int = 5) -> None:
        """Be the builder that failed: a terminated pod with a message and the builder's exit code
        (kiln.builder.errors: 3 a storage error, 5 a fetch error, ...), then the Job's Failed condition."""
        name = job["metadata"]["name"]
        pod = f"{name}-{job['metadata']['uid'][:5]}"
        owner = {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": job["metadata"]["uid"]}
        self.kube.create(BUILD_PODS, {"metadata": {"name": pod, "labels": {"batch.kubernetes.io/job-name": name},
                                             "ownerReferences": [owner]},  # gone with its Job
                                "spec": {"containers": [{"name": "build", "image": "kiln"}]}})
        self.kube.patch(f"{BUILD_PODS}/{pod}/status", {"status": {"phase": "Failed", "containerStatuses": [
            {"name": "build", "state": {"terminated": {"exitCode": exit_code, "finishedAt": "2026-01-01T00:01:00Z",
                                                       "message": message}}}]}})
        self.kube.patch(f"{JOBS}/{name}/status", {"status": {"failed": 2, "conditions": [
            {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
             "message": "Job has reached the specified backoff limit"}]}})

    def deployment(self, name: str) -> dict[str, Any] | None:
        return self.kube.get(f"{DEPLOYMENTS}/{name}")

    def template_version(self, name: str) -> str | None:
        dep = self.deployment(name)
        return dep["spec"]["template"]["metadata"]["annotations"][VERSION_LABEL] if dep else None

    def roll_out(self, name: str) -> None:
        """Be the Deployment controller: every replica of the current template is updated and available."""
        dep = self.deployment(name)
        assert dep is not None
        n = dep["spec"]["replicas"]
        self.kube.patch(f"{DEPLOYMENTS}/{name}/status", {"status": {
            "observedGeneration": dep["metadata"]["generation"], "replicas": n, "updatedReplicas": n,
            "readyReplicas": n, "availableReplicas": n}})

    def event_reasons(self, name: str) -> list[str]:
        return [e.get("reason") for e in self.kube.list(EVENTS)
                if (e.get("involvedObject") or {}).get("name") == name]

    def lws(self, name: str) -> dict[str, Any] | None:
        """The LeaderWorkerSet of engine ``name``."""
        from kiln.operator.naming import lws_name

        return self.kube.get(f"{LWSS}/{lws_name(name)}")

    def lws_version(self, name: str) -> str | None:
        obj = self.lws(name)
        if obj is None:
            return None
        return obj["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["annotations"][VERSION_LABEL]

    def lws_status(self, name: str, ready: int | None = None, **extra: Any) -> None:
        """Be the LWS controller: every group of the current template is updated; ``ready`` of them are ready
        (default: all) with the conditions kubernetes-sigs/lws sets."""
        obj = self.lws(name)
        assert obj is not None
        n = obj["spec"]["replicas"]
        ready = n if ready is None else ready
        available = ready == n
        self.kube.patch(f"{LWSS}/{obj['metadata']['name']}/status", {"status": {
            "observedGeneration": obj["metadata"]["generation"], "replicas": n, "updatedReplicas": n,
            "readyReplicas": ready, "conditions": [
                {"type": "Available", "status": "True" if available else "False",
                 "reason": "AllGroupsReady" if available else "GroupsNotReady", "message": "",
                 "lastTransitionTime": "2026-01-01T00:00:00Z"},
                {"type": "Progressing", "status": "False" if available else "True",
                 "reason": "GroupsProgressing", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}],
            **extra}})
