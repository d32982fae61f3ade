"""The pure renderers: Job, Deployment, Service, PDB dicts, each valid against the Kubernetes schema."""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner
from kiln.operator.jobs import build_job
from kiln.operator.naming import (
    LABEL_VERSION,
    bounded_name,
    job_name,
    owner_reference,
    service_name,
    version_label,
)
from kiln.operator.pools import render_pool
from kiln.operator.render import render, render_objects
from kiln.operator.settings import ConfigError, OperatorConfig
from kiln.operator.validation import InvalidSpec, validate_spec
from kiln.operator.workloads import (
    API_KEY_FILE,
    build_deployment,
    build_pdb,
    build_service,
    build_workload,
    endpoint,
    grace_period,
)
from test_render_lws import validate_lws

from kiln.api import LLMEngineSpec
from kiln.artifact_manifest import BUILT_BY_ENV, EXPECT_ENV, ArtifactExpectation, BuiltBy
from kiln.artifacts import ArtifactStore
from kiln.envelope import engine_version
from kiln.manifest import load_manifest, load_pool
from kiln.skus import GPU_SKUS

K8S_VERSION = "1.31"
CONFIG = OperatorConfig(store_uri="s3://kiln-engines/prod", store_secret="kiln-store", serving_store_secret="kiln-store-ro",
                        builder_image="kiln:build", serving_image="kiln:serve")
OWNER = owner_reference({"metadata": {"name": "demo", "uid": "1234-5678"}})


def spec(**overrides) -> LLMEngineSpec:
    raw = {"model": {"source": "hf://meta-llama/Llama-3.1-8B-Instruct", "revision": "a" * 40},
           "gpu": "H100-80GB", "dtype": "bfloat16", "quantization": "fp8", **overrides}
    return LLMEngineSpec.model_validate(raw)


def validate(obj: dict) -> dict:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    return obj


def container(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]["containers"][0]


def env(obj: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container(obj)["env"]}


@pytest.mark.parametrize("sku", sorted(GPU_SKUS))
@pytest.mark.parametrize("tp", [1, 4])
def test_build_job_is_valid_and_targets_the_sku(sku: str, tp: int):
    s = spec(gpu=sku, tensorParallel=tp, quantization="none")
    version = engine_version(s)
    job = validate(build_job(s, "demo", "ml", version, CONFIG))
    assert job["metadata"]["name"] == job_name(version) and len(job["metadata"]["name"]) <= 63
    assert job["metadata"]["labels"][LABEL_VERSION] == version_label(version)
    pod = job["spec"]["template"]["spec"]
    limits = container(job)["resources"].get("limits", {})
    if sku == "cpu":
        assert "nvidia.com/gpu" not in limits and "nodeSelector" not in pod and "tolerations" not in pod
    else:
        assert limits["nvidia.com/gpu"] == tp
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": GPU_SKUS[sku].product_label}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert any(v["name"] == "shm" for v in pod["volumes"]) == (tp > 1)


def init_container(obj: dict) -> dict:
    (fetch,) = obj["spec"]["template"]["spec"]["initContainers"]
    return fetch


def test_build_job_passes_the_spec_store_and_version_per_contract():
    s = spec(build={"timeoutSeconds": 1200, "image": "my/builder:1"}, model={
        "source": "hf://org/m", "credentialsSecret": "hf-token"})
    version = engine_version(s)
    job = validate(build_job(s, "demo", "ml", version, CONFIG))
    c = container(job)
    assert c["command"] == ["kiln", "build"] and c["args"] == ["--prefetched", "--store", "$(KILN_STORE_URI)"]
    assert c["image"] == "my/builder:1"
    e = env(job)
    assert e["KILN_STORE_URI"] == "s3://kiln-engines/prod" and e["KILN_ENGINE_VERSION"] == version
    manifest = json.loads(e["KILN_SPEC"])
    assert manifest["kind"] == "LLMEngine" and manifest["metadata"] == {"name": "demo", "namespace": "ml"}
    assert engine_version(LLMEngineSpec.model_validate(manifest["spec"])) == version
    assert BuiltBy.model_validate_json(e[BUILT_BY_ENV]) == BuiltBy(
        builder_image="my/builder:1", operator=CONFIG.operator_id)
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert job["spec"]["activeDeadlineSeconds"] == 1200
    assert job["spec"]["backoffLimit"] == CONFIG.build_backoff_limit
    assert job["spec"]["ttlSecondsAfterFinished"] == CONFIG.build_ttl_seconds
    assert "ownerReferences" not in job["metadata"]  # shared, and in the jobs namespace: no engine owns it
    store = ArtifactStore.from_uri("file:///tmp/kiln-store-x")
    cfg = OperatorConfig(store_uri="file:///tmp/kiln-store-x")
    assert build_job(s, "d", "n", version, cfg)["metadata"]["annotations"][
        "serving.kiln.dev/artifact-uri"] == store.artifact_uri(version)


def test_build_job_keeps_model_and_store_credentials_in_separate_containers():
    s = spec(model={"source": "s3://models/m", "credentialsSecret": "team-a-models"})
    job = validate(build_job(s, "demo", "ml", engine_version(s), CONFIG))
    pod = job["spec"]["template"]["spec"]
    fetch, build = init_container(job), container(job)
    assert fetch["args"] == ["--fetch-only"] and fetch["image"] == build["image"] == CONFIG.builder_image
    # The jobs namespace's copy of the engine namespace's Secret (kiln.operator.keys), only in fetch.
    assert fetch["envFrom"] == [{"secretRef": {"name": "kiln-cred-ml.team-a-models"}}]
    assert build["envFrom"] == [{"secretRef": {"name": "kiln-store"}}]
    fetch_env = {e["name"] for e in fetch["env"]}
    assert not any(n.startswith("KILN_STORE") for n in fetch_env) and BUILT_BY_ENV not in fetch_env
    assert "nvidia.com/gpu" not in (fetch["resources"].get("limits") or {})  # fetching needs no GPU
    # Only the work dir is shared (the checkpoint), not /tmp.
    mounts = {c["name"]: {m["name"]: m["mountPath"] for m in c["volumeMounts"]} for c in (fetch, build)}
    assert mounts["fetch"]["work"] == mounts["build"]["work"] == env(job)["KILN_WORK_DIR"]
    assert mounts["fetch"]["fetch-tmp"] == mounts["build"]["tmp"] == "/tmp"
    assert pod["automountServiceAccountToken"] is False
    for secretless in (spec(), spec(model={"source": "pvc://models/m"})):
        job = build_job(secretless, "demo", "ml", engine_version(secretless), CONFIG)
        assert "envFrom" not in init_container(job)


def test_build_job_mounts_a_pvc_source_read_only():
    s = spec(model={"source": "pvc://models/llama/8b"})
    job = validate(build_job(s, "demo", "ml", engine_version(s), CONFIG))
    pod = job["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod["volumes"]
    for c in (init_container(job), container(job)):  # fetch records the path, build reads the weights there
        mount = next(m for m in c["volumeMounts"] if m["name"] == "model")
        assert mount["mountPath"] == env(job)["KILN_PVC_ROOT"] + "/models" and mount["readOnly"]


def test_build_job_fetches_a_draft_model_with_its_claim_and_credentials():
    draft = {"method": "draft_model", "draftModel": {"source": "pvc://drafts/small"}}
    s = spec(model={"source": "pvc://models/llama/8b"}, speculative=draft)
    job = validate(build_job(s, "demo", "ml", engine_version(s), CONFIG))
    volumes = job["spec"]["template"]["spec"]["volumes"]
    assert {"name": "model-1", "persistentVolumeClaim": {"claimName": "drafts", "readOnly": True}} in volumes
    for c in (init_container(job), container(job)):
        mount = next(m for m in c["volumeMounts"] if m["name"] == "model-1")
        assert mount["mountPath"] == env(job)["KILN_PVC_ROOT"] + "/drafts" and mount["readOnly"]
    same = spec(model={"source": "pvc://models/a"}, speculative={**draft, "draftModel": {"source": "pvc://models/b"}})
    assert sum("persistentVolumeClaim" in v for v in build_job(same, "d", "ml", engine_version(same), CONFIG)
               ["spec"]["template"]["spec"]["volumes"]) == 1  # one claim, one volume
    hf = spec(model={"source": "s3://models/m"},
              speculative={"method": "draft_model", "draftModel": {"source": "hf://org/small", "credentialsSecret": "hf"}})
    job = build_job(hf, "demo", "ml", engine_version(hf), CONFIG)
    assert init_container(job)["envFrom"] == [{"secretRef": {"name": "kiln-cred-ml.hf"}}]
    assert "envFrom" not in container(job) or {"secretRef": {"name": "kiln-cred-ml.hf"}} not in container(job)["envFrom"]


def test_a_file_draft_model_is_refused_like_a_file_model():
    raw = spec(speculative={"method": "draft_model", "draftModel": {"source": "file:///models/small"}}).to_k8s()
    with pytest.raises(InvalidSpec, match=r"^spec\.speculative\.draftModel\.source: file:///models/small is a path"):
        validate_spec(raw, CONFIG)


def test_job_names_are_deterministic_bounded_and_distinct():
    long_a, long_b = "m" * 50 + "-aaaaaaaaaaaa", "m" * 50 + "-bbbbbbbbbbbb"
    assert job_name(long_a) == job_name(long_a)
    assert len(job_name(long_a)) <= 63 and job_name(long_a) != job_name(long_b)
    assert not bounded_name("kiln-build-", "x" * 60).endswith("--")
    assert job_name("llama-0123456789ab") == "kiln-build-llama-0123456789ab"
    assert service_name("7b-chat").startswith("llme-") and service_name("chat") == "chat"


def test_batch_invariant_is_a_serve_flag_of_a_cpu_engine_and_outside_the_engine_version():
    cpu = dict(gpu="cpu", dtype="float32", quantization="none")
    plain, steady = spec(**cpu), spec(**cpu, serving={"batchInvariant": True})
    assert engine_version(plain) == engine_version(steady)  # a serving setting: no rebuild
    uri = "s3://kiln-engines/prod/engines/v"
    args = container(validate(build_deployment(steady, "demo", "ml", "v", uri, CONFIG, OWNER)))["args"]
    assert args.count("--batch-invariant") == 1
    assert "--batch-invariant" not in container(build_deployment(plain, "demo", "ml", "v", uri, CONFIG, OWNER))["args"]


def test_chat_settings_are_serve_flags_of_an_engine_and_of_a_pool_not_of_a_member():
    """spec.serving.reasoningParser / defaultChatTemplateKwargs become kiln serve's flags on the engine's pods (no
    rebuild); a pool's spec says them for every member, and a member's own are refused, as its batchInvariant."""
    chat = {"reasoningParser": "qwen3", "defaultChatTemplateKwargs": {"enable_thinking": False}}
    plain, thinking = spec(), spec(serving=chat)
    assert engine_version(plain) == engine_version(thinking)
    uri = "s3://kiln-engines/prod/engines/v"
    args = container(validate(build_deployment(thinking, "demo", "ml", "v", uri, CONFIG, OWNER)))["args"]
    assert args[args.index("--reasoning-parser") + 1] == "qwen3"
    assert json.loads(args[args.index("--default-chat-template-kwargs") + 1]) == {"enable_thinking": False}
    assert "--reasoning-parser" not in container(build_deployment(plain, "demo", "ml", "v", uri, CONFIG, OWNER))["args"]
    data = yaml.safe_load(POOL_EXAMPLE.read_text())
    data["spec"].update(chat)
    deployment = next(o for o in render_pool(data, "small", "ns", CONFIG) if o["kind"] == "Deployment")
    pool_args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert pool_args[pool_args.index("--reasoning-parser") + 1] == "qwen3"
    member = {"model": {"source": "hf://org/m"}, "gpu": "cpu", "serving": {"pool": "small", **chat}}
    with pytest.raises(InvalidSpec, match=r"spec.serving.reasoningParser: .*set it as the pool's spec.reasoningParser"):
        validate_spec(member, CONFIG)
    for bad, match in (({"reasoningParser": "granite"}, "reasoningParser"),
                       ({"defaultChatTemplateKwargs": {"messages": []}}, r"defaultChatTemplateKwargs.messages is set "
                                                                         r"by the server itself"),
                       ({"defaultChatTemplateKwargs": {"1st": True}}, r"defaultChatTemplateKwargs.1st is not a name")):
        with pytest.raises(InvalidSpec, match=match):
            validate_spec({"model": {"source": "hf://org/m"}, "gpu": "cpu", "serving": bad}, CONFIG)


def test_deployment_serves_the_artifact_safely():
    s = spec(tensorParallel=2, serving={"replicas": 3, "port": 9000, "drainTimeoutSeconds": 40,
                                         "apiKeySecret": "api-key"})
    version = engine_version(s)
    uri = f"s3://kiln-engines/prod/engines/{version}"
    dep = validate(build_deployment(s, "demo", "ml", version, uri, CONFIG, OWNER))
    c = container(dep)
    assert c["command"] == ["kiln", "serve"] and c["args"][:2] == ["--artifact", uri]
    assert c["args"][c["args"].index("--port") + 1] == "9000"
    assert "--batch-invariant" not in c["args"]
    assert env(dep)["KILN_SERVED_MODEL_NAME"] == "demo"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 1800
    assert c["lifecycle"]["preStop"]["sleep"]["seconds"] == CONFIG.prestop_sleep_seconds
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    pod = dep["spec"]["template"]["spec"]
    # The API key is a read-only file passed with --api-key-file, never an env var.
    assert not any("API_KEY" in e["name"] for e in c["env"])
    assert c["args"][c["args"].index("--api-key-file") + 1] == API_KEY_FILE
    assert {"name": "api-key", "mountPath": API_KEY_FILE.rsplit("/", 1)[0], "readOnly": True} in c["volumeMounts"]
    assert {"name": "api-key", "secret": {"secretName": "api-key", "defaultMode": 0o440, "items": [
        {"key": "KILN_API_KEY", "path": API_KEY_FILE.rsplit("/", 1)[1]}]}} in pod["volumes"]
    assert pod["automountServiceAccountToken"] is False
    assert c["envFrom"] == [{"secretRef": {"name": "kiln-store-ro"}}]
    assert EXPECT_ENV not in env(dep)  # no verified build passed: nothing to expect
    assert pod["terminationGracePeriodSeconds"] == grace_period(s, CONFIG) > 40 + CONFIG.prestop_sleep_seconds
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/tmp", "/var/cache/kiln", "/dev/shm"}
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    assert dep["spec"]["replicas"] == 3
    assert dep["metadata"]["ownerReferences"] == [OWNER]
    assert LABEL_VERSION not in dep["spec"]["selector"]["matchLabels"]
    assert dep["spec"]["template"]["metadata"]["labels"][LABEL_VERSION] == version_label(version)


def test_deployment_tells_pods_which_build_the_operator_verified():
    s = spec(serving={"apiKeySecret": "k"})
    expect = ArtifactExpectation(built_by=BuiltBy.of("kiln:build", "kiln-system/kiln"), content_digest="ab" * 32)
    dep = validate(build_deployment(s, "demo", "ml", "v", "s3://b/engines/v", CONFIG, OWNER, expect))
    assert ArtifactExpectation.model_validate_json(env(dep)[EXPECT_ENV]) == expect
    cfg = OperatorConfig(store_uri="s3://b", store_secret="store-rw", serving_store_secret="store-ro")
    assert container(build_deployment(s, "d", "n", "v", "s3://b/engines/v", cfg))["envFrom"] == [
        {"secretRef": {"name": "store-ro"}}]  # serving only reads: read-only credentials when the admin has them
    assert container(build_job(s, "d", "n", engine_version(s), cfg))["envFrom"] == [
        {"secretRef": {"name": "store-rw"}}]


def test_only_a_version_change_changes_the_pod_template():
    a, b = spec(), spec(serving={"replicas": 4})
    va, vb = engine_version(a), engine_version(b)
    assert va == vb
    ta = build_deployment(a, "demo", "ml", va, "s3://x/engines/" + va, CONFIG)["spec"]["template"]
    tb = build_deployment(b, "demo", "ml", vb, "s3://x/engines/" + vb, CONFIG)["spec"]["template"]
    assert ta == tb
    c = spec(maxSeqLen=8192)
    vc = engine_version(c)
    assert vc != va
    tc = build_deployment(c, "demo", "ml", vc, "s3://x/engines/" + vc, CONFIG)["spec"]["template"]
    assert tc != ta


def test_service_and_pdb():
    s = spec(serving={"replicas": 2, "port": 8080})
    svc = validate(build_service(s, "demo", "ml", OWNER))
    assert svc["spec"]["ports"][0]["port"] == 8080 and svc["spec"]["ports"][0]["targetPort"] == "http"
    assert svc["spec"]["selector"] == build_deployment(
        s, "demo", "ml", "v", "u", CONFIG)["spec"]["selector"]["matchLabels"]
    assert endpoint("demo", "ml", s) == "http://demo.ml.svc:8080/v1"
    pdb = validate(build_pdb(s, "demo", "ml", OWNER))
    assert pdb["spec"]["maxUnavailable"] == 1
    assert build_pdb(spec(serving={"replicas": 1}), "demo", "ml") is None


def test_user_resources_keep_their_values_and_get_gpus():
    s = spec(serving={"resources": {"requests": {"cpu": "8", "memory": "64Gi"}}})
    dep = validate(build_deployment(s, "d", "n", "v1-abc", "s3://b/engines/v1-abc", CONFIG))
    assert container(dep)["resources"] == {"requests": {"cpu": "8", "memory": "64Gi"},
                                           "limits": {"nvidia.com/gpu": 1}}
    assert s.serving.resources == {"requests": {"cpu": "8", "memory": "64Gi"}}  # renderer did not mutate it


def test_config_from_env_parses_and_names_bad_variables():
    cfg = OperatorConfig.from_env({
        "KILN_STORE_URI": "s3://b/p", "KILN_SKU_NODE_LABELS": '{"H100-80GB": {"pool": "h100"}}',
        "KILN_TOLERATIONS": '[{"key": "dedicated", "operator": "Exists"}]', "KILN_HA": "true"})
    assert cfg.node_selector("H100-80GB") == {"pool": "h100"}
    assert cfg.node_selector("L4") == {"nvidia.com/gpu.product": "NVIDIA-L4"}
    assert cfg.node_selector("cpu") == {} and cfg.ha
    s = spec()
    pod = build_job(s, "d", "n", engine_version(s), cfg)["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "h100"} and pod["tolerations"][0]["key"] == "dedicated"
    with pytest.raises(ConfigError, match="KILN_SKU_NODE_LABELS"):
        OperatorConfig.from_env({"KILN_SKU_NODE_LABELS": "{nope"})
    with pytest.raises(ConfigError, match="KILN_BUILD_BACKOFF_LIMIT"):
        OperatorConfig.from_env({"KILN_BUILD_BACKOFF_LIMIT": "many"})


EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_cluster_examples_pass_the_operator_and_render_valid_objects(path: Path):
    if yaml.safe_load(path.read_text())["kind"] == "LLMEnginePool":
        pool = load_pool(path)
        objects = render_pool(pool, pool.metadata.name, "default", CONFIG)
        pdb = ["PodDisruptionBudget"] if pool.spec.replicas >= 2 else []
        assert [o["kind"] for o in objects] == ["ConfigMap", "Deployment", "Service", *pdb, "NetworkPolicy"]
        for obj in objects:
            validate(obj)
        return
    engine = load_manifest(path)
    if engine.spec.model.scheme == "file":  # `kiln up` examples: the operator rejects them by design
        with pytest.raises(InvalidSpec, match="spec.model.source"):
            validate_spec(engine.spec.to_k8s(), CONFIG)
        return
    spec = validate_spec(engine.spec.to_k8s(), CONFIG)
    version = engine_version(spec)
    name, ns = engine.metadata.name, engine.metadata.namespace or "default"
    validate(build_job(spec, name, ns, version, CONFIG))
    workload = build_workload(spec, name, ns, version, f"s3://b/engines/{version}", CONFIG, OWNER)
    if spec.replica_shape.multi_node:  # tests/operator/test_render_lws.py: the LWS CRD's schema
        validate_lws(workload)
        containers = [t["spec"]["containers"][0] for t in workload["spec"]["leaderWorkerTemplate"].values()
                      if isinstance(t, dict)]
    else:
        containers = [container(validate(workload))]
    for c in containers:
        assert c["resources"]["limits"]["nvidia.com/gpu"] == spec.replica_shape.ranks_per_pod
    validate(build_service(spec, name, ns, OWNER))
    if (pdb := build_pdb(spec, name, ns, OWNER)) is not None:
        validate(pdb)


POOL_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pool-cpu.yaml"


def test_kiln_render_prints_a_pool_s_objects_from_the_operator_s_renderer(monkeypatch):
    monkeypatch.setenv("KILN_STORE_URI", "s3://kiln-engines/prod")
    result = CliRunner().invoke(render, ["-f", str(POOL_EXAMPLE), "-n", "ml"])
    assert result.exit_code == 0, result.output
    docs = list(yaml.safe_load_all(result.stdout))
    pool = load_pool(POOL_EXAMPLE)
    assert docs == render_pool(pool, "cpu-pool", "ml", OperatorConfig.from_env())
    assert [(d["kind"], d["metadata"]["name"], d["metadata"]["namespace"]) for d in docs] == [
        ("ConfigMap", "cpu-pool-pool-engines", "ml"), ("Deployment", "cpu-pool-pool", "ml"),
        ("Service", "cpu-pool-pool", "ml"), ("PodDisruptionBudget", "cpu-pool-pool", "ml"),
        ("NetworkPolicy", "cpu-pool-pool", "ml")]
    assert result.stdout.startswith("# the engine list is empty here")
    for doc in docs:
        validate(doc)
    # The pods follow the list: it is mounted as a directory, and the pod template does not carry it.
    template = docs[1]["spec"]["template"]
    assert "engines.json" not in json.dumps(template["metadata"])
    assert {"name": "engines", "configMap": {"name": "cpu-pool-pool-engines"}} in template["spec"]["volumes"]


def test_an_engine_of_a_pool_renders_its_build_job_and_no_workload(tmp_path: Path):
    data = {"apiVersion": "serving.kiln.dev/v1alpha1", "kind": "LLMEngine", "metadata": {"name": "chat"},
            "spec": {"model": {"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct", "revision": "a" * 40},
                     "gpu": "cpu", "dtype": "float32", "serving": {"pool": "cpu-pool"}}}
    path = tmp_path / "chat.yaml"
    path.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(render, ["-f", str(path), "--store", "s3://b/p"])
    assert result.exit_code == 0, result.output
    assert [d["kind"] for d in yaml.safe_load_all(result.stdout)] == ["Job"]
    comments = [line for line in result.stdout.splitlines() if line.startswith("#")]
    assert comments[0].startswith("# spec.serving.pool: cpu-pool: no Deployment, Service")
    assert "ConfigMap cpu-pool-pool-engines" in comments[1]
    # The same engine alone: its own pods, and no comment.
    del data["spec"]["serving"]
    path.write_text(yaml.safe_dump(data))
    alone = CliRunner().invoke(render, ["-f", str(path), "--store", "s3://b/p"])
    assert [d["kind"] for d in yaml.safe_load_all(alone.stdout)][:3] == ["Job", "Deployment", "Service"]
    assert not alone.stdout.startswith("#")
    assert render_objects(load_manifest(data), CONFIG)[0]["kind"] == "Job"


@pytest.mark.parametrize(("change", "header", "line"), [
    ({"memoryBudget": "6 GB"}, "invalid LLMEnginePool manifest", "spec.memoryBudget: must be a Kubernetes quantity"),
    ({"colour": "red"}, "invalid LLMEnginePool manifest", "spec.colour: unknown field"),
    ({"engines": ["a.yaml"]}, "the operator would refuse", "spec.engines: lists manifests for kiln up only"),
    ({"image": "evil.example.com/kiln:1"}, "the operator would refuse", "spec.image"),
    ({"resources": {"limits": {"memory": "8 gigs"}}}, "the operator would refuse",
     "spec.resources.limits.memory '8 gigs' is not a memory quantity"),
])
def test_kiln_render_refuses_a_bad_pool_naming_the_field(tmp_path: Path, change: dict, header: str, line: str):
    data = yaml.safe_load(POOL_EXAMPLE.read_text())
    data["spec"].update(change)
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(render, ["-f", str(path)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"error: {header} {path}" in result.output and f"  {line}" in result.output, result.output
    assert "kind: Deployment" not in result.output


def test_a_pool_s_api_key_guards_every_member_and_a_member_s_own_key_is_refused():
    """The pool's pods check spec.apiKeySecret (a read-only file, as an engine's); a member cannot keep its own key,
    which the pool's pods would not check (it would be served open once it joined)."""
    from kiln.operator.pools import render_pool
    from kiln.operator.validation import InvalidSpec, validate_spec

    data = yaml.safe_load(POOL_EXAMPLE.read_text())
    data["spec"]["apiKeySecret"] = "pool-key"
    deployment = next(o for o in render_pool(data, "small", "ns", CONFIG) if o["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--api-key-file") + 1] == "/var/run/secrets/kiln/api-key/api-key"
    assert {"name": "api-key", "secret": {"secretName": "pool-key", "defaultMode": 0o440,
                                          "items": [{"key": "KILN_API_KEY", "path": "api-key"}]}} in pod["volumes"]
    member = {"model": {"source": "hf://org/m"}, "gpu": "cpu", "serving": {"pool": "small", "apiKeySecret": "k"}}
    with pytest.raises(InvalidSpec, match=r"spec.serving.apiKeySecret: .*set it as the pool's spec.apiKeySecret"):
        validate_spec(member, CONFIG)
    steady = {**member, "serving": {"pool": "small", "batchInvariant": True}}  # the pool's pods say it for all
    with pytest.raises(InvalidSpec, match=r"spec.serving.batchInvariant: .*set it as the pool's spec.batchInvariant"):
        validate_spec(steady, CONFIG)


def test_an_object_is_taken_only_when_another_owner_controls_it_and_an_earlier_one_of_the_same_name_is_adopted():
    from kiln.operator.naming import taken_name

    pool = {"kind": "LLMEnginePool", "metadata": {"name": "shared", "namespace": "ml", "uid": "u-pool"}}
    engine = {"kind": "LLMEngine", "metadata": {"name": "shared-pool", "namespace": "ml", "uid": "u-new"}}

    def deployment(*owners: dict) -> dict:
        return {"kind": "Deployment", "metadata": {"name": "shared-pool", "namespace": "ml",
                                                   "ownerReferences": list(owners)}}

    mine = {"kind": "LLMEngine", "name": "shared-pool", "uid": "u-old", "controller": True}  # deleted, created again
    theirs = {"kind": "LLMEnginePool", "name": "shared", "uid": "u-pool", "controller": True}
    assert taken_name(None, engine) is None and taken_name(deployment(), engine) is None
    assert taken_name(deployment(mine), engine) is None
    assert taken_name(deployment({**theirs, "controller": False}), engine) is None  # not controlled by it
    message = taken_name(deployment(theirs), engine)
    assert message is not None and message.startswith("Deployment ml/shared-pool belongs to LLMEnginePool shared")
    assert "recreate this LLMEngine (or the other) under another name" in message
    assert "belongs to LLMEngine shared-pool" in (taken_name(deployment(mine), pool) or "")
