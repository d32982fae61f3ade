"""Scale out end to end: kopf for real against the emulator. The tests play KEDA (writing the Deployment's
replicas through the scale subresource, as the HPA that KEDA drives does), the scheduler (a Pending pod with
PodScheduled=False) and the cluster admin (installing or removing a CRD)."""

from __future__ import annotations

import copy
import time

import pytest
from conftest import wait_for
from harness import DEPLOYMENTS, ENGINES, PODS, SPEC, VERSION_LABEL, Cluster, manifest, running_operator
from harness import POOLS as ENGINE_POOLS
from kiln.operator.naming import version_label
from test_scenarios import ready

NS_APIS = "/apis/{}/namespaces/ml/{}"
SCALEDOBJECTS = NS_APIS.format("keda.sh/v1alpha1", "scaledobjects")
HTTPSCALEDOBJECTS = NS_APIS.format("http.keda.sh/v1alpha1", "httpscaledobjects")
POOLS = NS_APIS.format("inference.networking.k8s.io/v1", "inferencepools")
GiB = 2**30

pytestmark = pytest.mark.timeout(180)


def scale(c: Cluster, name: str, replicas: int) -> None:
    """Be KEDA's HPA: write spec.replicas through /scale, then be the Deployment controller."""
    c.kube.patch(f"{DEPLOYMENTS}/{name}/scale", {"spec": {"replicas": replicas}})
    wait_for(lambda: c.deployment(name)["spec"]["replicas"] == replicas, what=f"{replicas} replicas")
    c.roll_out(name)


def operator_replica_writes(emulator) -> list:
    """Every write to a Deployment, other than through /scale or /status, that sets spec.replicas."""
    found = []
    for request in list(emulator.handler):
        if request.resource is None or request.resource.plural != "deployments" or request.subresource:
            continue
        if request.method.value in ("PATCH", "PUT") and "replicas" in ((request.data or {}).get("spec") or {}):
            found.append(request.data)
    return found


def test_scale_from_zero_to_n_and_back_never_overwrites_the_autoscalers_replicas(cluster: Cluster, emulator):
    c = cluster
    spec = {**SPEC, "serving": {"port": 8000, "replicas": 5, "autoscaling": {
        "minReplicas": 0, "maxReplicas": 4, "targetWaitingRequests": 2}}}
    with running_operator():
        c.kube.create(ENGINES, manifest("chat", **spec))
        old = ready(c, "chat", spec)
        dep = c.deployment("chat")
        assert dep["spec"]["replicas"] == 1  # created with one pod (not spec.serving.replicas): it proves it serves
        assert dep["metadata"]["annotations"]["serving.kiln.dev/replicas-owner"] == "autoscaler"
        so, httpso = c.kube.get(f"{SCALEDOBJECTS}/chat"), c.kube.get(f"{HTTPSCALEDOBJECTS}/chat")
        assert so["spec"]["minReplicaCount"] == 0 and so["spec"]["maxReplicaCount"] == 4
        assert {t["type"] for t in so["spec"]["triggers"]} == {"prometheus", "external-push"}
        assert httpso["metadata"]["annotations"]["httpscaledobject.keda.sh/skip-scaledobject-creation"] == "true"
        status = c.wait_status("chat", "replicas in status", replicas={
            "desired": 1, "current": 1, "ready": 1, "updated": 1, "owner": "ScaledObject/chat"})

        scale(c, "chat", 0)  # idle past the cooldown: KEDA scales to zero
        status = c.wait_status("chat", "scaled to zero", phase="Ready", servingVersion=None)
        ready_cond = c.condition("chat", "Ready")
        assert ready_cond["reason"] == "ScaledToZero" and "ScaledObject/chat" in ready_cond["message"]
        assert status["replicas"]["desired"] == 0

        scale(c, "chat", 3)  # requests held by the interceptor: KEDA wakes the engine, the queue asks for 3
        status = c.wait_status("chat", "serving on 3", phase="Ready", servingVersion=old)
        c.wait_status("chat", "3 desired", replicas={"desired": 3, "current": 3, "ready": 3, "updated": 3,
                                                     "owner": "ScaledObject/chat"})
        assert "all 3 replica(s)" in c.condition("chat", "Ready")["message"]

        # A GitOps bump while scaled out: the operator rolls the new template but leaves replicas to KEDA.
        c.kube.patch(f"{ENGINES}/chat", {"spec": {"maxSeqLen": 1024}})
        job = wait_for(lambda: next((j for j in c.jobs() if j["metadata"]["annotations"][VERSION_LABEL] != old), None),
                       what="the bump's Job")
        new = c.build(job, {**spec, "maxSeqLen": 1024})
        wait_for(lambda: c.template_version("chat") == new, what="the new template")
        assert c.deployment("chat")["spec"]["replicas"] == 3
        c.roll_out("chat")
        c.wait_status("chat", "Ready on the bump", phase="Ready", servingVersion=new)
        scale(c, "chat", 0)
        c.wait_status("chat", "back to zero", phase="Ready", servingVersion=None)
        time.sleep(1)  # several reconciles at zero: still zero
        assert c.deployment("chat")["spec"]["replicas"] == 0
        assert operator_replica_writes(emulator) == []

        # Autoscaling off: the operator owns the count again and the KEDA objects go.
        c.kube.patch(f"{ENGINES}/chat", {"spec": {"serving": {"autoscaling": None, "replicas": 2}}})
        wait_for(lambda: c.deployment("chat")["spec"]["replicas"] == 2, what="the operator's 2 replicas")
        wait_for(lambda: c.kube.get(f"{SCALEDOBJECTS}/chat") is None
                 and c.kube.get(f"{HTTPSCALEDOBJECTS}/chat") is None, what="the KEDA objects deleted")
        c.roll_out("chat")
        c.wait_status("chat", "operator-owned", phase="Ready", servingVersion=new, replicas={
            "desired": 2, "current": 2, "ready": 2, "updated": 2, "owner": "operator"})


def unschedulable_pod(c: Cluster, name: str, version: str, message: str) -> str:
    """Be the ReplicaSet and the scheduler: a new-version pod that no node can take."""
    pod = f"{name}-{version[-5:]}-x1"
    labels = {"serving.kiln.dev/engine": name, "app.kubernetes.io/component": "serving",
              VERSION_LABEL: version_label(version)}
    c.kube.create(PODS, {"metadata": {"name": pod, "labels": labels},
                         "spec": {"containers": [{"name": "serve", "image": "kiln"}]}})
    c.kube.patch(f"{PODS}/{pod}/status", {"status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}]}})
    return pod


def test_a_rollout_without_a_spare_gpu_says_so_and_recreate_one_at_a_time_gets_through(cluster: Cluster):
    c = cluster
    spec = {**SPEC, "gpu": "L4", "tensorParallel": 2, "serving": {"port": 8000, "replicas": 1}}
    with running_operator():
        c.kube.create(ENGINES, manifest("chat", **spec))
        old = ready(c, "chat", spec)
        assert c.deployment("chat")["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
        c.kube.patch(f"{ENGINES}/chat", {"spec": {"maxSeqLen": 1024}})
        job = wait_for(lambda: next((j for j in c.jobs() if j["metadata"]["annotations"][VERSION_LABEL] != old), None),
                       what="the bump's Job")
        new = c.build(job, {**spec, "maxSeqLen": 1024})
        wait_for(lambda: c.template_version("chat") == new, what="the new template")
        said = "0/3 nodes are available: 1 Insufficient nvidia.com/gpu, 2 node(s) didn't match node selector."
        pod = unschedulable_pod(c, "chat", new, said)
        wait_for(lambda: c.condition("chat", "Ready").get("reason") == "InsufficientGPU", what="InsufficientGPU")
        status, cond = c.status("chat"), c.condition("chat", "Ready")
        assert status["phase"] == "Deploying" and status["servingVersion"] == old  # the old pod still serves
        assert "each needs 2 L4 GPU(s)" in cond["message"] and "nvidia.com/gpu: 2" in cond["message"]
        assert said in cond["message"] and "rolloutStrategy: RecreateOneAtATime" in cond["message"]
        wait_for(lambda: "InsufficientGPU" in c.event_reasons("chat"), what="a Warning event")

        # No spare GPU on this cluster: replace in place. The old pod goes first, its GPUs take the new one.
        c.kube.patch(f"{ENGINES}/chat", {"spec": {"serving": {"rolloutStrategy": "RecreateOneAtATime"}}})
        wait_for(lambda: c.deployment("chat")["spec"]["strategy"]["rollingUpdate"] == {
            "maxUnavailable": 1, "maxSurge": 0}, what="the one-at-a-time strategy")
        assert c.template_version("chat") == new  # a serving knob: no new version, no rebuild
        c.kube.patch(f"{PODS}/{pod}/status", {"status": {"phase": "Running", "conditions": [
            {"type": "PodScheduled", "status": "True"}]}})
        wait_for(lambda: c.condition("chat", "Ready").get("reason") == "RollingOut", what="back to RollingOut")
        c.roll_out("chat")
        c.wait_status("chat", "Ready on the new version", phase="Ready", servingVersion=new)
        assert len(c.jobs()) == 2


def test_routing_on_and_off_and_a_cluster_without_the_inference_pool_crd(cluster: Cluster, emulator):
    c = cluster
    spec = {**SPEC, "serving": {"port": 8000, "replicas": 1, "routing": {"inferencePool": True}}}
    with running_operator():
        c.kube.create(ENGINES, manifest("chat", **spec))
        version = ready(c, "chat", spec)
        pool = c.kube.get(f"{POOLS}/chat")
        assert pool["spec"]["selector"]["matchLabels"] == c.deployment("chat")["spec"]["selector"]["matchLabels"]
        assert pool["spec"]["targetPorts"] == [{"number": 8000}]
        assert pool["spec"]["endpointPickerRef"]["name"] == "chat-epp"
        assert pool["metadata"]["ownerReferences"][0]["name"] == "chat"

        c.kube.patch(f"{ENGINES}/chat", {"spec": {"serving": {"routing": {"inferencePool": False}}}})
        wait_for(lambda: c.kube.get(f"{POOLS}/chat") is None, what="the pool deleted")
        c.wait_status("chat", "still Ready", phase="Ready", servingVersion=version)

        # A cluster without the Inference Extension: Failed, naming the field and what to install.
        emulator.handler.uninstalled.add("inferencepools")
        template = copy.deepcopy(c.deployment("chat")["spec"]["template"])
        c.kube.patch(f"{ENGINES}/chat", {"spec": {"serving": {"routing": {"inferencePool": True}}}})
        c.wait_status("chat", "Failed on the missing CRD", phase="Failed")
        cond = c.condition("chat", "Ready")
        assert cond["reason"] == "PrerequisiteMissing"
        assert cond["message"].startswith("spec.serving.routing.inferencePool needs InferencePool")
        assert "install the Gateway API Inference Extension CRDs" in cond["message"]
        wait_for(lambda: "PrerequisiteMissing" in c.event_reasons("chat"), what="a Warning event")
        assert c.deployment("chat")["spec"]["template"] == template  # the serving pods are left alone

        emulator.handler.uninstalled.discard("inferencepools")  # the admin installs the CRDs
        c.wait_status("chat", "Ready with the pool", phase="Ready", servingVersion=version)
        assert c.kube.get(f"{POOLS}/chat") is not None


def pool_status(c: Cluster) -> dict:
    return (c.kube.get(f"{ENGINE_POOLS}/shared") or {}).get("status") or {}


def test_an_autoscaled_pool_scales_on_its_queue_and_the_operator_never_overwrites_its_replicas(
        cluster: Cluster, emulator):
    c = cluster
    scaling = {"minReplicas": 1, "maxReplicas": 3, "targetWaitingRequests": 2}
    with running_operator():
        c.kube.create(ENGINE_POOLS, {"apiVersion": "serving.kiln.dev/v1alpha1", "kind": "LLMEnginePool",
                                     "metadata": {"name": "shared", "namespace": "ml"},
                                     "spec": {"replicas": 2, "memoryBudget": "2Gi", "autoscaling": scaling}})
        so = wait_for(lambda: c.kube.get(f"{SCALEDOBJECTS}/shared-pool"), what="the pool's ScaledObject")
        assert so["spec"]["scaleTargetRef"]["name"] == "shared-pool" and so["spec"]["maxReplicaCount"] == 3
        assert so["metadata"]["ownerReferences"][0]["kind"] == "LLMEnginePool"
        dep = c.deployment("shared-pool")
        assert dep["spec"]["replicas"] == 1 and dep["metadata"]["annotations"]["serving.kiln.dev/replicas-owner"] \
            == "autoscaler"
        c.kube.create(ENGINES, manifest("chat", serving={**copy.deepcopy(SPEC["serving"]), "pool": "shared"}))
        c.build(c.wait_job(), SPEC, memory=GiB)
        wait_for(lambda: 'model_name=~"chat|shared"' in c.kube.get(f"{SCALEDOBJECTS}/shared-pool")["spec"][
            "triggers"][0]["metadata"]["query"], what="the listed member's queue in the pool's query")

        scale(c, "shared-pool", 3)  # be KEDA's HPA
        wait_for(lambda: pool_status(c).get("replicas") == 3 and pool_status(c).get("readyReplicas") == 3,
                 what="the pool's status follows the scaler")
        c.kube.patch(f"{ENGINE_POOLS}/shared", {"spec": {"memoryBudget": "3Gi"}})
        wait_for(lambda: pool_status(c).get("memoryBudgetBytes") == 3 * GiB, what="the spec edit reconciled")
        assert c.deployment("shared-pool")["spec"]["replicas"] == 3
        assert operator_replica_writes(emulator) == []  # replicas set on create only: the scaler owns it

        c.kube.patch(f"{ENGINE_POOLS}/shared", {"spec": {"autoscaling": None}})  # the count goes back to replicas
        wait_for(lambda: c.kube.get(f"{SCALEDOBJECTS}/shared-pool") is None, what="the ScaledObject deleted")
        wait_for(lambda: c.deployment("shared-pool")["spec"]["replicas"] == 2, what="spec.replicas again")

        emulator.handler.uninstalled.add("scaledobjects")  # a cluster without KEDA: Pending, naming the fix
        c.kube.patch(f"{ENGINE_POOLS}/shared", {"spec": {"autoscaling": scaling}})
        wait_for(lambda: pool_status(c).get("phase") == "Pending" and pool_status(c)["conditions"][0]["reason"]
                 == "AutoscalerMissing", what="AutoscalerMissing")
        message = pool_status(c)["conditions"][0]["message"]
        assert message.startswith("spec.autoscaling needs ScaledObject (keda.sh/v1alpha1)")
        assert "install KEDA" in message and message.endswith("or remove spec.autoscaling")


def test_a_pools_inference_pool_selects_its_pods_and_goes_with_the_field_or_the_crd(cluster: Cluster, emulator):
    """``spec.routing.inferencePool`` of an LLMEnginePool: one InferencePool over the pool's pods (the picker then
    scores pods by the engines each has loaded: kiln.serving.pool.metrics), deleted when the field goes, and on a
    cluster without the Inference Extension the pool is Pending naming the field and what to install."""
    c = cluster
    body = {"apiVersion": "serving.kiln.dev/v1alpha1", "kind": "LLMEnginePool",
            "metadata": {"name": "shared", "namespace": "ml"},
            "spec": {"replicas": 1, "memoryBudget": "2Gi", "routing": {"inferencePool": True}}}
    with running_operator():
        c.kube.create(ENGINE_POOLS, body)
        pool = wait_for(lambda: c.kube.get(f"{POOLS}/shared-pool"), what="the pool's InferencePool")
        assert pool["spec"]["selector"]["matchLabels"] == c.deployment("shared-pool")["spec"]["selector"][
            "matchLabels"]
        assert pool["spec"]["targetPorts"] == [{"number": 8000}]
        assert pool["spec"]["endpointPickerRef"]["name"] == "shared-pool-epp"
        assert pool["metadata"]["ownerReferences"][0]["kind"] == "LLMEnginePool"
        c.kube.create(ENGINES, manifest("chat", serving={**copy.deepcopy(SPEC["serving"]), "pool": "shared"}))
        c.build(c.wait_job(), SPEC, memory=GiB)
        c.roll_out("shared-pool")
        wait_for(lambda: pool_status(c).get("phase") == "Ready", what="the pool Ready")

        c.kube.patch(f"{ENGINE_POOLS}/shared", {"spec": {"routing": {"inferencePool": False}}})
        wait_for(lambda: c.kube.get(f"{POOLS}/shared-pool") is None, what="the InferencePool deleted")

        emulator.handler.uninstalled.add("inferencepools")  # a cluster without the Inference Extension
        c.kube.patch(f"{ENGINE_POOLS}/shared", {"spec": {"routing": {"inferencePool": True,
                                                                     "endpointPicker": "picker"}}})
        wait_for(lambda: pool_status(c).get("phase") == "Pending" and pool_status(c)["conditions"][0]["reason"]
                 == "PrerequisiteMissing", what="PrerequisiteMissing")
        message = pool_status(c)["conditions"][0]["message"]
        assert message.startswith("spec.routing.inferencePool needs InferencePool (inference.networking.k8s.io/v1)")
        assert message.endswith("or set spec.routing.inferencePool: false")

        emulator.handler.uninstalled.discard("inferencepools")  # the admin installs the CRDs
        wait_for(lambda: pool_status(c).get("phase") == "Ready", what="Ready with the InferencePool")
        assert c.kube.get(f"{POOLS}/shared-pool")["spec"]["endpointPickerRef"]["name"] == "picker"


def pool_reason(c: Cluster) -> str | None:
    return next((x["reason"] for x in pool_status(c).get("conditions") or [] if x["type"] == "Ready"), None)


def test_a_pool_scaled_to_zero_waits_in_the_interceptor_and_its_member_says_so(cluster: Cluster, emulator,
                                                                                 monkeypatch):
    """``minReplicas: 0`` on a pool: the HTTP add-on's HTTPScaledObject over the pool's Service, KEDA (played here
    through /scale) takes it to zero and back, the pool and its member say ScaledToZero at zero without an operator
    write to the count, and a cluster without the add-on is named with the field."""
    monkeypatch.setenv("KILN_POOL_LIST_SYNC_SECONDS", "1")  # the member counts as loaded by the pods at once
    c = cluster
    scaling = {"minReplicas": 0, "maxReplicas": 3, "targetWaitingRequests": 2}
    with running_operator():
        c.kube.create(ENGINE_POOLS, {"apiVersion": "serving.kiln.dev/v1alpha1", "kind": "LLMEnginePool",
                                     "metadata": {"name": "shared", "namespace": "ml"},
                                     "spec": {"memoryBudget": "2Gi", "autoscaling": scaling}})
        held = wait_for(lambda: c.kube.get(f"{HTTPSCALEDOBJECTS}/shared-pool"), what="the pool's HTTPScaledObject")
        assert held["spec"]["scaleTargetRef"]["service"] == "shared-pool"
        assert held["metadata"]["ownerReferences"][0]["kind"] == "LLMEnginePool"
        so = c.kube.get(f"{SCALEDOBJECTS}/shared-pool")
        assert {t["type"] for t in so["spec"]["triggers"]} == {"prometheus", "external-push"}
        assert c.deployment("shared-pool")["spec"]["replicas"] == 1  # one pod on create proves it serves
        c.kube.create(ENGINES, manifest("chat", serving={**copy.deepcopy(SPEC["serving"]), "pool": "shared"},
                                        maxBatchSize=48, maxNumTokens=2048))
        c.build(c.wait_job(), {**SPEC, "maxBatchSize": 48, "maxNumTokens": 2048}, memory=GiB)
        wait_for(lambda: c.kube.get(f"{HTTPSCALEDOBJECTS}/shared-pool")["spec"]["scalingMetric"] == {
            "concurrency": {"targetValue": 48}}, what="a pod's concurrency: the listed member's batch")
        c.roll_out("shared-pool")
        c.wait_status("chat", "served by the pool", phase="Ready")
        wait_for(lambda: c.condition("chat", "Ready").get("reason") == "Serving", what="chat Serving")

        scale(c, "shared-pool", 0)  # idle past the cooldown: KEDA takes the pool to zero
        wait_for(lambda: pool_reason(c) == "ScaledToZero", what="the pool ScaledToZero")
        assert pool_status(c)["phase"] == "Ready" and pool_status(c)["replicas"] == 0
        wait_for(lambda: c.condition("chat", "Ready").get("reason") == "ScaledToZero", what="chat ScaledToZero")
        ready = c.condition("chat", "Ready")
        assert ready["status"] == "False" and "Host: shared-pool.ml.svc" in ready["message"]
        assert c.status("chat")["phase"] == "Ready"

        scale(c, "shared-pool", 1)  # a request held by the interceptor: KEDA wakes the pool
        wait_for(lambda: c.condition("chat", "Ready").get("reason") == "Serving", what="chat Serving again")
        time.sleep(1)  # several reconciles: the count stays KEDA's
        assert operator_replica_writes(emulator) == []

        emulator.handler.uninstalled.add("httpscaledobjects")  # a cluster without the HTTP add-on
        c.kube.delete(f"{HTTPSCALEDOBJECTS}/shared-pool")
        c.kube.patch(f"{ENGINE_POOLS}/shared", {"spec": {"memoryBudget": "3Gi"}})
        wait_for(lambda: pool_reason(c) == "AutoscalerMissing", what="AutoscalerMissing")
        message = pool_status(c)["conditions"][0]["message"]
        assert message.startswith("spec.autoscaling.minReplicas: 0 needs HTTPScaledObject (http.keda.sh/v1alpha1)")
        assert "install the KEDA HTTP add-on" in message and message.endswith("or set minReplicas to 1 or more")
