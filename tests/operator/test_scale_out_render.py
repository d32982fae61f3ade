"""Scale-out renderers: ScaledObject / HTTPScaledObject / InferencePool valid against their projects' own CRD
schemas (vendored under schemas/, source commit recorded in each file), the HPA and Deployment against the
Kubernetes schema; rollout strategy, replica ownership and the unschedulable-pod diagnosis."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
from kiln.operator.autoscaling import REPLICAS_OWNER, queue_queries
from kiln.operator.naming import owner_reference, selector_labels
from kiln.operator.pools import render_pool
from kiln.operator.scale_out import KINDS, extra_objects, missing_prerequisite, replica_status
from kiln.operator.scheduling import new_pods_selector, unschedulable
from kiln.operator.settings import OperatorConfig
from kiln.operator.validation import InvalidSpec, validate_spec
from kiln.operator.workloads import build_deployment, build_pdb

from kiln.api import LLMEngineSpec
from kiln.engine_list import EngineEntry
from kiln.envelope import engine_version
from kiln.manifest import load_manifest

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = Path(__file__).parent / "schemas"
K8S_VERSION = "1.31"
KEDA = OperatorConfig(store_uri="s3://b/p")
HPA = OperatorConfig(store_uri="s3://b/p", autoscaler="hpa")
OWNER = owner_reference({"metadata": {"name": "chat", "uid": "u-1"}})
EXAMPLE = ROOT / "examples" / "llama-3.1-8b-autoscaled.yaml"


def strict(schema: dict) -> dict:
    """The CRD schema, with unknown fields rejected: the API server would prune them silently, so a misspelled
    field would vanish on a real cluster; here it fails."""
    node = copy.deepcopy(schema)
    if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        node["additionalProperties"] = False
    for key in ("properties",):
        if key in node:
            node[key] = {k: strict(v) for k, v in node[key].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            node[key] = strict(node[key])
    return node


def load_schema(kind: str) -> dict:
    file = {"ScaledObject": "keda.sh_v1alpha1_scaledobject.json",
            "HTTPScaledObject": "http.keda.sh_v1alpha1_httpscaledobject.json",
            "InferencePool": "inference.networking.k8s.io_v1_inferencepool.json"}[kind]
    return strict(json.loads((SCHEMAS / file).read_text())["openAPIV3Schema"])


def validate(obj: dict) -> dict:
    if obj["kind"] in ("ScaledObject", "HTTPScaledObject", "InferencePool"):
        api_version, _, _, _ = KINDS[obj["kind"]]
        assert obj["apiVersion"] == api_version
        jsonschema.validate(obj, load_schema(obj["kind"]))
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    return obj


def spec(**serving) -> LLMEngineSpec:
    return LLMEngineSpec.model_validate({
        "model": {"source": "hf://org/m", "revision": "a" * 40}, "gpu": "H100-80GB", "tensorParallel": 2,
        "maxBatchSize": 32, "serving": serving})


def by_kind(objects: list[dict]) -> dict[str, dict]:
    return {o["kind"]: o for o in objects}


def test_the_autoscaled_routed_example_renders_valid_keda_and_pool_objects():
    engine = load_manifest(EXAMPLE)
    s = validate_spec(engine.spec.to_k8s(), KEDA)
    objects = extra_objects(s, engine.metadata.name, "llm", engine_version(s), KEDA, OWNER)
    assert [o["kind"] for o in objects] == ["ScaledObject", "HTTPScaledObject", "InferencePool"]
    for obj in objects:
        validate(obj)
        assert obj["metadata"]["ownerReferences"] == [OWNER] and obj["metadata"]["namespace"] == "llm"
    hpa_objects = extra_objects(s.model_copy(update={"serving": s.serving.model_copy(update={
        "autoscaling": s.serving.autoscaling.model_copy(update={"min_replicas": 1})})}),
        engine.metadata.name, "llm", None, HPA)
    assert [o["kind"] for o in hpa_objects] == ["HorizontalPodAutoscaler", "InferencePool"]
    for obj in hpa_objects:
        validate(obj)


def test_strict_schemas_can_fail():
    so = extra_objects(spec(autoscaling={"maxReplicas": 3}), "chat", "ml", None, KEDA)[0]
    bad = copy.deepcopy(so)
    bad["spec"]["minReplicas"] = 1  # KEDA spells it minReplicaCount
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)
    bad = copy.deepcopy(so)
    del bad["spec"]["triggers"]
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)
    pool = extra_objects(spec(routing={"inferencePool": True}), "chat", "ml", None, KEDA)[0]
    bad = copy.deepcopy(pool)
    bad["spec"]["endpointPickerRef"]["failureMode"] = "FailSometimes"
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)


def test_scaled_object_follows_the_queue_with_the_spec_bounds():
    s = spec(autoscaling={"minReplicas": 2, "maxReplicas": 6, "targetWaitingRequests": 3,
                          "scaleDownStabilizationSeconds": 120})
    (so,) = extra_objects(s, "chat", "ml", None, KEDA)  # minReplicas > 0: no HTTP add-on needed
    validate(so)
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "chat"}
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"], so["spec"]["cooldownPeriod"]) == (2, 6, 120)
    assert so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"][
        "stabilizationWindowSeconds"] == 120
    triggers = {t["metadata"]["query"]: t for t in so["spec"]["triggers"]}
    queries = queue_queries("chat", "ml")
    assert queries["kiln:num_requests_waiting"] == 'sum(kiln:num_requests_waiting{namespace="ml",model_name="chat"})'
    waiting, running = triggers[queries["kiln:num_requests_waiting"]], triggers[queries["kiln:num_requests_running"]]
    assert waiting["type"] == running["type"] == "prometheus"
    assert waiting["metricType"] == running["metricType"] == "AverageValue"  # per pod: sum / threshold
    assert (waiting["metadata"]["threshold"], running["metadata"]["threshold"]) == ("3", "32")  # maxBatchSize
    assert waiting["metadata"]["serverAddress"] == KEDA.prometheus_address


def test_scale_to_zero_holds_requests_in_the_http_add_on_interceptor():
    s = spec(autoscaling={"minReplicas": 0, "maxReplicas": 4}, port=9000)
    so, httpso = extra_objects(s, "chat", "ml", None, KEDA)
    validate(so), validate(httpso)
    assert so["spec"]["minReplicaCount"] == 0
    push = next(t for t in so["spec"]["triggers"] if t["type"] == "external-push")
    assert push["metadata"] == {"scalerAddress": KEDA.keda_http_scaler_address, "httpScaledObject": "chat"}
    # The add-on must not create a second ScaledObject for the same Deployment (KEDA refuses two).
    assert httpso["metadata"]["annotations"] == {"httpscaledobject.keda.sh/skip-scaledobject-creation": "true"}
    ref = httpso["spec"]["scaleTargetRef"]
    assert (ref["name"], ref["service"], ref["port"]) == ("chat", "chat", 9000)
    assert "chat.ml.svc.cluster.local" in httpso["spec"]["hosts"]
    assert httpso["spec"]["replicas"] == {"min": 0, "max": 4}
    # A held request waits as long as a pod may take to start (download + load), not the add-on's default.
    assert httpso["spec"]["timeouts"]["conditionWait"] == f"{KEDA.startup_timeout_seconds}s"


def test_hpa_reads_the_same_series_as_pods_metrics_and_cannot_scale_to_zero():
    s = spec(autoscaling={"minReplicas": 1, "maxReplicas": 5, "targetWaitingRequests": 2})
    (hpa,) = extra_objects(s, "chat", "ml", None, HPA)
    validate(hpa)
    assert hpa["apiVersion"] == "autoscaling/v2" and (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 5)
    metrics = {m["pods"]["metric"]["name"]: m["pods"]["target"] for m in hpa["spec"]["metrics"]}
    assert metrics == {"kiln_num_requests_waiting": {"type": "AverageValue", "averageValue": "2"},
                       "kiln_num_requests_running": {"type": "AverageValue", "averageValue": "32"}}
    zero = {"model": {"source": "s3://models/x"}, "gpu": "L4", "serving": {"autoscaling": {
        "minReplicas": 0, "maxReplicas": 2}}}
    with pytest.raises(InvalidSpec, match=r"spec.serving.autoscaling.minReplicas: 0 needs KEDA.*autoscaling.engine"):
        validate_spec(zero, HPA)
    assert validate_spec(zero, KEDA).serving.autoscaling.min_replicas == 0


def test_inference_pool_selects_the_engines_pods_on_its_port():
    s = spec(routing={"inferencePool": True, "endpointPickerFailureMode": "FailOpen"}, port=8080)
    (pool,) = extra_objects(s, "chat", "ml", None, KEDA)
    validate(pool)
    dep = build_deployment(s, "chat", "ml", "v", "s3://b/engines/v", KEDA)
    assert pool["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"] == selector_labels("chat")
    assert pool["spec"]["targetPorts"] == [{"number": 8080}]
    assert pool["spec"]["endpointPickerRef"] == {"group": "", "kind": "Service", "name": "chat-epp",
                                                 "port": {"number": 9002}, "failureMode": "FailOpen"}
    named = spec(routing={"inferencePool": True, "endpointPicker": "shared-epp"})
    assert extra_objects(named, "chat", "ml", None, KEDA)[0]["spec"]["endpointPickerRef"]["name"] == "shared-epp"
    assert extra_objects(spec(), "chat", "ml", None, KEDA) == []  # routing off, no autoscaling: nothing


@pytest.mark.parametrize("strategy, rolling", [
    ("Surge", {"maxUnavailable": 0, "maxSurge": 1}),
    ("RecreateOneAtATime", {"maxUnavailable": 1, "maxSurge": 0}),
])
def test_rollout_strategy_maps_to_the_deployment(strategy: str, rolling: dict):
    s = spec(rolloutStrategy=strategy, replicas=3)
    dep = validate(build_deployment(s, "chat", "ml", "v", "u", KEDA))
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": rolling}
    assert engine_version(s) == engine_version(spec(replicas=3))  # a serving knob: same artifact


def test_autoscaled_deployment_starts_with_one_pod_and_marks_the_scaler_as_owner():
    s = spec(autoscaling={"minReplicas": 0, "maxReplicas": 4}, replicas=7)
    dep = build_deployment(s, "chat", "ml", "v", "u", KEDA)
    assert dep["spec"]["replicas"] == 1 and dep["metadata"]["annotations"][REPLICAS_OWNER] == "autoscaler"
    assert build_pdb(s, "chat", "ml") is None  # the floor is 0 pods
    three = spec(autoscaling={"minReplicas": 3, "maxReplicas": 4})
    assert build_deployment(three, "chat", "ml", "v", "u", KEDA)["spec"]["replicas"] == 3
    assert build_pdb(three, "chat", "ml") is not None
    plain = build_deployment(spec(replicas=7), "chat", "ml", "v", "u", KEDA)
    assert plain["spec"]["replicas"] == 7 and REPLICAS_OWNER not in plain["metadata"]["annotations"]


def pending(name: str, message: str, reason: str = "Unschedulable") -> dict:
    return {"metadata": {"name": name}, "status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": reason, "message": message}]}}


def test_unschedulable_new_pods_name_the_sku_and_the_gpus_wanted():
    s = spec()
    gpu_msg = "0/5 nodes are available: 3 Insufficient nvidia.com/gpu, 2 node(s) didn't match node selector."
    reason, message = unschedulable([pending("chat-7d9-x", gpu_msg)], s, "m-new", KEDA, serving="m-old")
    assert reason == "InsufficientGPU"
    assert "needs 2 H100-80GB GPU(s)" in message and "nvidia.com/gpu: 2" in message
    assert "nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3" in message and gpu_msg in message
    assert "m-old keeps serving" in message and "spec.serving.rolloutStrategy: RecreateOneAtATime" in message
    reason, message = unschedulable([pending("chat-7d9-x", "0/2 nodes are available: 2 Insufficient memory.")],
                                    s, "m-new", KEDA, serving=None)
    assert reason == "Unschedulable" and "Insufficient memory" in message
    scheduled = {"metadata": {"name": "p"}, "status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "True"}]}}
    assert unschedulable([scheduled], s, "m-new", KEDA, serving="m-old") is None
    assert unschedulable([pending("p", gpu_msg, reason="SchedulingGated")], s, "m-new", KEDA, "m-old") is None
    assert new_pods_selector("chat", "m-new") == (
        "serving.kiln.dev/engine=chat,app.kubernetes.io/component=serving,serving.kiln.dev/engine-version=m-new")


def test_replica_status_and_prerequisite_messages():
    dep = {"spec": {"replicas": 3}, "status": {"replicas": 4, "readyReplicas": 2, "updatedReplicas": 1}}
    assert replica_status(dep, True, "ScaledObject/chat") == {
        "desired": 3, "current": 4, "ready": 2, "updated": 1, "owner": "ScaledObject/chat"}
    assert replica_status(None, False, "ScaledObject/chat")["owner"] == "operator"
    msg = missing_prerequisite("InferencePool", "ml")
    assert msg.startswith("spec.serving.routing.inferencePool needs InferencePool (inference.networking.k8s.io/v1)")
    assert "install the Gateway API Inference Extension CRDs" in msg and "inferencePool: false" in msg
    assert "install KEDA" in missing_prerequisite("ScaledObject", "ml")


def test_kiln_render_prints_the_scale_out_objects_and_targets_the_workload():
    """`kiln render` shows the ScaledObject / HTTPScaledObject / InferencePool; a multi-node engine's scaler
    scales its LeaderWorkerSet (one replica = one group), not a Deployment."""
    from kiln.operator.naming import lws_name
    from kiln.operator.render import render_objects

    from kiln.api import LLMEngine
    from kiln.manifest import load_manifest

    config = OperatorConfig()
    engine = load_manifest(Path(__file__).resolve().parents[2] / "examples" / "llama-3.1-8b-autoscaled.yaml")
    kinds = [o["kind"] for o in render_objects(engine, config)]
    assert {"ScaledObject", "InferencePool"} <= set(kinds) and "Deployment" in kinds
    raw = engine.model_dump(by_alias=True, exclude_none=True)
    raw["spec"].update(gpu="H100-80GB", tensorParallel=8, pipelineParallel=2, quantization="none",
                       dtype="bfloat16")
    multi = LLMEngine.model_validate(raw)
    objects = render_objects(multi, config)
    scaler = next(o for o in objects if o["kind"] == "ScaledObject")
    assert scaler["spec"]["scaleTargetRef"]["kind"] == "LeaderWorkerSet"
    assert scaler["spec"]["scaleTargetRef"]["name"] == lws_name(multi.metadata.name)
    lws = next(o for o in objects if o["kind"] == "LeaderWorkerSet")
    assert lws["metadata"]["annotations"].get(REPLICAS_OWNER) == "autoscaler"


POOL_BODY = {"apiVersion": "serving.kiln.dev/v1alpha1", "kind": "LLMEnginePool", "metadata": {"name": "shared"},
             "spec": {"replicas": 5, "autoscaling": {"minReplicas": 2, "maxReplicas": 6, "targetWaitingRequests": 3,
                                                     "scaleDownStabilizationSeconds": 120}}}


def test_a_pool_scales_its_deployment_on_the_pools_queue_with_keda_or_an_hpa():
    members = [EngineEntry("chat", "s3://b/p/engines/v1"), EngineEntry("sql", "s3://b/p/engines/v2")]
    _, deployment, _, pdb, _, so = render_pool(POOL_BODY, "shared", "ml", KEDA, members)
    validate(so)
    validate(pdb)
    validate(deployment)
    assert deployment["spec"]["replicas"] == 2  # minReplicas on create, not spec.replicas: then the scaler's
    assert deployment["metadata"]["annotations"][REPLICAS_OWNER] == "autoscaler"
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "shared-pool"}
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"], so["spec"]["cooldownPeriod"]) == (2, 6, 120)
    [trigger] = so["spec"]["triggers"]  # the queue alone, not the engines' running requests
    assert trigger["metadata"]["query"] == \
        'sum(kiln:num_requests_waiting{namespace="ml",model_name=~"chat|shared|sql"})'  # its engines' and its own
    assert trigger["metadata"]["threshold"] == "3" and trigger["metricType"] == "AverageValue"
    *_, hpa = render_pool(POOL_BODY, "shared", "ml", HPA)
    validate(hpa)
    assert hpa["kind"] == "HorizontalPodAutoscaler" and hpa["spec"]["scaleTargetRef"]["name"] == "shared-pool"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert hpa["spec"]["metrics"] == [{"type": "Pods", "pods": {
        "metric": {"name": HPA.hpa_metric_prefix + "num_requests_waiting"},
        "target": {"type": "AverageValue", "averageValue": "3"}}}]
    plain = render_pool({**POOL_BODY, "spec": {"replicas": 5}}, "shared", "ml", KEDA)
    assert len(plain) == 5 and plain[1]["spec"]["replicas"] == 5 and REPLICAS_OWNER not in (  # + PDB, policy
        plain[1]["metadata"].get("annotations") or {})
    assert [o["kind"] for o in render_pool(POOL_BODY, "shared", "ml", KEDA)].count("HTTPScaledObject") == 0


def test_a_pool_scales_to_zero_behind_the_http_add_ons_interceptor_on_keda_only():
    body = {**POOL_BODY, "spec": {"port": 9000, "autoscaling": {"minReplicas": 0, "maxReplicas": 4}}}
    objects = by_kind(render_pool(body, "shared", "ml", KEDA))
    so, held, deployment = objects["ScaledObject"], objects["HTTPScaledObject"], objects["Deployment"]
    validate(so), validate(held), validate(deployment)
    assert deployment["spec"]["replicas"] == 1  # one pod on create proves the pool serves; then KEDA's count
    assert so["spec"]["minReplicaCount"] == 0
    push = next(t for t in so["spec"]["triggers"] if t["type"] == "external-push")
    assert push["metadata"] == {"scalerAddress": KEDA.keda_http_scaler_address, "httpScaledObject": "shared-pool"}
    assert held["metadata"]["name"] == "shared-pool"
    assert held["metadata"]["annotations"] == {"httpscaledobject.keda.sh/skip-scaledobject-creation": "true"}
    ref = held["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"], ref["service"], ref["port"]) == ("Deployment", "shared-pool", "shared-pool", 9000)
    assert held["spec"]["hosts"] == ["shared-pool.ml.svc.cluster.local", "shared-pool.ml.svc", "shared-pool.ml"]
    assert held["spec"]["replicas"] == {"min": 0, "max": 4}
    assert held["spec"]["timeouts"]["conditionWait"] == f"{KEDA.startup_timeout_seconds}s"
    assert held["spec"]["scalingMetric"] == {"concurrency": {"targetValue": 64}}  # no member: the default batch
    assert "PodDisruptionBudget" not in objects  # the floor is 0 pods
    with pytest.raises(InvalidSpec, match=r"^spec.autoscaling.minReplicas: 0 needs KEDA.*autoscaling.engine: keda$"):
        render_pool(body, "shared", "ml", HPA)


def test_a_pool_with_routing_renders_one_inference_pool_over_its_pods():
    body = {**POOL_BODY, "spec": {"replicas": 1, "port": 8080, "routing": {
        "inferencePool": True, "endpointPickerFailureMode": "FailOpen"}}}
    objects = render_pool(body, "shared", "ml", KEDA)
    (pool,) = [o for o in objects if o["kind"] == "InferencePool"]
    validate(pool)
    deployment = by_kind(objects)["Deployment"]
    assert pool["metadata"]["name"] == "shared-pool"
    assert pool["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert pool["spec"]["targetPorts"] == [{"number": 8080}]
    assert pool["spec"]["endpointPickerRef"] == {"group": "", "kind": "Service", "name": "shared-pool-epp",
                                                 "port": {"number": 9002}, "failureMode": "FailOpen"}
    named = {**body, "spec": {**body["spec"], "routing": {"inferencePool": True, "endpointPicker": "epp"}}}
    assert by_kind(render_pool(named, "shared", "ml", KEDA))["InferencePool"]["spec"]["endpointPickerRef"][
        "name"] == "epp"
    assert "InferencePool" not in by_kind(render_pool({**body, "spec": {"replicas": 1}}, "shared", "ml", KEDA))
    with pytest.raises(InvalidSpec, match=r"^spec.routing.endpointPicker"):
        render_pool({**body, "spec": {"routing": {"endpointPicker": "Not_A_Name"}}}, "shared", "ml", KEDA)
    long_name = "p" * 58  # a pool name may be that long; <pool>-pool-epp would pass 63 characters
    picker = by_kind(render_pool({**body, "metadata": {**body["metadata"], "name": long_name}}, long_name, "ml",
                                 KEDA))["InferencePool"]["spec"]["endpointPickerRef"]["name"]
    assert len(picker) <= 63 and picker.endswith("-epp") and picker.startswith("p" * 40)
