"""Issue 31, trust and faults, without a cluster: who mounts which key, the engine's NetworkPolicy, serving
credentials, the pinned digest, and which build failures are retried (kiln.operator.keys, .network, .trust,
.retry)."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import kubernetes_validate
import pytest
from kiln.operator.decide import BUILD, REPORT, RETRY, SERVE, Outcome, World, decide, observation
from kiln.operator.jobs import build_job
from kiln.operator.keys import (
    GROUP_TOKEN_ENV,
    LABEL_RANK_GROUP,
    GroupTokenMissing,
    KeyPair,
    ensure_group_token,
    group_token_secret,
    rank_group_label,
    signing_key_copy,
    verify_key_copy,
)
from kiln.operator.kube import ApiError
from kiln.operator.network import build_network_policy
from kiln.operator.render import render_objects
from kiln.operator.retry import STORAGE_EXIT_CODE, Failure, build_step, next_record
from kiln.operator.settings import OperatorConfig
from kiln.operator.status import compose_status
from kiln.operator.trust import expectation, pin_problem, pinned_digest
from kiln.operator.validation import validate_spec
from kiln.operator.workloads import RENDEZVOUS_PORT, build_workload

from kiln.api import LLMEngine
from kiln.artifact_manifest import BuiltBy, Manifest, ManifestFile
from kiln.envelope import engine_version
from kiln.signing import SIGNING_KEY_ENV, VERIFY_KEY_ENV, new_key_pair_pem

K8S_VERSION = "1.31"
CONFIG = OperatorConfig(store_uri="s3://b/p", store_secret="store-rw", serving_store_secret="store-ro")
SINGLE = validate_spec({"model": {"source": "hf://o/m"}, "gpu": "cpu", "serving": {"replicas": 2}}, CONFIG)
MULTI = validate_spec({"model": {"source": "hf://o/big"}, "gpu": "H100-80GB", "dtype": "bfloat16",
                       "tensorParallel": 8, "pipelineParallel": 2}, CONFIG)
NOW = datetime(2026, 1, 1, 12, tzinfo=UTC)


def envs(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env") or []}


def mounts(container: dict) -> dict:
    return {m["name"]: m for m in container.get("volumeMounts") or []}


# -- 1. keys: the private key only where the engine is published, the public key in every serving pod ---------


def test_only_the_publishing_container_mounts_the_private_key():
    job = build_job(SINGLE, "chat", "ml", engine_version(SINGLE), CONFIG)
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    pod = job["spec"]["template"]["spec"]
    (fetch,), (build,) = pod["initContainers"], pod["containers"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "signing-key"]
    assert volume["secret"]["secretName"] == "kiln-build-signing-key"
    assert volume["secret"]["items"] == [{"key": "signing-key.pem", "path": "signing-key.pem"}]
    assert mounts(build)["signing-key"] == {"name": "signing-key", "mountPath": "/var/run/secrets/kiln/signing",
                                            "readOnly": True}
    assert envs(build)[SIGNING_KEY_ENV] == "/var/run/secrets/kiln/signing/signing-key.pem"
    assert "signing-key" not in mounts(fetch) and SIGNING_KEY_ENV not in envs(fetch)  # the model's side: never


@pytest.mark.parametrize("spec", [SINGLE, MULTI], ids=["deployment", "lws"])
def test_every_serving_pod_verifies_with_the_public_key_and_never_sees_the_private_one(spec):
    obj = build_workload(spec, "chat", "ml", "v1", "s3://b/p/engines/v1", CONFIG)
    if obj["kind"] == "Deployment":
        pods = [obj["spec"]["template"]["spec"]]
    else:
        lwt = obj["spec"]["leaderWorkerTemplate"]
        pods = [lwt["leaderTemplate"]["spec"], lwt["workerTemplate"]["spec"]]
    for pod in pods:
        (c,) = pod["containers"]
        assert envs(c)[VERIFY_KEY_ENV] == "/var/run/secrets/kiln/verify/verify-key.pem"
        assert mounts(c)["verify-key"]["readOnly"] is True
        (volume,) = [v for v in pod["volumes"] if v["name"] == "verify-key"]
        assert volume["secret"]["secretName"] == "kiln-verify-key"
        assert SIGNING_KEY_ENV not in envs(c) and "signing-key" not in mounts(c)
        assert c["envFrom"] == [{"secretRef": {"name": "store-ro"}}]  # read-only store credentials


def test_the_key_copies_hold_one_key_each():
    private, public = new_key_pair_pem()
    pair = KeyPair(private, public)
    signing, verify = signing_key_copy("ml", pair), verify_key_copy("ml", pair)
    assert set(signing["data"]) == {"signing-key.pem"} and set(verify["data"]) == {"verify-key.pem"}
    assert (signing["metadata"]["name"], verify["metadata"]["name"]) == ("kiln-build-signing-key", "kiln-verify-key")
    token = group_token_secret("big", "ml", None, "t0k3n")
    assert token["metadata"]["name"] == "big-group-token" and set(token["data"]) == {"token"}
    for obj in (signing, verify, token):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


# -- 3. least privilege: serving pods get no write Secret by default ------------------------------------------


def test_serving_pods_get_no_write_secret_unless_allowed():
    only_write = OperatorConfig(store_uri="s3://b/p", store_secret="store-rw")
    dep = build_workload(SINGLE, "chat", "ml", "v1", "s3://b/p/engines/v1", only_write)
    assert "envFrom" not in dep["spec"]["template"]["spec"]["containers"][0]
    allowed = OperatorConfig(store_uri="s3://b/p", store_secret="store-rw", allow_write_in_serving=True)
    dep = build_workload(SINGLE, "chat", "ml", "v1", "s3://b/p/engines/v1", allowed)
    assert dep["spec"]["template"]["spec"]["containers"][0]["envFrom"] == [{"secretRef": {"name": "store-rw"}}]


# -- 4. ranks: a NetworkPolicy and a group token ---------------------------------------------------------------


def test_a_multi_node_engine_admits_rank_ports_only_from_its_own_pods_and_every_rank_has_the_token():
    group = rank_group_label("t0k3n", "big")
    policy = build_network_policy(MULTI, "big", "ml", rank_group=group)
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": {"serving.kiln.dev/engine": "big"}}
    assert spec["policyTypes"] == ["Ingress"]
    http, ranks = spec["ingress"]
    assert "from" not in http and http["ports"] == [{"protocol": "TCP", "port": 8000}]  # clients, as before
    (peer,) = ranks["from"]
    assert peer == {"podSelector": {"matchLabels": {"serving.kiln.dev/engine": "big", LABEL_RANK_GROUP: group}}}
    assert {"protocol": "TCP", "port": RENDEZVOUS_PORT} in ranks["ports"]
    assert {"protocol": "TCP", "port": 1024, "endPort": 65535} in ranks["ports"]
    lws = build_workload(MULTI, "big", "ml", "v1", "s3://b/p/engines/v1", CONFIG, rank_group=group)
    lwt = lws["spec"]["leaderWorkerTemplate"]
    for template in (lwt["leaderTemplate"], lwt["workerTemplate"]):
        (c,) = template["spec"]["containers"]
        assert envs(c)[GROUP_TOKEN_ENV] == {"secretKeyRef": {"name": "big-group-token", "key": "token"}}
        # the policy's peer selector matches every rank's pod
        assert peer["podSelector"]["matchLabels"].items() <= template["metadata"]["labels"].items()


def test_the_rank_label_is_derived_from_the_token_so_a_pod_s_own_labels_cannot_satisfy_the_policy():
    group = rank_group_label("t0k3n", "big")
    assert re.fullmatch(r"[0-9a-f]{32}", group)  # a valid label value
    # Not a constant: another engine's token, or another engine with the same token, gives another value.
    assert len({group, rank_group_label("other-token", "big"), rank_group_label("t0k3n", "small")}) == 3
    assert rank_group_label("t0k3n", "big") == group  # stable: the pods keep matching across reconciles
    (peer,) = build_network_policy(MULTI, "big", "ml", rank_group=group)["spec"]["ingress"][1]["from"]
    wanted = peer["podSelector"]["matchLabels"]
    # A pod that set the engine's labels (all any pod can know without the token) is not admitted.
    squatter = {"serving.kiln.dev/engine": "big", "app.kubernetes.io/component": "serving-worker"}
    assert not wanted.items() <= squatter.items()
    # Without the value the policy admits no pod to the rank ports (closed, not open).
    assert len(build_network_policy(MULTI, "big", "ml")["spec"]["ingress"]) == 1


def test_a_single_pod_engine_opens_only_its_serving_port():
    policy = build_network_policy(SINGLE, "chat", "ml")
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    assert policy["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8000}]}]
    dep = build_workload(SINGLE, "chat", "ml", "v1", "s3://b/p/engines/v1", CONFIG)
    assert GROUP_TOKEN_ENV not in envs(dep["spec"]["template"]["spec"]["containers"][0])


@pytest.mark.parametrize("spec", [SINGLE, MULTI], ids=["single-pod", "multi-node"])
def test_kiln_render_shows_the_network_policy(spec):
    engine = LLMEngine.model_validate({"apiVersion": "serving.kiln.dev/v1alpha1", "kind": "LLMEngine",
                                       "metadata": {"name": "eng", "namespace": "ml"}, "spec": spec.to_k8s()})
    objects = render_objects(engine, CONFIG)
    (policy,) = [o for o in objects if o["kind"] == "NetworkPolicy"]
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    assert policy["spec"]["podSelector"]["matchLabels"] == {"serving.kiln.dev/engine": "eng"}
    off = OperatorConfig(store_uri="s3://b/p", network_policy=False)
    assert not [o for o in render_objects(engine, off) if o["kind"] == "NetworkPolicy"]


# -- 2. the digest is pinned when the build finishes, never re-read from the store -----------------------------


def manifest(weights: bytes = b"w") -> Manifest:
    files = [ManifestFile(path="weights.bin", sha256=(weights.hex() * 64)[:64], size=len(weights))]
    return Manifest(engine_version=engine_version(SINGLE), created_at=NOW, upload_id="u", envelope={},
                    files=files, total_size=len(weights), content_digest=Manifest.digest_of(files),
                    built_by=BuiltBy.of("ghcr.io/kiln-dev/kiln:0.1.0", CONFIG.operator_id))


def world(status: dict, **fields) -> World:
    version = engine_version(SINGLE)
    body = {"metadata": {"name": "chat", "namespace": "ml", "generation": 3, "resourceVersion": "9"},
            "status": status}
    fields.setdefault("now", NOW)
    return World(body, spec=SINGLE, version=version, artifact_uri=f"s3://b/p/engines/{version}", **fields)


def test_the_first_served_build_is_pinned_and_a_rewritten_manifest_is_not_the_pin():
    built, rewritten = manifest(b"original"), manifest(b"rewritten")
    version = engine_version(SINGLE)
    building = world({"phase": "Building", "artifact": {"engineVersion": version}})
    assert pinned_digest(building.old, version) is None  # the build's output is pinned when it appears
    served = world({"phase": "Building", "artifact": {"engineVersion": version}}, manifest=built)
    status = compose_status(observation(served, decide(served), Outcome(), CONFIG))
    assert status["artifact"] == {"engineVersion": version, "contentDigest": built.content_digest}
    assert status["history"][0]["contentDigest"] == built.content_digest
    pinned = pinned_digest(status, version)
    assert pinned == built.content_digest and pin_problem(built, pinned) is None
    assert "changed after this operator pinned" in pin_problem(rewritten, pinned)
    assert expectation(rewritten, pinned).content_digest == built.content_digest
    # A revert to a version served before uses the history's pin.
    later = {**status, "artifact": {"engineVersion": "other", "contentDigest": "x"}}
    assert pinned_digest(later, version) == built.content_digest
    # The untrusted report keeps the pin (the next reconcile must not pin the rewritten manifest).
    untrusted = world(status, manifest=rewritten, untrusted=pin_problem(rewritten, pinned))
    assert decide(untrusted).step == REPORT
    report = compose_status(observation(untrusted, decide(untrusted), Outcome(), CONFIG))
    assert report["artifact"] == status["artifact"] and report["conditions"][0]["reason"] == "ArtifactUntrusted"


# -- 5. transient build failures are retried with backoff; permanent ones wait for a spec change ------------


def failed_job(uid: str, reason: str = "BackoffLimitExceeded") -> dict:
    return {"metadata": {"name": "kiln-build-x", "uid": uid},
            "status": {"conditions": [{"type": "Failed", "status": "True", "reason": reason}]}}


def test_a_storage_error_is_retried_with_backoff_until_the_attempts_run_out():
    config = OperatorConfig(store_uri="s3://b/p", build_retries=2, build_retry_delay_seconds=60)
    version, storage = engine_version(SINGLE), Failure("StorageError: S3 503", STORAGE_EXIT_CODE)
    record = next_record(None, version, {"metadata": {"uid": "a"}}, Failure(), 3, NOW, "j", config)
    assert record["attempts"] == 1 and record["jobUID"] == "a"
    delays = []
    for uid in "abc":
        record = next_record(record, version, failed_job(uid), storage, 3, NOW, "j", config)
        if record.get("failedGeneration") is not None:
            break
        retry_at = datetime.fromisoformat(record["retryAt"].replace("Z", "+00:00"))
        delays.append((retry_at - NOW).total_seconds())
        assert build_step(record, failed_job(uid), 3, NOW) == "wait"  # not due yet
        assert build_step(record, None, 3, NOW) == "wait"  # the Job expired: still not before retryAt
        assert build_step(record, failed_job(uid), 3, retry_at + timedelta(seconds=1)) == "retry"
        record = next_record(record, version, {"metadata": {"uid": chr(ord(uid) + 1)}}, Failure(), 3, NOW, "j",
                             config)  # the retry's new Job
    assert delays == [60, 120]
    assert record["attempts"] == 3 and record["failure"] == "StorageError" and record["failedGeneration"] == 3
    assert build_step(record, failed_job("c"), 3, NOW + timedelta(days=2)) == "wait"  # out of attempts


@pytest.mark.parametrize("failure, reason", [(Failure("InvalidSpec: bad", 2), "BackoffLimitExceeded"),
                                             (Failure("FetchError: 404", 5), "BackoffLimitExceeded"),
                                             (Failure("StorageError: slow", STORAGE_EXIT_CODE), "DeadlineExceeded")])
def test_a_permanent_failure_never_rebuilds_unasked(failure, reason):
    version = engine_version(SINGLE)
    record = next_record(None, version, failed_job("a", reason), failure, 3, NOW, "j", CONFIG)
    assert record["failedGeneration"] == 3 and record.get("retryAt") is None
    w = world({"phase": "Failed", "build": record}, job=failed_job("a", reason), failure=failure)
    assert decide(w).step == REPORT
    expired = world({"phase": "Failed", "build": record}, now=NOW + timedelta(days=2))  # the Job's TTL passed
    assert decide(expired).step == REPORT  # before: BUILD, a rebuild nobody asked for
    status = compose_status(observation(expired, decide(expired), Outcome(), CONFIG))
    assert status["phase"] == "Failed" and status["conditions"][0]["reason"] == "BuildFailed"
    assert status["build"] == record
    edited = World({**w.body, "metadata": {**w.body["metadata"], "generation": 4}}, spec=SINGLE, version=version,
                   artifact_uri=w.artifact_uri, now=NOW, job=failed_job("a", reason), failure=failure)
    assert decide(edited).step == RETRY  # the spec changed: the failed Job goes, a new one starts
    gone = World(edited.body, spec=SINGLE, version=version, artifact_uri=w.artifact_uri, now=NOW)
    assert decide(gone).step == BUILD
    fresh = next_record(record, version, {"metadata": {"uid": "b"}}, Failure(), 4, NOW, "j", CONFIG)
    assert fresh["attempts"] == 1 and fresh.get("failedGeneration") is None


def test_a_retry_reports_building_with_when():
    failure = Failure("StorageError: S3 503 SlowDown", STORAGE_EXIT_CODE)
    w = world({"phase": "Building"}, job=failed_job("a"), failure=failure)
    assert decide(w).step == REPORT
    status = compose_status(observation(w, decide(w), Outcome(), CONFIG))
    assert status["phase"] == "Building" and [c["reason"] for c in status["conditions"]] == ["BuildRetrying"] * 2
    assert "S3 503 SlowDown" in status["conditions"][0]["message"] and "attempt 2 starts at" in \
        status["conditions"][0]["message"]
    due = world({"phase": "Building", "build": status["build"]}, job=failed_job("a"), failure=failure,
                now=NOW + timedelta(minutes=2))
    assert decide(due).step == RETRY
    assert decide(world({}, manifest=manifest())).step == SERVE


class TokenKube:
    """The API as ensure_group_token sees it: the token Secret exists already, holding ``data``."""

    def __init__(self, data: dict) -> None:
        self.data = data

    async def create(self, path: str, body: dict) -> dict:
        raise ApiError(409, "AlreadyExists", "exists")

    async def get(self, path: str) -> dict:
        return {"data": self.data}


def test_the_group_token_is_read_back_when_it_exists_and_a_broken_one_names_the_secret():
    import asyncio
    import base64

    kept = asyncio.run(ensure_group_token(TokenKube({"token": base64.b64encode(b"t0k3n").decode()}), "big", "ml", {}))
    assert kept == "t0k3n"  # the value the pods read, so the label they carry is rank_group_label("t0k3n", "big")
    with pytest.raises(GroupTokenMissing, match=r"^Secret ml/big-group-token has no key 'token'; delete it"):
        asyncio.run(ensure_group_token(TokenKube({}), "big", "ml", {}))


def test_a_broken_group_token_is_counted_as_its_own_kind_of_error(monkeypatch):
    import asyncio
    import logging

    import kopf
    from kiln.operator import handlers, metrics

    async def broken(*_):
        raise GroupTokenMissing("Secret ml/big-group-token has no key 'token'")

    monkeypatch.setattr(handlers, "reconcile", broken)
    counts = {k: metrics.RECONCILE_ERRORS.labels(kind=k)._value.get() for k in ("group-token", "signing-key")}
    memo = kopf.Memo(ctx=None)
    with pytest.raises(kopf.TemporaryError, match="^group token: Secret ml/big-group-token"):
        asyncio.run(handlers._reconcile("ml", "big", memo, logging.getLogger("test")))
    assert metrics.RECONCILE_ERRORS.labels(kind="group-token")._value.get() == counts["group-token"] + 1
    assert metrics.RECONCILE_ERRORS.labels(kind="signing-key")._value.get() == counts["signing-key"]
