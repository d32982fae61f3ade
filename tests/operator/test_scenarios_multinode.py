"""Multi-node engines end to end: kopf for real against the emulated API, the test playing the builder and the
LeaderWorkerSet controller. The engines are `gpu: cpu` with gpusPerNode 2, so tensorParallel 2 x pipelineParallel 2
is a group of 2 pods (the same code path as 405B on 2 x 8 x H100; the renderers are checked for that in
test_render_lws.py)."""

from __future__ import annotations

import base64
import copy
import time

import pytest
from conftest import declare, wait_for
from harness import (
    DEPLOYMENTS,
    ENGINES,
    PDBS,
    SERVICES,
    SPEC,
    VERSION_LABEL,
    Cluster,
    manifest,
    running_operator,
)
from kiln.operator.keys import rank_group_label
from kiln.operator.naming import lws_name

LWS_RESOURCE = "leaderworkerset.x-k8s.io/v1/leaderworkersets"
MULTI = {**copy.deepcopy(SPEC), "tensorParallel": 2, "pipelineParallel": 2, "gpusPerNode": 2}

pytestmark = pytest.mark.timeout(120)


def ready_lws(c: Cluster, name: str, spec: dict) -> str:
    job = c.wait_job()
    version = c.build(job, spec)
    wait_for(lambda: c.lws_version(name) == version, what="the LeaderWorkerSet of the new version")
    c.lws_status(name)
    c.wait_status(name, "Ready", phase="Ready", servingVersion=version)
    return version


def test_multi_node_engine_builds_once_then_serves_from_a_leader_worker_set(cluster: Cluster):
    c = cluster
    with running_operator():
        c.kube.create(ENGINES, manifest("big", **MULTI))
        job = c.wait_job()
        version = job["metadata"]["annotations"][VERSION_LABEL]
        c.wait_status("big", "Building", phase="Building", engineVersion=version)
        time.sleep(1)
        assert len(c.jobs()) == 1 and c.lws("big") is None and c.deployment("big") is None
        c.build(job, MULTI)
        wait_for(lambda: c.lws("big"), what="the LeaderWorkerSet")
        lws = c.lws("big")
        assert lws["metadata"]["name"] == lws_name("big")
        lwt = lws["spec"]["leaderWorkerTemplate"]
        assert (lwt["size"], lwt["restartPolicy"], lws["spec"]["replicas"]) == (2, "RecreateGroupOnPodRestart", 2)
        assert lws["metadata"]["ownerReferences"][0]["name"] == "big"
        # The group is not Ready until its leader's /ready says every rank is up: the operator waits for it.
        c.lws_status("big", ready=1)
        status = c.wait_status("big", "Deploying", phase="Deploying")
        time.sleep(0.8)
        assert c.status("big")["phase"] == "Deploying" and status.get("servingVersion") is None
        c.lws_status("big")
        status = c.wait_status("big", "Ready", phase="Ready", servingVersion=version)
        assert status["endpoint"] == "http://big.ml.svc:8000/v1"
        assert c.condition("big", "Ready")["status"] == "True"
        svc = c.kube.get(f"{SERVICES}/big")
        assert svc["spec"]["selector"].items() <= lwt["leaderTemplate"]["metadata"]["labels"].items()
        assert not svc["spec"]["selector"].items() <= lwt["workerTemplate"]["metadata"]["labels"].items()
        pdb = c.kube.get(f"{PDBS}/big")
        assert pdb["spec"]["selector"]["matchLabels"].items() <= lwt["workerTemplate"]["metadata"]["labels"].items()
        assert c.deployment("big") is None  # a one-pod replica would have been one; this one never is
        # Ranks: one token for the group, made by the operator and owned by the engine; a NetworkPolicy that
        # admits the rank ports only from the engine's own pods (leader and workers).
        token = c.kube.get("/api/v1/namespaces/ml/secrets/big-group-token")
        assert token["metadata"]["ownerReferences"][0]["name"] == "big" and len(token["data"]["token"]) >= 40
        for template in (lwt["leaderTemplate"], lwt["workerTemplate"]):
            (rank,) = template["spec"]["containers"]
            assert {"name": "KILN_GROUP_TOKEN", "valueFrom": {"secretKeyRef": {
                "name": "big-group-token", "key": "token"}}} in rank["env"]
        policy = c.kube.get("/apis/networking.k8s.io/v1/namespaces/ml/networkpolicies/big")
        selector = policy["spec"]["ingress"][1]["from"][0]["podSelector"]["matchLabels"]
        for template in (lwt["leaderTemplate"], lwt["workerTemplate"]):
            assert selector.items() <= template["metadata"]["labels"].items()
        # ... by a label value only the token gives: the engine's own labels, which any pod can set, do not.
        value = base64.b64decode(token["data"]["token"]).decode()
        assert selector["serving.kiln.dev/rank-group"] == rank_group_label(value, "big")
        assert not selector.items() <= {"serving.kiln.dev/engine": "big"}.items()


def test_gitops_bump_keeps_the_old_group_serving_then_revert_rolls_back_without_a_build(cluster: Cluster):
    c = cluster
    with running_operator():
        c.kube.create(ENGINES, manifest("big", **MULTI))
        old = ready_lws(c, "big", MULTI)
        c.kube.patch(f"{ENGINES}/big", {"spec": {"maxSeqLen": 1024}})
        job = wait_for(lambda: next((j for j in c.jobs() if j["metadata"]["annotations"][VERSION_LABEL] != old), None),
                       what="a Job for the new version")
        new = job["metadata"]["annotations"][VERSION_LABEL]
        status = c.wait_status("big", "Building the bump", phase="Building", engineVersion=new)
        assert status["servingVersion"] == old and c.lws_version("big") == old  # untouched while building
        generation = c.lws("big")["metadata"]["generation"]
        c.build(job, {**MULTI, "maxSeqLen": 1024})
        wait_for(lambda: c.lws_version("big") == new, what="the LWS rolling to the new version")
        assert c.lws("big")["metadata"]["generation"] == generation + 1
        # LWS has started the rolling update: the surge group is not ready yet, the old one serves.
        c.lws_status("big", ready=2, replicas=3, updatedReplicas=1)
        c.wait_status("big", "Deploying the bump", phase="Deploying")
        time.sleep(0.8)
        assert c.status("big")["servingVersion"] == old
        c.lws_status("big")
        status = c.wait_status("big", "Ready on the new version", phase="Ready", servingVersion=new)
        assert [h["engineVersion"] for h in status["history"]] == [new, old]

        c.kube.patch(f"{ENGINES}/big", {"spec": {"maxSeqLen": SPEC["maxSeqLen"]}})  # the GitOps revert
        wait_for(lambda: c.lws_version("big") == old, what="the rollback of the LWS")
        c.lws_status("big")
        c.wait_status("big", "Ready on the old version", phase="Ready", servingVersion=old, engineVersion=old)
        assert len(c.jobs()) == 2  # the original build and the bump's; nothing for the revert


def test_a_dead_worker_recreates_its_group_and_the_operator_leaves_it_to_lws(cluster: Cluster):
    c = cluster
    with running_operator():
        c.kube.create(ENGINES, manifest("big", **{**MULTI, "serving": {"replicas": 1, "port": 8000}}))
        version = ready_lws(c, "big", MULTI)
        before = c.lws("big")
        # A worker's process died: its container restarted, and RecreateGroupOnPodRestart recreated the group
        # (the LWS controller's work). Until the leader's /ready sees every rank again, no group is ready.
        c.lws_status("big", ready=0)
        time.sleep(1.2)  # several reconciles
        after = c.lws("big")
        assert after["metadata"]["generation"] == before["metadata"]["generation"]
        assert after["spec"] == before["spec"]  # nothing re-rendered, no rollout started by the operator
        assert len(c.jobs()) == 1  # nothing rebuilt
        status = c.status("big")
        assert status["servingVersion"] == version and status["engineVersion"] == version
        c.lws_status("big")  # the group is back
        c.wait_status("big", "Ready again", phase="Ready", servingVersion=version)


def test_a_shape_change_moves_between_deployment_and_lws_without_a_rebuild(cluster: Cluster):
    """gpusPerNode is not in the envelope: the same artifact, served by a Deployment (one pod of 4 ranks) or
    by an LWS (2 pods of 2). The old workload serves until the new one is rolled out, both ways."""
    c = cluster
    one_pod = {k: v for k, v in MULTI.items() if k != "gpusPerNode"}
    with running_operator():
        c.kube.create(ENGINES, manifest("big", **one_pod))
        version = c.build(c.wait_job(), one_pod)
        wait_for(lambda: c.template_version("big") == version, what="the Deployment")
        c.roll_out("big")
        c.wait_status("big", "Ready on a Deployment", phase="Ready", servingVersion=version)
        assert c.lws("big") is None

        c.kube.patch(f"{ENGINES}/big", {"spec": {"gpusPerNode": 2}})
        wait_for(lambda: c.lws_version("big") == version, what="the LWS")
        time.sleep(0.8)
        # The wanted version still serves (from the Deployment): Ready throughout, no flapping.
        status = c.status("big")
        assert (status["phase"], status["servingVersion"], status["observedGeneration"]) == ("Ready", version, 2)
        assert c.deployment("big")["spec"]["replicas"] == 2  # kept until the LWS is rolled out
        c.lws_status("big")
        c.wait_status("big", "Ready on the LWS", phase="Ready", servingVersion=version)
        wait_for(lambda: c.deployment("big")["spec"]["replicas"] == 0, what="the Deployment scaled to 0")

        c.kube.patch(f"{ENGINES}/big", {"spec": {"gpusPerNode": None}})  # the revert
        wait_for(lambda: c.deployment("big")["spec"]["replicas"] == 2, what="the Deployment scaled back up")
        time.sleep(0.8)
        assert c.lws("big") is not None  # still serving until the Deployment is rolled out
        c.roll_out("big")
        wait_for(lambda: c.lws("big") is None, what="the LWS deleted")
        c.wait_status("big", "Ready on the Deployment again", phase="Ready", servingVersion=version)
        assert len(c.jobs()) == 1 and c.kube.list(DEPLOYMENTS)


@pytest.mark.without_resources(LWS_RESOURCE)
def test_without_the_lws_crd_a_multi_node_engine_fails_naming_the_prerequisite_and_heals_once_installed(
        cluster: Cluster, emulator):
    c = cluster
    with running_operator() as runner:
        c.kube.create(ENGINES, manifest("big", **MULTI))
        c.kube.create(ENGINES, manifest("small"))  # one pod per replica: needs no LWS, works as ever
        c.wait_status("big", "Failed", phase="Failed")
        built = c.condition("big", "Built")
        assert built["reason"] == "LeaderWorkerSetMissing"
        for words in ("spec.pipelineParallel", "LeaderWorkerSet CRD is not installed", "leaderworkerset.x-k8s.io/v1",
                      "docs/multi-node-cluster.md", "spans 2 pods"):
            assert words in built["message"]
        wait_for(lambda: "LeaderWorkerSetMissing" in c.event_reasons("big"), what="a Warning event")
        small = c.wait_job()
        time.sleep(1)
        assert [j["metadata"]["name"] for j in c.jobs()] == [small["metadata"]["name"]]  # nothing built for big
        c.build(small, SPEC)
        wait_for(lambda: c.template_version("small"), what="small's Deployment")
        c.roll_out("small")
        c.wait_status("small", "small Ready", phase="Ready")

        declare(emulator.handler, LWS_RESOURCE)  # the admin installs LeaderWorkerSet
        job = wait_for(lambda: next((j for j in c.jobs() if j["metadata"]["name"] != small["metadata"]["name"]),
                                    None), what="big's build once LWS is there")
        c.wait_status("big", "Building", phase="Building")
        version = c.build(job, MULTI)
        wait_for(lambda: c.lws_version("big") == version, what="the LWS")
        c.lws_status("big")
        c.wait_status("big", "Ready", phase="Ready", servingVersion=version)
    assert runner.output.count("LeaderWorkerSet CRD is not installed") == 1  # logged once, not every tick
