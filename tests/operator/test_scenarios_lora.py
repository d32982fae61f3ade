"""LoRA adapters on a running engine: one adapter Job per new adapter (no base build), the <engine>-adapters
ConfigMap lists it once built, the pod template never changes; removing it unlists it; status.adapters phases."""

from __future__ import annotations

import copy
import json

import pytest
from conftest import wait_for
from harness import ENGINES, NS, SPEC, Cluster, manifest, running_operator

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
                              built_by=BuiltBy.model_validate_json(env[BUILT_BY_ENV]))
        cluster.kube.patch(f"/apis/batch/v1/namespaces/{NS}/jobs/{job['metadata']['name']}/status", {"status": {
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
