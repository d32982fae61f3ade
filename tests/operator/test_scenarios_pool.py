"""Engine pools through the operator: kopf for real against the emulated API, store on moto S3 (docs/pools.md).

The tests play the builder (a signed artifact whose engine.json records the memory its build measured) and the
Deployment controller; the operator reconciles the LLMEnginePool: its engine-list ConfigMap, Deployment, Service
and status, and each member's state."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from conftest import wait_for
from harness import (
    CONFIGMAPS,
    ENGINES,
    JOBS,
    NS,
    PDBS,
    POOLS,
    SERVICES,
    SPEC,
    VERSION_LABEL,
    Cluster,
    manifest,
    running_operator,
)

from kiln.api import LLMEngineSpec
from kiln.artifact_manifest import BUILT_BY_ENV, BuiltBy
from kiln.envelope import adapter_envelope, adapter_version

pytestmark = pytest.mark.timeout(120)

GiB = 2**30
PATIENCE = 60  # seconds: a shared CI host runs the emulator, moto and kopf on few cores


def until(check: Any, what: str) -> Any:
    return wait_for(check, PATIENCE, what)


def pool_manifest(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "serving.kiln.dev/v1alpha1", "kind": "LLMEnginePool",
            "metadata": {"name": name, "namespace": "ml"}, "spec": spec}


def member(name: str, pool: str = "shared", **spec: Any) -> dict[str, Any]:
    return manifest(name, serving={**copy.deepcopy(SPEC["serving"]), "pool": pool}, **spec)


def pool_status(c: Cluster, name: str) -> dict[str, Any]:
    return (c.kube.get(f"{POOLS}/{name}") or {}).get("status") or {}


def wait_pool(c: Cluster, name: str, what: str, **fields: Any) -> dict[str, Any]:
    try:
        return until(lambda: (s := pool_status(c, name)) and all(s.get(k) == v for k, v in fields.items()) and s,
                     what)
    except AssertionError:
        raise AssertionError(f"{what}: pool status is {json.dumps(pool_status(c, name), indent=1)}") from None


def listed(c: Cluster, pool: str) -> dict[str, dict[str, Any]]:
    """The engine list the pool's pods follow, by name."""
    cm = c.kube.get(f"{CONFIGMAPS}/{pool}-pool-engines") or {}
    doc = json.loads((cm.get("data") or {}).get("engines.json") or '{"engines": []}')
    return {e["name"]: e for e in doc["engines"]}


def pool_adapters(c: Cluster, pool: str) -> dict[str, dict[str, Any]]:
    """The adapter list beside it, by name."""
    cm = c.kube.get(f"{CONFIGMAPS}/{pool}-pool-engines") or {}
    doc = json.loads((cm.get("data") or {}).get("adapters.json") or '{"adapters": []}')
    return {a["name"]: a for a in doc["adapters"]}


def build_adapter(c: Cluster, base: str, spec: dict[str, Any]) -> tuple[str, str]:
    """Be the adapter's builder: publish the one adapter of ``spec`` on ``base`` and complete its Job; returns
    (adapter version, the content digest the store holds)."""
    adapter = LLMEngineSpec.model_validate(spec).lora.adapters[0]
    version = adapter_version(base, adapter)
    job = until(lambda: next((j for j in c.jobs() if j["metadata"]["annotations"].get(
        "serving.kiln.dev/adapter-version") == version), None), "the adapter's build Job")
    env = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    src = c.tmp / f"adapter-{version}"
    src.mkdir()
    (src / "adapter_model.safetensors").write_bytes(b"x" * 64)
    c.store.publish(version, src, adapter_envelope(base, adapter),
                    built_by=BuiltBy.model_validate_json(env[BUILT_BY_ENV]), signer=c.signer())
    c.kube.patch(f"{JOBS}/{job['metadata']['name']}/status", {"status": {
        "succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}})
    return version, c.store.read_signed_manifest(version)[0].content_digest


def adapter_message(c: Cluster, engine: str, adapter: str) -> str | None:
    """The message of ``adapter`` in the engine's status.adapters (None: none, or no such adapter yet)."""
    status = (c.kube.get(f"{ENGINES}/{engine}") or {}).get("status") or {}
    return next((a.get("message") for a in status.get("adapters") or [] if a["name"] == adapter), None)


def entry(c: Cluster, pool: str, engine: str) -> dict[str, Any]:
    return next((e for e in pool_status(c, pool).get("engines") or [] if e["name"] == engine), {})


def ready_condition(c: Cluster, pool: str) -> dict[str, Any]:
    return next((x for x in pool_status(c, pool).get("conditions") or [] if x["type"] == "Ready"), {})


def test_a_pool_serves_its_members_and_they_join_and_leave_without_rolling_its_pods(cluster: Cluster):
    c = cluster
    with running_operator():
        c.kube.create(POOLS, pool_manifest("shared", memoryBudget="2Gi"))
        until(lambda: c.deployment("shared-pool"), "the pool's Deployment")
        service = until(lambda: c.kube.get(f"{SERVICES}/shared-pool"), "the pool's Service (applied after it)")
        assert service["spec"]["selector"]["serving.kiln.dev/pool"] == "shared"
        assert listed(c, "shared") == {}
        status = wait_pool(c, "shared", "Pending", phase="Pending")
        assert status["endpoint"] == "http://shared-pool.ml.svc:8000/v1" and status["memoryBudgetBytes"] == 2 * GiB
        c.roll_out("shared-pool")
        wait_pool(c, "shared", "Ready", phase="Ready", readyReplicas=1)
        before = c.deployment("shared-pool")

        c.kube.create(ENGINES, member("chat"))
        until(lambda: entry(c, "shared", "chat").get("state") == "Building", "chat Building in the pool")
        version = c.build(c.wait_job(), SPEC, memory=GiB)
        until(lambda: "chat" in listed(c, "shared"), "chat in the pool's engine list")
        pinned = c.status("chat")["artifact"]["contentDigest"]
        assert listed(c, "shared")["chat"] == {"name": "chat", "artifactURI": c.store.artifact_uri(version),
                                               "contentDigest": pinned}
        until(lambda: entry(c, "shared", "chat").get("state") == "Listed", "chat Listed in the pool's status")
        listed_entry = entry(c, "shared", "chat")
        assert listed_entry.pop("listedSince").endswith("Z")  # the engine counts as served by the pool 90 s after
        assert listed_entry == {"name": "chat", "engineVersion": version, "state": "Listed", "memoryBytes": GiB}
        assert pool_status(c, "shared")["listedEngines"] == 1
        after = c.deployment("shared-pool")
        assert after["spec"]["template"] == before["spec"]["template"]  # no restart: the pods follow the list
        assert after["metadata"]["generation"] == before["metadata"]["generation"]

        c.kube.patch(f"{ENGINES}/chat", {"spec": {"serving": {"pool": None}}})  # leaves: unloaded from the pods
        until(lambda: "chat" not in listed(c, "shared"), "chat dropped from the engine list")
        until(lambda: not entry(c, "shared", "chat"), "chat gone from the pool's status")
        c.kube.patch(f"{ENGINES}/chat", {"spec": {"serving": {"pool": "shared"}}})
        until(lambda: "chat" in listed(c, "shared"), "chat back in the engine list")
        c.kube.delete(f"{ENGINES}/chat")
        until(lambda: "chat" not in listed(c, "shared"), "a deleted engine dropped from the engine list")
        assert c.deployment("shared-pool")["spec"]["template"] == before["spec"]["template"]


def test_a_pool_of_two_pods_or_more_has_a_disruption_budget_and_one_of_fewer_none_and_a_network_policy(
        cluster: Cluster):
    c = cluster
    with running_operator():
        c.kube.create(POOLS, pool_manifest("shared", memoryBudget="2Gi", replicas=2))
        pdb = until(lambda: c.kube.get(f"{PDBS}/shared-pool"), "the pool's PodDisruptionBudget")
        deployment = c.deployment("shared-pool")
        assert pdb["spec"] == {"maxUnavailable": 1, "selector": deployment["spec"]["selector"]}
        assert pdb["metadata"]["ownerReferences"][0]["kind"] == "LLMEnginePool"
        policy = c.kube.get(f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies/shared-pool")
        assert policy["spec"]["podSelector"] == deployment["spec"]["selector"]  # the serving port alone admitted
        assert [p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]] == [
            deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]]
        assert policy["metadata"]["ownerReferences"][0]["kind"] == "LLMEnginePool"
        c.kube.patch(f"{POOLS}/shared", {"spec": {"replicas": 1}})  # one pod: a budget would hang every drain
        until(lambda: c.kube.get(f"{PDBS}/shared-pool") is None, "the PodDisruptionBudget deleted at 1 pod")


def test_an_engine_too_big_is_refused_and_a_budget_too_small_for_all_fails_the_pool_naming_the_field(
        cluster: Cluster):
    c = cluster
    with running_operator():
        c.kube.create(POOLS, pool_manifest("shared", memoryBudget="1Gi"))
        c.kube.create(ENGINES, member("big"))
        c.build(c.wait_job(), SPEC, memory=3 * GiB)
        until(lambda: entry(c, "shared", "big").get("state") == "Refused", "big refused")
        message = entry(c, "shared", "big")["message"]
        assert "engine big counts 3.00 GiB" in message and "budget of 1.00 GiB (spec.memoryBudget (1Gi))" in message
        assert "raise the pool's spec.memoryBudget to at least 3.00 GiB" in message
        assert listed(c, "shared") == {}
        status = wait_pool(c, "shared", "Failed", phase="Failed")
        cond = ready_condition(c, "shared")
        assert cond["reason"] == "BudgetTooSmall" and cond["message"].startswith("spec.memoryBudget: ")
        assert "the smallest, big, counts 3.00 GiB" in cond["message"]
        assert status["engines"][0]["memoryBytes"] == 3 * GiB
        until(lambda: "BudgetTooSmall" in c.event_reasons("shared"), "a BudgetTooSmall event")

        c.kube.patch(f"{POOLS}/shared", {"spec": {"memoryBudget": "4Gi"}})  # the fix the message names
        until(lambda: "big" in listed(c, "shared"), "big listed once the budget holds it")
        wait_pool(c, "shared", "Pending after the fix", phase="Pending")


def test_an_invalid_pool_fails_naming_the_field_and_creates_nothing(cluster: Cluster):
    c = cluster
    with running_operator() as runner:
        c.kube.create(POOLS, pool_manifest("shared", engines=["chat.yaml"]))
        wait_pool(c, "shared", "Failed", phase="Failed")
        cond = ready_condition(c, "shared")
        assert cond["reason"] == "InvalidSpec" and cond["message"].startswith("spec.engines: ")
        assert c.deployment("shared-pool") is None and c.kube.get(f"{CONFIGMAPS}/shared-pool-engines") is None
    assert runner.output.count("failed permanently") == 1


def test_a_members_adapters_are_listed_beside_the_engine_list_and_leave_with_it_without_rolling_the_pods(
        cluster: Cluster):
    c = cluster
    lora = {"maxLoras": 2, "adapters": [{"name": "sql", "source": "s3://adapters/sql", "revision": "v1"}]}
    with running_operator():
        c.kube.create(POOLS, pool_manifest("shared", memoryBudget="2Gi"))
        before = until(lambda: c.deployment("shared-pool"), "the pool's Deployment")
        env = {e["name"]: e.get("value") for e in before["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["KILN_LORA_ADAPTERS_FILE"] == "/etc/kiln/pool/adapters.json"
        c.kube.create(ENGINES, member("chat", lora=lora))
        spec = {**copy.deepcopy(SPEC), "lora": lora}
        base = c.build(c.wait_job(), spec, memory=GiB)
        until(lambda: "chat" in listed(c, "shared"), "chat in the pool's engine list")
        assert pool_adapters(c, "shared") == {}  # built, but not its adapter yet
        version, digest = build_adapter(c, base, spec)
        until(lambda: "sql" in pool_adapters(c, "shared"), "sql in the pool's adapter list")
        assert pool_adapters(c, "shared")["sql"] == {
            "name": "sql", "artifactURI": c.store.artifact_uri(version), "version": version,
            "baseEngineVersion": base, "contentDigest": digest}
        assert c.deployment("shared-pool")["spec"]["template"] == before["spec"]["template"]

        c.kube.patch(f"{ENGINES}/chat", {"spec": {"lora": {**lora, "adapters": []}}})
        until(lambda: pool_adapters(c, "shared") == {}, "sql dropped from the pool's adapter list")
        c.kube.patch(f"{ENGINES}/chat", {"spec": {"lora": lora}})
        until(lambda: "sql" in pool_adapters(c, "shared"), "sql listed again (built already: no Job)")
        c.kube.patch(f"{ENGINES}/chat", {"spec": {"serving": {"pool": None}}})  # the member leaves: its adapters too
        until(lambda: pool_adapters(c, "shared") == {} and listed(c, "shared") == {}, "chat and sql dropped")
        assert c.deployment("shared-pool")["spec"]["template"] == before["spec"]["template"]


def test_an_adapter_named_as_an_engine_of_the_pool_is_left_out_and_said_on_the_members_own_status(cluster: Cluster):
    """An engine named sql joins: requests naming sql reach it, so chat's adapter sql is left out of the pool's
    adapter list, and said so on the pool's entry for chat and on chat's own status.adapters; back when sql leaves."""
    c = cluster
    lora = {"maxLoras": 2, "adapters": [{"name": "sql", "source": "s3://adapters/sql", "revision": "v1"}]}
    with running_operator():
        c.kube.create(POOLS, pool_manifest("shared", memoryBudget="2Gi"))
        c.kube.create(ENGINES, member("chat", lora=lora))
        spec = {**copy.deepcopy(SPEC), "lora": lora}
        base = c.build(c.wait_job(), spec, memory=GiB)
        build_adapter(c, base, spec)
        until(lambda: "sql" in pool_adapters(c, "shared"), "sql in the pool's adapter list")
        c.kube.create(ENGINES, member("sql"))
        sql = until(lambda: entry(c, "shared", "sql").get("engineVersion"), "the engine sql in the pool's status")
        if sql != base:  # a build of its own (else chat's base is its build too)
            job = until(lambda: next((j for j in c.jobs() if j["metadata"]["annotations"].get(VERSION_LABEL) == sql),
                                     None), "the engine sql's build Job")
            c.build(job, SPEC, memory=GiB)
        until(lambda: "sql" in listed(c, "shared") and "sql" not in pool_adapters(c, "shared"), "chat's sql left out")
        assert [a["name"] for a in entry(c, "shared", "chat")["adaptersLeftOut"]] == ["sql"]
        said = until(lambda: adapter_message(c, "chat", "sql"), "chat's status.adapters saying so")
        assert said.startswith("built, but the pool 'shared' does not serve it: ") and "rename the adapter" in said
        c.kube.delete(f"{ENGINES}/sql")
        until(lambda: "sql" in pool_adapters(c, "shared"), "chat's sql listed again once the engine sql left")
        until(lambda: adapter_message(c, "chat", "sql") is None, "the message gone from chat's status.adapters")


def test_a_rebuilt_member_keeps_its_listed_build_in_the_engine_list_until_the_new_one_is_pinned(cluster: Cluster):
    c = cluster
    with running_operator():
        c.kube.create(POOLS, pool_manifest("shared", memoryBudget="2Gi"))
        until(lambda: c.deployment("shared-pool"), "the pool's Deployment")
        c.roll_out("shared-pool")
        c.kube.create(ENGINES, member("chat"))
        old = c.build(c.wait_job(), SPEC, memory=GiB)
        until(lambda: entry(c, "shared", "chat").get("state") == "Listed", "chat Listed")
        was = until(lambda: listed(c, "shared").get("chat"), "chat in the engine list")

        c.kube.patch(f"{ENGINES}/chat", {"spec": {"maxSeqLen": 1024}})  # a GitOps bump: a new version to build
        job = until(lambda: next((j for j in c.jobs() if j["metadata"]["annotations"][VERSION_LABEL] != old), None),
                    "a Job for the new version")
        new = job["metadata"]["annotations"][VERSION_LABEL]
        until(lambda: entry(c, "shared", "chat").get("message") == f"building {new}; {old} serves",
              "the pool saying the old build serves while the new one builds")
        assert entry(c, "shared", "chat")["state"] == "Listed" and entry(c, "shared", "chat")["engineVersion"] == old
        assert listed(c, "shared")["chat"] == was  # its old build is still loaded: nothing stops serving it
        assert c.status("chat")["pool"]["state"] == "Listed"

        c.build(job, {**SPEC, "maxSeqLen": 1024}, memory=GiB)
        until(lambda: listed(c, "shared")["chat"]["artifactURI"] == c.store.artifact_uri(new), "the new build listed")
        until(lambda: entry(c, "shared", "chat").get("engineVersion") == new, "the entry on the new version")
        assert "message" not in entry(c, "shared", "chat")


def test_a_pool_and_an_engine_whose_names_clash_leave_each_other_s_objects_alone_and_fail_naming_the_owner(
        cluster: Cluster):
    c = cluster
    with running_operator():
        c.kube.create(ENGINES, manifest("shared-pool"))  # its Deployment and Service are shared-pool, as pool shared's
        c.build(c.wait_job(), SPEC)
        until(lambda: c.deployment("shared-pool"), "the engine's Deployment")
        before = c.deployment("shared-pool")
        c.kube.create(POOLS, pool_manifest("shared", memoryBudget="2Gi"))
        wait_pool(c, "shared", "Failed", phase="Failed")
        cond = ready_condition(c, "shared")
        assert cond["reason"] == "NameConflict" and "belongs to LLMEngine shared-pool" in cond["message"]
        assert "recreate this LLMEnginePool (or the other) under another name" in cond["message"]
        after = c.deployment("shared-pool")
        assert after["metadata"]["ownerReferences"] == before["metadata"]["ownerReferences"]
        assert after["spec"]["template"] == before["spec"]["template"]
        assert c.kube.get(f"{CONFIGMAPS}/shared-pool-engines") is None
        until(lambda: "NameConflict" in c.event_reasons("shared"), "a NameConflict event")

        c.kube.create(POOLS, pool_manifest("other", memoryBudget="2Gi"))  # the other way round: the pool came first
        until(lambda: c.deployment("other-pool"), "pool other's Deployment")
        c.kube.create(ENGINES, manifest("other-pool"))
        status = c.wait_status("other-pool", "the engine Failed", phase="Failed")
        ready = c.condition("other-pool", "Ready")
        assert ready["reason"] == "NameConflict" and "belongs to LLMEnginePool other" in ready["message"], status
        dep = c.deployment("other-pool")
        assert dep["metadata"]["ownerReferences"][0]["kind"] == "LLMEnginePool" and dep["spec"]["replicas"] == 1
