"""Issue 31 end to end (kopf against the emulator, store on moto): the operator's keys and the Secrets and
NetworkPolicy it writes, a digest pinned at build completion, and transient against permanent build failures."""

from __future__ import annotations

import base64
import time

import pytest
from conftest import OPERATOR_NS, wait_for
from harness import DEPLOYMENTS, ENGINES, JOBS, NS, SPEC, Cluster, manifest, running_operator

from kiln.artifact_manifest import BUILT_BY_ENV, EXPECT_ENV, ArtifactExpectation, BuiltBy
from kiln.signing import SIGNING_KEY_ENV, VERIFY_KEY_ENV, Signer, Verifier

pytestmark = pytest.mark.timeout(120)
SECRETS = f"/api/v1/namespaces/{NS}/secrets"
POLICIES = f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies"


def expected_digest(c: Cluster, name: str) -> str | None:
    (serve,) = c.deployment(name)["spec"]["template"]["spec"]["containers"]
    value = next(e["value"] for e in serve["env"] if e["name"] == EXPECT_ENV)
    return ArtifactExpectation.model_validate_json(value).content_digest


def ready(c: Cluster, name: str) -> str:
    version = c.build(c.wait_job(), SPEC)
    wait_for(lambda: c.template_version(name) == version, what="the Deployment of the new version")
    c.roll_out(name)
    c.wait_status(name, "Ready", phase="Ready", servingVersion=version)
    return version


def test_a_private_key_an_older_operator_copied_into_the_engine_namespace_is_deleted(cluster: Cluster):
    c = cluster
    c.kube.create(SECRETS, {"metadata": {"name": "kiln-build-signing-key"}, "data": {"signing-key.pem": "b2xk"}})
    with running_operator():
        c.kube.create(ENGINES, manifest("demo"))
        ready(c, "demo")
        wait_for(lambda: c.kube.get(f"{SECRETS}/kiln-build-signing-key") is None, what="the stale copy deleted")


def test_the_stale_private_key_is_deleted_whatever_the_engine_s_step(cluster: Cluster):
    """An engine that fails validation, or is still building, never reaches the serve step: the copy goes anyway."""
    c = cluster
    stale = {"metadata": {"name": "kiln-build-signing-key"}, "data": {"signing-key.pem": "b2xk"}}
    c.kube.create(SECRETS, stale)
    with running_operator():
        c.kube.create(ENGINES, manifest("broken", **{**SPEC, "gpu": "no-such-gpu"}))
        wait_for(lambda: c.kube.get(f"{SECRETS}/kiln-build-signing-key") is None, what="the copy deleted (invalid)")
    c.kube.delete(f"{ENGINES}/broken")
    c.kube.create(SECRETS, stale)
    with running_operator():  # a new process: the namespace is not known to be clean
        c.kube.create(ENGINES, manifest("demo"))
        c.wait_job()
        wait_for(lambda: c.kube.get(f"{SECRETS}/kiln-build-signing-key") is None, what="the copy deleted (building)")


def test_model_credentials_are_copied_to_the_build_and_go_with_its_job(cluster: Cluster):
    c = cluster
    spec = {**SPEC, "model": {**SPEC["model"], "credentialsSecret": "hf-token"}}
    with running_operator():
        c.kube.create(ENGINES, manifest("demo", **spec))
        job = c.wait_job()
        (fetch,) = job["spec"]["template"]["spec"]["initContainers"]
        assert fetch["envFrom"] == [{"secretRef": {"name": "kiln-cred-ml.hf-token"}}]
        time.sleep(1)  # the Secret does not exist yet: the pod waits, nothing is copied, no error
        assert c.kube.get(f"/api/v1/namespaces/{OPERATOR_NS}/secrets/kiln-cred-ml.hf-token") is None
        c.kube.create(SECRETS, {"metadata": {"name": "hf-token"}, "data": {"HF_TOKEN": "aGY="}})
        copy = wait_for(lambda: c.kube.get(f"/api/v1/namespaces/{OPERATOR_NS}/secrets/kiln-cred-ml.hf-token"),
                        what="the credentials copied next to the Job")
        assert copy["data"] == {"HF_TOKEN": "aGY="}
        assert [r["uid"] for r in copy["metadata"]["ownerReferences"]] == [job["metadata"]["uid"]]



def test_without_copy_credentials_the_condition_names_the_secret_to_create(cluster: Cluster, monkeypatch):
    """build.copyCredentials false (a cluster-wide install without get on Secrets): nothing of the engine's namespace
    is read; the Built condition names the copy to create in the jobs namespace, and the build uses it once there."""
    c = cluster
    monkeypatch.setenv("KILN_COPY_CREDENTIALS", "false")
    spec = {**SPEC, "model": {**SPEC["model"], "credentialsSecret": "hf-token"}}
    c.kube.create(SECRETS, {"metadata": {"name": "hf-token"}, "data": {"HF_TOKEN": "aGY="}})
    copy_path = f"/api/v1/namespaces/{OPERATOR_NS}/secrets/kiln-cred-ml.hf-token"
    with running_operator():
        c.kube.create(ENGINES, manifest("demo", **spec))
        c.wait_job()
        built = wait_for(lambda: (b := c.condition("demo", "Built")) and "kiln-cred-ml.hf-token" in b["message"] and b,
                         what="the condition naming the Secret to create")
        assert "build.copyCredentials" in built["message"] and "hf-token" in built["message"]
        time.sleep(1)
        assert c.kube.get(copy_path) is None  # never copied
        c.kube.create(f"/api/v1/namespaces/{OPERATOR_NS}/secrets",
                      {"metadata": {"name": "kiln-cred-ml.hf-token"}, "data": {"HF_TOKEN": "aGY="}})
        wait_for(lambda: "waits for its credentials" not in c.condition("demo", "Built")["message"],
                 what="the condition clear once the Secret is there")


def test_the_operator_makes_its_key_pair_and_gives_each_pod_only_its_half(cluster: Cluster, tmp_path):
    c = cluster
    with running_operator():
        c.kube.create(ENGINES, manifest("demo"))
        job = c.wait_job()
        pair = wait_for(lambda: c.kube.get(f"/api/v1/namespaces/{OPERATOR_NS}/secrets/kiln-signing-key"),
                        what="the key pair Secret in the operator's namespace")
        private = base64.b64decode(pair["data"]["signing-key.pem"])
        public = base64.b64decode(pair["data"]["verify-key.pem"])
        # The private key lives only where builds run: the Job and its key copy are in the operator's namespace.
        assert job["metadata"]["namespace"] == OPERATOR_NS
        assert job["metadata"]["annotations"]["serving.kiln.dev/requested-by"] == f"{NS}/demo"  # who asked
        build_copy = c.kube.get(f"/api/v1/namespaces/{OPERATOR_NS}/secrets/kiln-build-signing-key")
        assert build_copy["data"] == {"signing-key.pem": pair["data"]["signing-key.pem"]}
        pod = job["spec"]["template"]["spec"]
        (fetch,), (build,) = pod["initContainers"], pod["containers"]
        assert SIGNING_KEY_ENV in {e["name"] for e in build["env"]}
        assert SIGNING_KEY_ENV not in {e["name"] for e in fetch["env"]}
        ready(c, "demo")
        verify_copy = c.kube.get(f"{SECRETS}/kiln-verify-key")
        assert verify_copy["data"] == {"verify-key.pem": pair["data"]["verify-key.pem"]}
        # No Secret of the engine's namespace holds the private key, under any name.
        private_b64 = pair["data"]["signing-key.pem"]
        assert not [s for s in c.kube.list(SECRETS) if private_b64 in (s.get("data") or {}).values()]
        pod_secrets = {v["secret"]["secretName"] for v in c.deployment("demo")["spec"]["template"]["spec"]["volumes"]
                       if "secret" in v}
        assert pod_secrets <= {"kiln-verify-key"}  # serving pods name the verify key, never a signing key
        (serve,) = c.deployment("demo")["spec"]["template"]["spec"]["containers"]
        assert VERIFY_KEY_ENV in {e["name"] for e in serve["env"]} and "envFrom" in serve
        assert serve["envFrom"] == [{"secretRef": {"name": "kiln-store-ro"}}]  # never the write Secret
        policy = c.kube.get(f"{POLICIES}/demo")
        assert policy["spec"]["podSelector"] == {"matchLabels": {"serving.kiln.dev/engine": "demo"}}
    # The pair is a real one: what the build signs, the serving pods verify.
    (tmp_path / "k.pem").write_bytes(private)
    (tmp_path / "k.pub").write_bytes(public)
    document = {"engine_version": "x", "files": []}
    signed = {**document, "signature": Signer.from_pem(tmp_path / "k.pem").sign(document)}
    assert Verifier.from_pem(tmp_path / "k.pub").problem(signed) is None
    # A restarted operator reuses the pair: no second one.
    with running_operator():
        time.sleep(1)
        again = c.kube.get(f"/api/v1/namespaces/{OPERATOR_NS}/secrets/kiln-signing-key")
        assert again["data"] == pair["data"]


def test_a_consistent_rewrite_of_the_store_is_not_re_pinned_nor_rolled_out(cluster: Cluster):
    c = cluster
    with running_operator():
        c.kube.create(ENGINES, manifest("demo"))
        version = ready(c, "demo")
        pinned = c.store.read_manifest(version).content_digest
        assert c.status("demo")["artifact"] == {"engineVersion": version, "contentDigest": pinned}
        assert expected_digest(c, "demo") == pinned
        # Someone with the store's write credentials republishes the version: other weights, a consistent
        # manifest, even this operator's own built_by and signature (a leaked signing key).
        built_by = c.store.read_manifest(version).built_by
        c.store.delete(version)
        time.sleep(0.8)  # reconciles while the version is missing: the pin must survive them (the Job is the same)
        (c.tmp / f"artifact-{version}" / "weights" / "rank-0-of-1.safetensors").write_bytes(b"evil" * 64)
        src = c.tmp / f"artifact-{version}"
        from kiln.api import LLMEngineSpec
        from kiln.envelope import build_envelope

        c.store.publish(version, src, build_envelope(LLMEngineSpec.model_validate(SPEC)),
                        built_by=BuiltBy.model_validate(built_by.model_dump()), signer=c.signer())
        assert c.store.read_manifest(version).content_digest != pinned
        wait_for(lambda: c.condition("demo", "Built").get("reason") == "ArtifactUntrusted", what="ArtifactUntrusted")
        built = c.condition("demo", "Built")
        assert built["reason"] == "ArtifactUntrusted" and "changed after this operator pinned" in built["message"]
        time.sleep(1)  # several reconciles: the pods keep the pinned expectation, the pin stays
        assert expected_digest(c, "demo") == pinned
        assert c.status("demo")["artifact"]["contentDigest"] == pinned
        assert c.status("demo")["servingVersion"] == version  # the running pods keep serving


def test_a_storage_error_is_retried_and_a_permanent_failure_is_not(cluster: Cluster):
    c = cluster
    with running_operator():
        c.kube.create(ENGINES, manifest("demo"))
        first = c.wait_job()
        c.fail(first, "StorageError: s3://kiln: 503 SlowDown", exit_code=3)
        c.wait_status("demo", "retrying", phase="Building")
        second = wait_for(lambda: next((j for j in c.jobs() if j["metadata"]["uid"] != first["metadata"]["uid"]),
                                       None), what="the retry's new Job")
        assert len(c.jobs()) == 1  # the failed Job went first
        wait_for(lambda: (c.status("demo").get("build") or {}).get("attempts") == 2, what="attempt 2 recorded")
        # The second attempt fails for good: a fetch error is not retried.
        c.fail(second, "FetchError: s3://models/llama-tiny: no config.json", exit_code=5)
        c.wait_status("demo", "Failed", phase="Failed")
        record = c.status("demo")["build"]
        assert record["failedGeneration"] == 1 and record["failure"] == "BackoffLimitExceeded"
        assert "no config.json" in c.condition("demo", "Built")["message"]
        # The Job's TTL runs out: before, the next reconcile rebuilt it unasked.
        c.kube.delete(f"{JOBS}/{second['metadata']['name']}")
        time.sleep(1.5)
        assert c.jobs() == [] and c.status("demo")["phase"] == "Failed"
        # A spec edit asks again.
        c.kube.patch(f"{ENGINES}/demo", {"spec": {"serving": {**SPEC["serving"], "replicas": 1}}})
        third = c.wait_job()
        assert third["metadata"]["uid"] not in {first["metadata"]["uid"], second["metadata"]["uid"]}
        wait_for(lambda: (c.status("demo").get("build") or {}).get("attempts") == 1, what="attempts start over")
        assert c.kube.list(DEPLOYMENTS) == []


def test_a_cache_hit_compares_the_whole_envelope(cluster: Cluster):
    """Issue 38, Med 5: a manifest under this spec's version whose envelope is another spec's (a ground 48-bit
    prefix collision, signed by the operator's own key) is not served: ArtifactUntrusted naming the field."""
    c = cluster
    with running_operator():
        c.kube.create(ENGINES, manifest("demo"))
        c.build(c.wait_job(), {**SPEC, "dtype": "bfloat16"})  # the Job's version, another spec's envelope
        wait_for(lambda: c.condition("demo", "Built").get("reason") == "ArtifactUntrusted", what="ArtifactUntrusted")
        message = c.condition("demo", "Built")["message"]
        assert "envelope's dtype is 'bfloat16' where this spec's is 'float32'" in message and "kiln cache rm" in message
        assert c.deployment("demo") is None and "contentDigest" not in (c.status("demo").get("artifact") or {})  # nothing pinned, nothing served


@pytest.mark.parametrize("signed", ["unsigned", "another key"])
def test_a_manifest_not_signed_by_the_operators_key_is_never_pinned(signed, cluster: Cluster, tmp_path):
    """Issue 38, Med 4: the operator verifies the signature before it pins anything (a store writer's squat of
    a version, with this operator's own built_by)."""
    c = cluster
    other = None
    if signed == "another key":
        from kiln.signing import generate_key_pair

        other = Signer.from_pem(generate_key_pair(tmp_path)[0])
    with running_operator():
        c.kube.create(ENGINES, manifest("demo"))
        job = c.wait_job()
        version = job["metadata"]["annotations"]["serving.kiln.dev/engine-version"]  # the full version (a label is bounded)
        env = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
        src = c.tmp / "squat"
        src.mkdir()
        (src / "engine.json").write_text("{}")
        from kiln.api import LLMEngineSpec
        from kiln.envelope import build_envelope

        c.store.publish(version, src, build_envelope(LLMEngineSpec.model_validate(SPEC)),
                        built_by=BuiltBy.model_validate_json(env[BUILT_BY_ENV]), signer=other)
        wait_for(lambda: c.condition("demo", "Built").get("reason") == "ArtifactUntrusted", what="ArtifactUntrusted")
        message = c.condition("demo", "Built")["message"]
        assert ("is not signed" if other is None else "not by the verify key") in message, message
        assert "serves only what its own key signed" in message
        assert c.deployment("demo") is None and "contentDigest" not in (c.status("demo").get("artifact") or {})
