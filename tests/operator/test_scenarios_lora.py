"""LoRA adapters on a running engine: one adapter Job per new adapter (no base build), the <engine>-adapters
ConfigMap lists it once built, the pod template never changes; removing it unlists it; status.adapters phases."""

from __future__ import annotations

import copy
import json
import time

import pytest
from conftest import wait_for
from harness import ENGINES, JOBS, NS, SPEC, Cluster, manifest, running_operator

from kiln.api import LLMEngineSpec
from kiln.artifact_manifest import BUILT_BY_ENV, BuiltBy
from kiln.envelope import adapter_envelope, adapter_version, engine_version

pytestmark = pytest.mark.timeout(120)
CONFIGMAPS = f"/api/v1/namespaces/{NS}/configmaps"
LORA = {"maxLoras": 2, "adapters": []}
SQL = {"name": "sql", "source": "s3://adapters/sql", "revision": "v1"}


def adapter_jobs(c: Cluster) -> list[dict]:
    return [j for j in c.jobs() if j["metadata"]["labels"].get("app.kubernetes.io/component") == "adapter-build"]


def listed(c: Cluster, name: str) -> list[str]:
    cm = c.kube.get(f"{CONFIGMAPS}/{name}-adapters") or {}
    return [a["name"] for a in json.loads((cm.get("data") or {}).get("adapters.json", "{}")).get("adapters", [])]


def test_adding_and_removing_an_adapter_builds_only_it_and_never_rolls_pods(cluster: Cluster):
    spec = {**copy.deepcopy(SPEC), "lora": LORA}
    with running_operator():
        cluster.kube.create(ENGINES, manifest("chat", lora=LORA))
        version = cluster.build(cluster.wait_job(), spec)
        wait_for(lambda: cluster.template_version("chat") == version, what="the Deployment")
        cluster.roll_out("chat")
        cluster.wait_status("chat", "Ready", phase="Ready", servingVersion=version)
        template = cluster.deployment("chat")["spec"]["template"]
        base_jobs = len(cluster.jobs())

        cluster.kube.patch(f"{ENGINES}/chat", {"spec": {"lora": {**LORA, "adapters": [SQL]}}})
        job = wait_for(lambda: (adapter_jobs(cluster) or [None])[0], what="the adapter Job")
        assert len(cluster.jobs()) == base_jobs + 1  # only the adapter's Job: no base build
        wait_for(lambda: [a["phase"] for a in cluster.status("chat").get("adapters") or []] == ["Building"],
                 what="status.adapters Building")
        parsed = LLMEngineSpec.model_validate({**spec, "lora": {**LORA, "adapters": [SQL]}})
        assert engine_version(parsed) == version
        adapter = parsed.lora.adapters[0]
        a_version = adapter_version(version, adapter)
        assert job["metadata"]["annotations"]["serving.kiln.dev/adapter-version"] == a_version
        build = job["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in build["env"]}
        src = cluster.tmp / "adapter"
        src.mkdir()
        (src / "adapter_model.safetensors").write_bytes(b"x" * 64)
        cluster.store.publish(a_version, src, adapter_envelope(version, adapter),
                              built_by=BuiltBy.model_validate_json(env[BUILT_BY_ENV]), signer=cluster.signer())
        cluster.kube.patch(f"{JOBS}/{job['metadata']['name']}/status", {"status": {
            "succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}})
        wait_for(lambda: listed(cluster, "chat") == ["sql"], what="the ConfigMap lists sql")
        wait_for(lambda: [a["phase"] for a in cluster.status("chat").get("adapters") or []] == ["Ready"],
                 what="status.adapters Ready")
        assert cluster.deployment("chat")["spec"]["template"] == template  # no rollout, no restart

        cluster.kube.patch(f"{ENGINES}/chat", {"spec": {"lora": {**LORA, "adapters": []}}})
        wait_for(lambda: listed(cluster, "chat") == [], what="the ConfigMap drops sql")
        assert cluster.deployment("chat")["spec"]["template"] == template
        assert cluster.status("chat")["servingVersion"] == version


def test_a_failed_adapter_build_is_reported_and_the_base_keeps_serving(cluster: Cluster):
    spec = {**copy.deepcopy(SPEC), "lora": LORA}
    with running_operator():
        cluster.kube.create(ENGINES, manifest("chat", lora={**LORA, "adapters": [SQL]}))
        version = cluster.build(cluster.wait_job(engine_version(LLMEngineSpec.model_validate(spec))), spec)
        wait_for(lambda: cluster.template_version("chat") == version, what="the Deployment")
        cluster.roll_out("chat")
        job = wait_for(lambda: (adapter_jobs(cluster) or [None])[0], what="the adapter Job")
        cluster.fail(job, "InvalidSpec: spec.lora.adapters[0].source: rank 64 > maxLoraRank 16", exit_code=2)
        wait_for(lambda: [a.get("phase") for a in cluster.status("chat").get("adapters") or []] == ["Failed"],
                 what="status.adapters Failed")
        assert "rank 64 > maxLoraRank 16" in cluster.status("chat")["adapters"][0]["message"]
        cluster.wait_status("chat", "Ready", phase="Ready", servingVersion=version)


def pinned(c: Cluster, name: str) -> dict[str, str]:
    cm = c.kube.get(f"{CONFIGMAPS}/{name}-adapters") or {}
    return {a["name"]: a["contentDigest"]
            for a in json.loads((cm.get("data") or {}).get("adapters.json", "{}")).get("adapters", [])}


def adapter_phase(c: Cluster) -> tuple[str | None, str]:
    (entry,) = c.status("chat").get("adapters") or [{}]
    return entry.get("phase"), entry.get("message", "")


def test_adapters_are_verified_and_their_digests_pinned_in_the_configmap(cluster: Cluster):
    """Issue 38, Med 4 and 5: an adapter's manifest is served only signed by the operator's key and with this
    spec's whole envelope; the digest first trusted is pinned in the ConfigMap (pods refuse another), and a
    signed rewrite of the store is refused, the pin kept."""
    spec = {**copy.deepcopy(SPEC), "lora": {**LORA, "adapters": [SQL]}}
    with running_operator():
        cluster.kube.create(ENGINES, manifest("chat", lora={**LORA, "adapters": [SQL]}))
        version = cluster.build(cluster.wait_job(engine_version(LLMEngineSpec.model_validate(spec))), spec)
        wait_for(lambda: cluster.template_version("chat") == version, what="the Deployment")
        cluster.roll_out("chat")
        job = wait_for(lambda: (adapter_jobs(cluster) or [None])[0], what="the adapter Job")
        adapter = LLMEngineSpec.model_validate(spec).lora.adapters[0]
        a_version = adapter_version(version, adapter)
        env = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
        built_by = BuiltBy.model_validate_json(env[BUILT_BY_ENV])
        src = cluster.tmp / "adapter"
        src.mkdir()

        def publish(content: bytes, signer, envelope=None) -> str:
            if cluster.store.read_manifest(a_version) is not None:
                cluster.store.delete(a_version)
            (src / "adapter_model.safetensors").write_bytes(content)
            return cluster.store.publish(a_version, src, envelope or adapter_envelope(version, adapter),
                                         built_by=built_by, signer=signer).content_digest

        publish(b"x" * 64, None)  # unsigned
        wait_for(lambda: "is not signed" in adapter_phase(cluster)[1], what="the unsigned adapter refused")
        assert adapter_phase(cluster)[0] == "Failed" and pinned(cluster, "chat") == {}
        other = {**adapter_envelope(version, adapter), "base_engine_version": "another-base"}
        publish(b"x" * 64, cluster.signer(), other)  # signed, another spec's envelope
        wait_for(lambda: "envelope's base_engine_version" in adapter_phase(cluster)[1], what="the envelope refused")
        assert pinned(cluster, "chat") == {}
        digest = publish(b"x" * 64, cluster.signer())
        wait_for(lambda: pinned(cluster, "chat") == {"sql": digest}, what="the ConfigMap pins the digest")
        assert adapter_phase(cluster)[0] == "Ready"
        publish(b"evil" * 16, cluster.signer())  # a signed rewrite (a leaked key): not re-pinned
        wait_for(lambda: "changed after this operator pinned" in adapter_phase(cluster)[1], what="the rewrite refused")
        time.sleep(1)  # several reconciles: the pin stays
        assert pinned(cluster, "chat") == {"sql": digest} and adapter_phase(cluster)[0] == "Failed"
