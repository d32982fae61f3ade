"""Multi-node engines: the rendered LeaderWorkerSet, valid against the LWS CRD's own schema, and `kiln render`.

The LWS schema is vendored from kubernetes-sigs/lws v0.10.0 (tests/operator/data/README.md), with the
two pod templates trimmed out; those are validated here as core/v1 PodTemplates by kubernetes-validate.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner
from kiln.operator.jobs import build_job
from kiln.operator.naming import (
    LABEL_VERSION,
    MAX_LWS_NAME,
    lws_name,
    owner_reference,
    service_name,
    version_label,
)
from kiln.operator.render import render, render_objects
from kiln.operator.settings import OperatorConfig
from kiln.operator.status import rollout_complete, template_version
from kiln.operator.validation import InvalidSpec, validate_spec
from kiln.operator.workloads import (
    API_KEY_FILE,
    RENDEZVOUS_PORT,
    build_leader_worker_set,
    build_pdb,
    build_service,
    build_workload,
)

from kiln.api import LLMEngineSpec
from kiln.envelope import engine_version
from kiln.manifest import load_manifest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_405B = ROOT / "examples" / "llama-3.1-405b-2x8xh100.yaml"
LWS = json.loads((Path(__file__).parent / "data" / "lws-v0.10.0-schema.json").read_text())
K8S_VERSION = "1.31"
CONFIG = OperatorConfig(store_uri="s3://kiln-engines/prod", store_secret="kiln-store", serving_store_secret="kiln-store-ro",
                        builder_image="kiln:build", serving_image="kiln:serve")
OWNER = owner_reference({"metadata": {"name": "big", "uid": "1234-5678"}})


def strict(schema: Any) -> Any:
    """The API server's strict field validation (kubectl's default): an unknown field is an error, except
    under x-kubernetes-preserve-unknown-fields."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


LWS_SCHEMA = strict(LWS["openAPIV3Schema"])


def validate_lws(obj: dict) -> dict:
    """Valid against the LWS CRD (strict), each pod template valid as core/v1, plus the LWS webhook's
    rollout rule (maxUnavailable may be 0 only with a maxSurge)."""
    assert (obj["apiVersion"], obj["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    jsonschema.validate(obj, LWS_SCHEMA)
    lwt = obj["spec"]["leaderWorkerTemplate"]
    for key in ("leaderTemplate", "workerTemplate"):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                      "metadata": {"name": f"x-{key.lower()}", "namespace": "ns"},
                                      "template": lwt[key]}, K8S_VERSION, strict=True)
    rolling = obj["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]
    assert not (rolling["maxUnavailable"] == 0 and rolling.get("maxSurge", 0) == 0)
    return obj


def spec(**overrides) -> LLMEngineSpec:
    raw = {"model": {"source": "hf://meta-llama/Llama-3.1-405B-Instruct", "revision": "a" * 40},
           "gpu": "H100-80GB", "dtype": "bfloat16", "tensorParallel": 8, "pipelineParallel": 2, **overrides}
    return LLMEngineSpec.model_validate(raw)


def lws_of(s: LLMEngineSpec, name: str = "big") -> dict:
    version = engine_version(s)
    return build_leader_worker_set(s, name, "llm", version, f"s3://kiln-engines/prod/engines/{version}", CONFIG,
                                   OWNER)


def templates(obj: dict) -> tuple[dict, dict]:
    lwt = obj["spec"]["leaderWorkerTemplate"]
    return lwt["leaderTemplate"], lwt["workerTemplate"]


def test_the_vendored_schema_is_the_lws_crd_and_catches_mistakes():
    assert LWS["lws_version"] == "v0.10.0" and LWS["crd_version"] == "v1"
    good = validate_lws(lws_of(spec()))
    for path, value in [(("spec", "leaderWorkerTemplate", "restartPolicy"), "RecreateGroupOnRestart"),
                        (("spec", "startupPolicy"), "LeaderFirst"),
                        (("spec", "rolloutStrategy", "type"), "Recreate"),
                        (("spec", "leaderWorkerTemplate", "size"), "2"),
                        (("spec", "leaderWorkerTemplate", "groupSize"), 2)]:
        bad = copy.deepcopy(good)
        node = bad
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, LWS_SCHEMA)
    bad = copy.deepcopy(good)  # a pod template mistake is caught by the core/v1 check
    templates(bad)[1]["spec"]["containers"][0]["ports"] = [{"containerPort": "http"}]
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_lws(bad)


def test_a_405b_engine_on_two_8xh100_nodes_is_one_lws_group_of_two_pods():
    engine = load_manifest(EXAMPLE_405B)
    s = validate_spec(engine.spec.to_k8s(), CONFIG)
    shape = s.replica_shape
    assert (shape.pods, shape.ranks_per_pod, shape.world_size) == (2, 8, 16)
    version = engine_version(s)
    uri = f"s3://kiln-engines/prod/engines/{version}"
    obj = validate_lws(build_workload(s, "llama-3-1-405b", "llm", version, uri, CONFIG, OWNER))
    lwt = obj["spec"]["leaderWorkerTemplate"]
    assert obj["spec"]["replicas"] == 1 and lwt["size"] == 2
    assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    # LeaderReady would deadlock: the leader is Ready only once every worker has joined.
    assert obj["spec"]["startupPolicy"] == "LeaderCreated"
    assert obj["spec"]["rolloutStrategy"] == {
        "type": "RollingUpdate", "rollingUpdateConfiguration": {"maxUnavailable": 0, "maxSurge": 1}}
    assert obj["metadata"]["ownerReferences"] == [OWNER]
    leader, worker = templates(obj)
    for template in (leader, worker):
        (c,) = template["spec"]["containers"]
        assert c["command"] == ["kiln", "serve"] and c["args"][:2] == ["--artifact", uri]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 8  # one node's GPUs: one pipeline stage
        assert template["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
        assert template["metadata"]["labels"][LABEL_VERSION] == version_label(version)
        assert template["metadata"]["annotations"]["serving.kiln.dev/engine-version"] == version
        assert template["spec"]["automountServiceAccountToken"] is False
        assert {"name": "KILN_LEADER_PORT", "value": str(RENDEZVOUS_PORT)} in c["env"]
        assert {v["name"] for v in template["spec"]["volumes"]} >= {"cache", "tmp", "shm"}
    assert template_version(obj) == version


def test_leader_serves_and_is_ready_only_when_the_group_is_workers_only_compute():
    s = spec(serving={"apiKeySecret": "api-key", "port": 9000})
    obj = validate_lws(lws_of(s))
    leader, worker = templates(obj)
    (lc,), (wc,) = leader["spec"]["containers"], worker["spec"]["containers"]
    assert lc["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}  # 503 until every rank is up
    assert lc["livenessProbe"]["httpGet"]["path"] == "/health"  # 503 once a rank died
    assert {p["name"]: p["containerPort"] for p in lc["ports"]} == {"http": 9000, "rendezvous": RENDEZVOUS_PORT}
    assert lc["args"][lc["args"].index("--api-key-file") + 1] == API_KEY_FILE
    assert "--host" in lc["args"] and lc["args"][lc["args"].index("--port") + 1] == "9000"
    # Workers: no port, no probe, no API key; kiln serve takes its role from LWS_WORKER_INDEX.
    assert not {"ports", "readinessProbe", "livenessProbe", "startupProbe", "lifecycle"} & set(wc)
    assert "--api-key-file" not in wc["args"] and "--port" not in wc["args"] and "--host" not in wc["args"]
    assert not any(v["name"] == "api-key" for v in worker["spec"]["volumes"])
    assert not any(m["name"] == "api-key" for m in wc["volumeMounts"])
    assert wc["envFrom"] == lc["envFrom"] == [{"secretRef": {"name": "kiln-store-ro"}}]  # both download the artifact
    # The Service routes to leaders (and Deployment pods), never to workers.
    svc = build_service(s, "big", "llm", OWNER)
    selector = svc["spec"]["selector"].items()
    assert selector <= leader["metadata"]["labels"].items()
    assert not selector <= worker["metadata"]["labels"].items()


def test_lws_name_leaves_the_engine_name_to_kiln_s_service_and_fits_the_lws_limits():
    assert lws_name("big") == "big-lws" != service_name("big")
    assert lws_name("7b-chat").startswith("llme-7b-chat")
    long_a, long_b = "a" * 63, "a" * 62 + "b"
    assert len(lws_name(long_a)) <= MAX_LWS_NAME and lws_name(long_a) != lws_name(long_b)
    obj = validate_lws(lws_of(spec(), name=long_a))
    assert obj["metadata"]["name"] == lws_name(long_a)


def test_one_pod_replicas_stay_deployments_and_gpus_follow_the_pod():
    single = spec(tensorParallel=2, pipelineParallel=2)  # 4 GPUs: one node, one pod
    version = engine_version(single)
    dep = build_workload(single, "d", "llm", version, "s3://b/engines/v", CONFIG)
    assert dep["kind"] == "Deployment"
    kubernetes_validate.validate(dep, K8S_VERSION, strict=True)
    assert dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4
    # The build Job: the GPUs of one pod. A multi-node engine is built on one node (docs/multi-node-cluster.md).
    for s, gpus in ((single, 4), (spec(), 8), (spec(tensorParallel=4, pipelineParallel=4), 8),
                    (spec(tensorParallel=2, pipelineParallel=8, gpusPerNode=4), 4)):
        job = build_job(s, "d", "llm", engine_version(s), CONFIG)
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)
        (c,) = job["spec"]["template"]["spec"]["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert json.loads(next(e["value"] for e in c["env"] if e["name"] == "KILN_SPEC"))["spec"][
            "pipelineParallel"] == s.pipeline_parallel
    cpu = spec(gpu="cpu", dtype="float32", tensorParallel=2, pipelineParallel=2, gpusPerNode=2)
    obj = validate_lws(lws_of(cpu))
    assert obj["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert "nvidia.com/gpu" not in (templates(obj)[1]["spec"]["containers"][0]["resources"].get("limits") or {})


def test_a_multi_node_pdb_covers_every_pod_of_every_group():
    s = spec(serving={"replicas": 3})
    pdb = build_pdb(s, "big", "llm", OWNER)
    kubernetes_validate.validate(pdb, K8S_VERSION, strict=True)
    leader, worker = templates(lws_of(s))
    selector = pdb["spec"]["selector"]["matchLabels"].items()
    assert selector <= leader["metadata"]["labels"].items() and selector <= worker["metadata"]["labels"].items()
    assert pdb["spec"]["maxUnavailable"] == 1
    assert build_pdb(spec(), "big", "llm") is None


def test_lws_rollout_counts_ready_groups():
    obj = lws_of(spec(serving={"replicas": 2}))
    obj["metadata"]["generation"] = 3
    done = {"observedGeneration": 3, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 2}
    assert rollout_complete({**obj, "status": done})
    for change in ({"readyReplicas": 1}, {"updatedReplicas": 1}, {"replicas": 3}, {"observedGeneration": 2}):
        assert not rollout_complete({**obj, "status": {**done, **change}}), change


def test_serving_gpus_in_resources_must_be_the_pod_s():
    raw = spec().to_k8s()
    raw["serving"]["resources"] = {"limits": {"nvidia.com/gpu": 16}}
    with pytest.raises(InvalidSpec, match=r"spec.serving.resources.limits: nvidia.com/gpu is 16 .* holds 8 GPU"):
        validate_spec(raw, CONFIG)


def test_kiln_render_prints_what_the_operator_would_create(monkeypatch):
    monkeypatch.setenv("KILN_STORE_URI", "s3://from-env/kiln")
    result = CliRunner().invoke(render, ["-f", str(EXAMPLE_405B), "--store", "s3://prod-engines/kiln"])
    assert result.exit_code == 0, result.output
    docs = list(yaml.safe_load_all(result.output))
    assert [d["kind"] for d in docs] == ["Job", "LeaderWorkerSet", "Service", "NetworkPolicy"]
    job, lws, svc, policy = docs
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    kubernetes_validate.validate(svc, K8S_VERSION, strict=True)
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    # rank ports only from the engine's own pods: leaders and workers carry the policy's selector
    ranks = policy["spec"]["ingress"][1]["from"][0]["podSelector"]["matchLabels"]
    assert all(ranks.items() <= t["metadata"]["labels"].items() for t in templates(lws))
    validate_lws(lws)
    engine = load_manifest(EXAMPLE_405B)
    version = engine_version(engine.spec)
    assert lws["metadata"]["namespace"] == "llm"
    assert templates(lws)[0]["spec"]["containers"][0]["args"][1] == f"s3://prod-engines/kiln/engines/{version}"
    # The same renderers the operator runs: byte-for-byte the objects of render_objects.
    config = OperatorConfig.from_env({"KILN_STORE_URI": "s3://prod-engines/kiln"})
    assert docs == render_objects(engine, config)
    # A one-pod engine: a Deployment; the store comes from $KILN_STORE_URI without --store.
    # The build Job in the namespace builds run in (the operator's: the only one holding the private key).
    monkeypatch.setenv("KILN_OPERATOR_NAMESPACE", "kiln-system")
    result = CliRunner().invoke(render, ["-f", str(ROOT / "examples" / "llama-3.1-70b-4xh100.yaml"), "-n", "x"])
    assert result.exit_code == 0, result.output
    kinds = [(d["kind"], d["metadata"]["namespace"]) for d in yaml.safe_load_all(result.output)]
    assert kinds == [("Job", "kiln-system"), ("Deployment", "x"), ("Service", "x"), ("NetworkPolicy", "x")]
    assert "s3://from-env/kiln/engines/" in result.output


def test_kiln_render_refuses_what_the_operator_refuses(tmp_path: Path):
    result = CliRunner().invoke(render, ["-f", str(ROOT / "examples" / "cpu-small.yaml")])
    assert result.exit_code == 2 and "spec.model.source" in result.output and "Traceback" not in result.output
    bad = yaml.safe_load(EXAMPLE_405B.read_text())
    bad["spec"]["gpusPerNode"] = 4
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    result = CliRunner().invoke(render, ["-f", str(path)])
    assert result.exit_code == 2 and "spec.tensorParallel: " in result.output and "gpusPerNode" in result.output
