"""The reconcile's decisions as pure functions (kiln.operator.decide): every branch, without a cluster."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime, timedelta

import pytest
from kiln.operator.adapters import AdapterView
from kiln.operator.context import Context
from kiln.operator.decide import (
    BUILD,
    DELETE_LWS,
    REPORT,
    SCALE_DOWN_DEPLOYMENT,
    SERVE,
    Outcome,
    World,
    awaits_new_pods,
    decide,
    finished_build,
    lws_missing_message,
    observation,
    retirement,
    retirements,
    serving_now,
)
from kiln.operator.keys import KeyPair
from kiln.operator.reconcile import serve
from kiln.operator.retry import Failure
from kiln.operator.settings import OperatorConfig
from kiln.operator.status import JobState, compose_status, transitions
from kiln.operator.validation import validate_spec

from kiln.artifact_manifest import BuiltBy, Manifest, ManifestFile
from kiln.envelope import adapter_version, engine_version

NOW = "2026-01-01T00:00:00Z"
CONFIG = OperatorConfig(store_uri="s3://b/p")
SINGLE = validate_spec({"model": {"source": "hf://o/m"}, "gpu": "cpu", "serving": {"replicas": 2}}, CONFIG)
MULTI = validate_spec({"model": {"source": "hf://o/big"}, "gpu": "H100-80GB", "dtype": "bfloat16",
                       "tensorParallel": 8, "pipelineParallel": 2}, CONFIG)
VERSION = engine_version(SINGLE)
URI = f"s3://b/p/engines/{VERSION}"
BUILT_AT = datetime(2026, 1, 1, 12, tzinfo=UTC)


def manifest() -> Manifest:
    files = [ManifestFile(path="engine.json", sha256="c" * 64, size=3)]
    return Manifest(engine_version=VERSION, created_at=BUILT_AT, upload_id="u", envelope={}, files=files,
                    total_size=3, content_digest=Manifest.digest_of(files),
                    built_by=BuiltBy.of("ghcr.io/kiln-dev/kiln:0.1.0", CONFIG.operator_id))


def body(status: dict | None = None) -> dict:
    return {"metadata": {"name": "chat", "namespace": "ml", "generation": 4, "resourceVersion": "9"},
            "status": status or {}}


def world(status: dict | None = None, spec=SINGLE, **fields) -> World:
    version = engine_version(spec)
    return World(body(status), spec=spec, version=version, artifact_uri=f"s3://b/p/engines/{version}", **fields)


def workload(version: str, replicas: int = 2, complete: bool = True, kind: str = "Deployment") -> dict:
    template = {"metadata": {"annotations": {"serving.kiln.dev/engine-version": version}}}
    spec = {"replicas": replicas, "template": template} if kind == "Deployment" else {
        "replicas": replicas, "leaderWorkerTemplate": {"leaderTemplate": template}}
    ready = replicas if complete else 0
    return {"kind": kind, "metadata": {"generation": 1}, "spec": spec,
            "status": {"observedGeneration": 1, "updatedReplicas": ready, "availableReplicas": ready,
                       "readyReplicas": ready, "replicas": replicas}}


def job(state: str = "running") -> dict:
    conditions = {"running": [], "failed": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}],
                  "succeeded": [{"type": "Complete", "status": "True"}]}[state]
    return {"metadata": {"name": f"kiln-build-{VERSION}"},
            "status": {"conditions": conditions, "startTime": "2026-01-01T00:00:00Z",
                       "completionTime": "2026-01-01T00:10:00Z"}}


def status_of(w: World, outcome: Outcome) -> dict:
    return compose_status(observation(w, decide(w), outcome, CONFIG), now=NOW)


def reasons(status: dict) -> list[str]:
    return [c["reason"] for c in status["conditions"]]


# -- decide: one step per world ------------------------------------------------------------------------------


def test_an_invalid_spec_only_reports():
    w = World(body({"servingVersion": "old"}), invalid="spec.gpu: unknown")
    assert decide(w).step == REPORT and decide(w).warning is None and decide(w).cache is None
    status = status_of(w, Outcome())
    assert status["phase"] == "Failed" and reasons(status) == ["InvalidSpec", "InvalidSpec"]
    assert status["engineVersion"] is None and status["servingVersion"] == "old"
    assert status["conditions"][1]["message"] == "spec.gpu: unknown; old keeps serving"


def test_a_multi_node_engine_without_the_lws_api_reports_and_warns_once():
    entering = world({"phase": "Ready"}, spec=MULTI, lws_served=False)
    plan = decide(entering)
    assert plan.step == REPORT and plan.warning == lws_missing_message(MULTI) and plan.cache is None
    assert decide(world({"phase": "Failed"}, spec=MULTI, lws_served=False)).warning is None
    assert "LeaderWorkerSet" in plan.warning and "pipelineParallel 2" in plan.warning
    # The Deployment of the single-node shape it had keeps serving meanwhile.
    status = status_of(entering, Outcome(deployment=workload("v1"), lws=None))
    assert reasons(status) == ["LeaderWorkerSetMissing"] * 2 and status["phase"] == "Failed"


@pytest.mark.parametrize("status,warns", [
    ({"phase": "Ready", "engineVersion": VERSION}, True),  # entering the failure
    ({"phase": "Failed", "engineVersion": "older"}, True),  # a new version, untrusted
    ({"phase": "Failed", "engineVersion": VERSION}, False),  # already said
])
def test_an_untrusted_artifact_is_neither_served_nor_rebuilt(status, warns):
    w = world(status, manifest=manifest(), untrusted="it was built through operator 'x'")
    plan = decide(w)
    assert plan.step == REPORT and plan.cache is None
    assert (plan.warning == f"{URI}: not serving it: it was built through operator 'x'") if warns else \
        plan.warning is None
    composed = status_of(w, Outcome())
    assert reasons(composed) == ["ArtifactUntrusted"] * 2 and f"kiln cache rm {VERSION}" in \
        composed["conditions"][0]["message"]


@pytest.mark.parametrize("status,cache", [({}, "miss"), ({"engineVersion": "older"}, "miss"),
                                          ({"engineVersion": VERSION, "phase": "Building"}, None)])
def test_no_artifact_builds_and_counts_a_miss_for_a_new_version(status, cache):
    plan = decide(world(status))
    assert (plan.step, plan.cache, plan.warning) == (BUILD, cache, None)


@pytest.mark.parametrize("status,cache", [
    ({}, "hit"), ({"engineVersion": "older", "phase": "Ready"}, "hit"),
    ({"engineVersion": VERSION, "phase": "Building"}, None),  # its own build just published it: no hit
    ({"engineVersion": "older", "phase": "Building"}, None),
    ({"engineVersion": VERSION, "phase": "Ready"}, None),  # already known
])
def test_a_trusted_artifact_is_served_and_counts_a_hit_when_newly_wanted(status, cache):
    plan = decide(world(status, manifest=manifest()))
    assert (plan.step, plan.cache, plan.warning) == (SERVE, cache, None)


# -- observation: the status each step's outcome composes ----------------------------------------------------


def test_a_build_in_progress_and_a_failed_one():
    w = world({"servingVersion": "v1"}, deployment=workload("v1"))
    running = status_of(w, Outcome(deployment=workload("v1"), job=job()))
    assert running["phase"] == "Building" and running["servingVersion"] == "v1"
    assert running["conditions"][1]["message"] == f"waiting for {VERSION} to build; v1 keeps serving"
    w_failed = world({"servingVersion": "v1"}, deployment=workload("v1"), job=job("failed"),
                     failure=Failure("OOM", 137))
    failed = status_of(w_failed, Outcome(deployment=workload("v1")))
    assert failed["phase"] == "Failed" and reasons(failed) == ["BuildFailed"] * 2
    assert failed["conditions"][0]["message"].endswith("builder said: OOM")
    lost = status_of(w, Outcome(job=job("succeeded")))
    assert reasons(lost) == ["ArtifactMissing"] * 2 and lost["servingVersion"] is None


def test_serving_adds_the_version_to_history_and_reports_the_rollout():
    old = {"servingVersion": "v1", "history": [{"engineVersion": "v1"}]}
    w = world(old, manifest=manifest())
    rolling = status_of(w, Outcome(deployment=workload(VERSION, complete=False)))
    assert rolling["history"] == [{"engineVersion": VERSION, "artifactURI": URI, "builtAt": "2026-01-01T12:00:00Z",
                                   "contentDigest": manifest().content_digest}, {"engineVersion": "v1"}]
    assert rolling["phase"] == "Deploying" and reasons(rolling) == ["ArtifactAvailable", "RollingOut"]
    precise = world(old, manifest=manifest().model_copy(update={"created_at": BUILT_AT.replace(microsecond=123456)}))
    assert status_of(precise, Outcome(deployment=workload(VERSION)))["history"][0]["builtAt"] == \
        "2026-01-01T12:00:00Z"  # whole seconds, as the API server writes its own timestamps
    assert rolling["replicas"] == {"desired": 2, "current": 2, "ready": 0, "updated": 0, "owner": "operator"}
    done = status_of(w, Outcome(deployment=workload(VERSION)))
    assert done["phase"] == "Ready" and done["servingVersion"] == VERSION and done["endpoint"].endswith("/v1")
    pending = {"metadata": {"name": "chat-x"}, "status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes: Too many pods"}]}}
    stuck = status_of(w, Outcome(deployment=workload(VERSION, complete=False), new_pods=[pending]))
    assert reasons(stuck) == ["ArtifactAvailable", "Unschedulable"] and "chat-x" in stuck["conditions"][1]["message"]
    missing = status_of(w, Outcome(deployment=workload("v1"), prerequisite="spec.serving.autoscaling needs KEDA"))
    assert missing["phase"] == "Failed" and missing["conditions"][1]["message"] == \
        "spec.serving.autoscaling needs KEDA; v1 keeps serving"


# -- the smaller decisions -----------------------------------------------------------------------------------


def test_serving_now_follows_the_wanted_kind_and_keeps_the_previous_version_while_pods_run():
    assert serving_now(SINGLE, workload("v2"), None, "v1") == "v2"
    assert serving_now(SINGLE, workload("v2", complete=False), None, "v1") == "v1"
    assert serving_now(SINGLE, None, None, "v1") is None  # nothing runs
    assert serving_now(SINGLE, workload("v2", replicas=0), None, "v1") is None  # scaled to zero
    lws = workload("v2", kind="LeaderWorkerSet")
    assert serving_now(MULTI, workload("v1"), lws, "v1") == "v2"
    assert serving_now(MULTI, workload("v1"), None, "v1") == "v1"  # the old Deployment serves until the LWS does
    assert serving_now(SINGLE, None, lws, "v1") == "v1"  # and the other way round


def test_the_other_workload_kind_retires_once_the_wanted_one_has_rolled_out():
    lws, deployment = workload("v2", kind="LeaderWorkerSet"), workload("v1")
    assert retirement(MULTI, deployment, lws) == SCALE_DOWN_DEPLOYMENT
    assert retirement(MULTI, workload("v1", replicas=0), lws) is None  # already scaled down
    assert retirement(MULTI, deployment, workload("v2", complete=False, kind="LeaderWorkerSet")) is None
    assert retirement(MULTI, None, lws) is None
    assert retirement(SINGLE, workload("v2"), lws) == DELETE_LWS
    assert retirement(SINGLE, workload("v2", complete=False), lws) is None
    assert retirement(SINGLE, workload("v2"), None) is None


def test_new_pods_are_read_only_while_a_wanted_rollout_is_in_flight():
    w = world({"servingVersion": "v1"})
    assert awaits_new_pods(w, workload(VERSION, complete=False), None, CONFIG)
    assert not awaits_new_pods(w, workload(VERSION), None, CONFIG)  # it serves
    assert not awaits_new_pods(w, None, None, CONFIG)  # no workload yet
    assert not awaits_new_pods(w, workload(VERSION, replicas=0), None, CONFIG)  # nothing wanted


def test_a_build_counts_once_when_the_engine_leaves_building():
    building = {"phase": "Building", "engineVersion": VERSION}
    published = world(building, manifest=manifest(), job=job("succeeded"))
    assert finished_build(published, decide(published), Outcome()) == (JobState("succeeded"), job("succeeded"))
    w = world(building, job=job("failed"))
    record = status_of(w, Outcome())["build"]
    failed = finished_build(w, decide(w), Outcome(), record)
    assert failed is not None and failed[0].state == "failed" and failed[0].reason == "BackoffLimitExceeded"
    running = world(building, job=job())
    assert finished_build(running, decide(running), Outcome(job=job()), status_of(running, Outcome(job=job()))[
        "build"]) is None  # still running
    again = world({"phase": "Failed", "engineVersion": VERSION, "build": record}, job=job("failed"))
    assert finished_build(again, decide(again), Outcome(), status_of(again, Outcome())["build"]) is None  # counted
    ready = world({"phase": "Ready"}, manifest=manifest())
    assert finished_build(ready, decide(ready), Outcome()) is None


# -- adapters: decide() returns their plan with a SERVE plan (kiln.operator.adapters.plan_adapters) -----------

LORA = validate_spec({"model": {"source": "hf://o/m"}, "gpu": "cpu", "lora": {"maxLoras": 2, "adapters": [
    {"name": "sql", "source": "s3://adapters/sql", "revision": "v1"},
    {"name": "chat", "source": "s3://adapters/chat", "revision": "v1", "credentialsSecret": "hf"}]}}, CONFIG)
LORA_VERSION = engine_version(LORA)


def adapter_view(name: str, base: str = LORA_VERSION, **fields) -> AdapterView:
    (adapter,) = [a for a in LORA.lora.adapters if a.name == name]
    version = adapter_version(base, adapter)
    return AdapterView(adapter, base, version, f"s3://b/p/engines/{version}", **{"built": False, **fields})


def lora_world(views: tuple, status: dict | None = None) -> World:
    w = world(status, spec=LORA, manifest=manifest(), adapters=views)
    w.body["metadata"]["uid"] = "u-1"
    return w


def test_a_served_base_plans_a_job_for_each_adapter_not_built_nor_building_nor_refused():
    views = (adapter_view("sql"), adapter_view("chat", job=job("running")))
    plan = decide(lora_world(views))
    assert plan.step == SERVE and plan.adapters is not None
    assert [v.adapter.name for v in plan.adapters.jobs] == ["sql"]  # chat's Job runs: not created twice
    assert [v.adapter.name for v in plan.adapters.building] == ["chat"]  # its credentials are copied meanwhile
    assert [(s["name"], s["phase"]) for s in plan.adapters.statuses] == [("sql", "Building"), ("chat", "Building")]
    refused = decide(lora_world((adapter_view("sql", untrusted="it is not signed by this operator's key"),)))
    assert refused.adapters.jobs == () and refused.adapters.statuses[0]["phase"] == "Failed"
    assert "not signed" in refused.adapters.statuses[0]["message"]
    failed = decide(lora_world((adapter_view("sql", job=job("failed"), failure="PEFT gate: rank 0"),)))
    (entry,) = failed.adapters.statuses  # a failed Job is not retried: a new revision makes a new version
    assert failed.adapters.jobs == () and (entry["phase"], entry["message"]) == ("Failed", "PEFT gate: rank 0")


def test_the_configmap_lists_pinned_adapters_of_the_wanted_base_and_built_ones_of_the_old_base():
    old_base = "chat-0123"
    views = (adapter_view("sql", built=True, content_digest="d" * 64),
             adapter_view("chat"),  # not built: listed nowhere yet
             adapter_view("sql", base=old_base, built=True, content_digest="e" * 64),
             adapter_view("chat", base=old_base))  # the old base's unbuilt adapter is never built, nor listed
    plan = decide(lora_world(views, {"servingVersion": old_base}))
    document = json.loads(plan.adapters.configmap["data"]["adapters.json"])
    listed = {(e["name"], e["baseEngineVersion"], e["contentDigest"]) for e in document["adapters"]}
    assert listed == {("sql", LORA_VERSION, "d" * 64), ("sql", old_base, "e" * 64)}
    assert plan.adapters.configmap["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert [v.base_version for v in plan.adapters.jobs] == [LORA_VERSION]  # only the wanted base builds
    assert [s["version"] for s in plan.adapters.statuses] == [views[0].version, views[1].version]


def test_adapter_statuses_are_composed_with_the_rest_and_removed_with_spec_lora():
    plan = decide(lora_world((adapter_view("sql", built=True, content_digest="d" * 64),)))
    w = lora_world((adapter_view("sql", built=True, content_digest="d" * 64),))
    status = compose_status(observation(w, plan, Outcome(deployment=workload(LORA_VERSION)), CONFIG), NOW)
    assert [(a["name"], a["phase"]) for a in status["adapters"]] == [("sql", "Ready")]
    # spec.lora removed: the ConfigMap goes (a status said there were adapters) and status.adapters with it.
    gone = world({"adapters": status["adapters"]}, manifest=manifest())
    plan = decide(gone)
    assert plan.adapters.delete_configmap and plan.adapters.configmap is None and plan.adapters.jobs == ()
    status = compose_status(observation(gone, plan, Outcome(deployment=workload(VERSION)), CONFIG), NOW)
    assert "adapters" in status and status["adapters"] is None  # a merge patch removes it
    assert not decide(world(manifest=manifest())).adapters.delete_configmap  # never had adapters: no delete
    # Until the base serves, adapters are neither planned nor reported (status.adapters is left as it was).
    building = world({"adapters": [{"name": "sql"}]}, spec=LORA, job=job("running"))
    plan = decide(building)
    assert plan.step == BUILD and plan.adapters is None
    assert "adapters" not in compose_status(observation(building, plan, Outcome(job=job()), CONFIG), NOW)


# -- an engine of a pool: spec.serving.pool (kiln.operator.pool_member) ---------------------------------------

POOLED = validate_spec({"model": {"source": "hf://o/m"}, "gpu": "cpu", "serving": {"pool": "shared"}}, CONFIG)
POOL_URL = "http://shared-pool.ml.svc:8000/v1"
TOO_BIG = ("chat needs 9.0 GiB but LLMEnginePool shared's spec.memoryBudget is 6.0 GiB; raise spec.memoryBudget "
           "or serve chat from its own pods")


def pool(state: str | None = None, version: str = VERSION, phase: str = "Ready", message: str | None = None,
         **entry) -> dict:
    """An LLMEnginePool as its reconcile leaves it: ``chat``'s entry in status.engines (none when ``state`` is None)."""
    engines = [] if state is None else [
        {"name": "chat", "engineVersion": version, "state": state, "message": message, **entry}]
    ready = {"type": "Ready", "status": "True" if phase == "Ready" else "False",
             "message": "1 of 1 pod(s) ready" if phase == "Ready" else "0 of 1 pod(s) ready"}
    return {"metadata": {"name": "shared", "namespace": "ml"}, "spec": {"gpu": "cpu"},
            "status": {"phase": phase, "endpoint": POOL_URL, "engines": engines, "conditions": [ready]}}


def pooled(status: dict | None = None, pool_body: dict | None = None, **fields) -> World:
    return world(status, spec=POOLED, **{"manifest": manifest(), "pool": pool_body, **fields})


def test_an_adapter_its_pool_leaves_out_keeps_ready_and_says_why_on_the_engine_s_own_status():
    spec = validate_spec({**LORA.to_k8s(), "serving": {"pool": "shared"}}, CONFIG)
    why = ("its adapter 'sql' is not served by the pool: 'code', listed before it, has an adapter of that name; "
           "rename one of them")
    views = (adapter_view("sql", built=True, content_digest="d" * 64),
             adapter_view("chat", built=True, content_digest="e" * 64))
    w = world(spec=spec, manifest=manifest(), adapters=views,
              pool=pool("Listed", adaptersLeftOut=[{"name": "sql", "message": why}]))
    w.body["metadata"]["uid"] = "u-1"
    plan = decide(w)
    adapters = {a["name"]: a for a in compose_status(observation(w, plan, Outcome(), CONFIG), NOW)["adapters"]}
    assert (adapters["sql"]["phase"], adapters["sql"]["message"]) == (
        "Ready", f"built, but the pool 'shared' does not serve it: {why}")
    assert adapters["chat"]["phase"] == "Ready" and "message" not in adapters["chat"]
    # the pool serves it again (renamed elsewhere): the message goes with the next status
    w = world(spec=spec, manifest=manifest(), adapters=views, pool=pool("Listed", adaptersLeftOut=[]))
    w.body["metadata"]["uid"] = "u-1"
    again = compose_status(observation(w, decide(w), Outcome(), CONFIG), NOW)["adapters"]
    assert all("message" not in a for a in again)


def test_an_engine_of_a_pool_is_built_as_any_other_and_rolls_out_nothing_of_its_own():
    assert engine_version(POOLED) == VERSION  # spec.serving is not in the build envelope
    assert decide(pooled(manifest=None)).step == BUILD
    w = pooled(pool_body=pool())
    assert decide(w).step == SERVE
    # No own rollout to watch, and nothing of its own to retire while its pool does not serve it.
    assert not awaits_new_pods(pooled({"servingVersion": "v1"}), workload("v1"), None, CONFIG)
    assert retirements(w, None, None) == () and retirements(w, workload("v1"), None) == ()
    assert retirements(world(spec=MULTI), workload("v1"), workload("v2", kind="LeaderWorkerSet")) == (
        SCALE_DOWN_DEPLOYMENT,)  # an engine not in a pool retires as before


def test_listed_by_a_ready_pool_is_ready_at_the_pool_s_endpoint():
    status = status_of(pooled(pool_body=pool("Listed")), Outcome())
    assert status["phase"] == "Ready" and reasons(status) == ["ArtifactAvailable", "Serving"]
    assert status["servingVersion"] == VERSION and status["endpoint"] == POOL_URL
    assert status["pool"] == {"name": "shared", "state": "Listed", "message": None}
    assert f"LLMEnginePool shared serves {VERSION} at {POOL_URL}" == status["conditions"][1]["message"]
    # Listed, but the pool's pods are not ready: nothing serves it yet.
    pending = status_of(pooled(pool_body=pool("Listed", phase="Pending")), Outcome())
    assert pending["phase"] == "Deploying" and reasons(pending)[1] == "PoolNotReady"
    assert "0 of 1 pod(s) ready" in pending["conditions"][1]["message"] and pending["endpoint"] is None


def test_a_member_of_a_pool_at_zero_is_ready_not_serving_with_the_pools_wake_up_message():
    asleep = pool("Listed")
    asleep["status"]["conditions"] = [{"type": "Ready", "status": "False", "reason": "ScaledToZero", "message": (
        "scaled to zero by ScaledObject/shared-pool; a request through the KEDA HTTP add-on's interceptor (Host: "
        "shared-pool.ml.svc) starts a pod")}]
    w = pooled({"servingVersion": "v1"}, asleep, deployment=workload("v1"))
    status = status_of(w, Outcome(deployment=workload("v1")))
    assert status["phase"] == "Ready" and reasons(status) == ["ArtifactAvailable", "ScaledToZero"]
    assert status["conditions"][1]["status"] == "False" and status["endpoint"] == POOL_URL
    assert status["conditions"][1]["message"].startswith(
        f"LLMEnginePool shared serves {VERSION}; it is scaled to zero by ScaledObject/shared-pool; a request")
    assert retirements(w, workload("v1"), None) == (SCALE_DOWN_DEPLOYMENT,)  # the pool serves it: own pods go


@pytest.mark.parametrize("entry,shows", [
    (None, "waiting for LLMEnginePool shared to list"),  # the pool has not seen it yet
    ("Building", "it waits for the build to be pinned"),
])
def test_not_listed_yet_is_deploying_while_its_own_deployment_keeps_serving(entry, shows):
    own = workload("v1")
    w = pooled({"servingVersion": "v1"}, pool(entry), deployment=own)
    status = status_of(w, Outcome(deployment=own))
    assert status["phase"] == "Deploying" and reasons(status)[1] == "PoolListing"
    assert shows in status["conditions"][1]["message"] and status["conditions"][1]["message"].endswith(
        "; v1 keeps serving")
    assert status["servingVersion"] == "v1" and status["endpoint"] == "http://chat.ml.svc:8000/v1"  # its own
    assert status["pool"] == {"name": "shared", "state": entry, "message": None}


def test_a_pool_that_serves_an_older_version_serves_it_until_it_lists_the_new_one():
    status = status_of(pooled({"servingVersion": "v1"}, pool("Listed", version="v1")), Outcome())
    assert status["phase"] == "Deploying" and reasons(status)[1] == "PoolListing"
    assert status["servingVersion"] == "v1" and status["endpoint"] == POOL_URL
    assert "(it lists v1, Listed); v1 keeps serving" in status["conditions"][1]["message"]


@pytest.mark.parametrize("entry,reason", [({"memoryBytes": 9 << 30}, "EngineTooBigForPool"),
                                          ({}, "PoolMismatch")])  # its spec.gpu, its shape: nothing measured
def test_refused_by_the_pool_fails_with_the_pool_s_message(entry, reason):
    w = pooled({"phase": "Deploying"}, pool("Refused", message=TOO_BIG, **entry))
    status = status_of(w, Outcome())
    assert status["phase"] == "Failed" and reasons(status) == ["ArtifactAvailable", reason]
    assert status["conditions"][1]["message"] == TOO_BIG
    assert status["pool"] == {"name": "shared", "state": "Refused", "message": TOO_BIG}
    assert ("Warning", reason, TOO_BIG) in transitions(w.old, status)
    # A refusal of a version it no longer wants is stale: the pool has not judged this one yet.
    stale = status_of(pooled(pool_body=pool("Refused", version="v1", message=TOO_BIG)), Outcome())
    assert stale["phase"] == "Deploying" and reasons(stale)[1] == "PoolListing"


def test_a_member_of_a_failed_pool_shows_the_pool_s_message_not_a_wait():
    invalid = pool(phase="Failed")  # an invalid spec: no status.engines at all
    invalid["status"]["conditions"][0]["message"] = "spec.gpu: unknown SKU 'h100'; use one of ..."
    for body in (invalid, pool("Building", phase="Failed")):
        status = status_of(pooled({"servingVersion": "v1"}, body), Outcome())
        message = status["conditions"][1]["message"]
        assert status["phase"] == "Deploying" and "waiting for" not in message, message
        assert message.startswith("LLMEnginePool shared is Failed: ")
        assert body["status"]["conditions"][0]["message"] in message


def test_no_such_pool_is_deploying_naming_the_field_and_the_fix():
    own = workload("v1")
    status = status_of(pooled({"servingVersion": "v1"}, None, deployment=own), Outcome(deployment=own))
    assert status["phase"] == "Deploying" and reasons(status)[1] == "PoolNotFound"
    message = status["conditions"][1]["message"]
    assert message.startswith("spec.serving.pool: there is no LLMEnginePool shared in namespace ml")
    assert "create it" in message and "remove spec.serving.pool" in message and message.endswith("v1 keeps serving")
    assert status["pool"] == {"name": "shared", "state": None, "message": None}
    assert status["servingVersion"] == "v1" and retirements(pooled(), own, None) == ()


def test_its_own_deployment_is_scaled_to_zero_only_once_the_pool_serves_it():
    own, lws = workload("v1"), workload("v1", kind="LeaderWorkerSet")
    for not_yet in (None, pool(), pool("Building"), pool("Listed", phase="Pending"), pool("Refused", message="x")):
        assert retirements(pooled(pool_body=not_yet), own, lws) == ()
    serving = pooled(pool_body=pool("Listed"))
    assert retirements(serving, own, None) == (SCALE_DOWN_DEPLOYMENT,)
    assert retirements(serving, own, lws) == (SCALE_DOWN_DEPLOYMENT, DELETE_LWS)
    assert retirements(serving, workload("v1", replicas=0), None) == ()  # already scaled down
    assert retirements(pooled(pool_body=pool("Listed", version="v1")), own, None) == (SCALE_DOWN_DEPLOYMENT,)
    # Once scaled down, what serves it is the pool (and the endpoint is the pool's).
    status = status_of(serving, Outcome(deployment=workload("v1", replicas=0)))
    assert status["phase"] == "Ready" and status["endpoint"] == POOL_URL
    assert status["replicas"]["desired"] == 0  # its own pods: none


def test_its_own_pods_are_retired_and_it_is_ready_only_once_the_pods_have_had_the_time_to_load_the_list():
    own, now = workload("v1"), datetime(2026, 1, 1, 0, 5, tzinfo=UTC)
    for ago, serves in ((0, False), (89, False), (90, True)):
        since = (now - timedelta(seconds=ago)).isoformat().replace("+00:00", "Z")
        w = pooled(pool_body=pool("Listed", listedSince=since), now=now)
        assert w.membership.serves is serves
        assert retirements(w, own, None) == ((SCALE_DOWN_DEPLOYMENT,) if serves else ())
        status = status_of(w, Outcome(deployment=own))
        assert (status["phase"] == "Ready") is serves
        if not serves:
            assert "its pods load the engine list within 90 s" in status["conditions"][1]["message"]
    # An operator told its kubelets sync faster (chart pools.listSyncSeconds) counts that instead.
    for ago, serves in ((9, False), (10, True)):
        since = (now - timedelta(seconds=ago)).isoformat().replace("+00:00", "Z")
        w = pooled(pool_body=pool("Listed", listedSince=since), now=now, list_sync=timedelta(seconds=10))
        assert w.membership.serves is serves
        if not serves:
            message = status_of(w, Outcome(deployment=own))["conditions"][1]["message"]
            assert "its pods load the engine list within 10 s" in message


class RecordingKube:
    """The API calls a step makes, on a dict of objects by path (get/create/patch/delete; lists are empty)."""

    def __init__(self, objects: dict[str, dict]):
        self.objects, self.calls = dict(objects), []

    async def get(self, path):
        self.calls.append(("GET", path))
        return self.objects.get(path)

    async def create(self, path, body):
        self.calls.append(("POST", f"{path}/{body['metadata']['name']}"))
        self.objects[f"{path}/{body['metadata']['name']}"] = body
        return body

    async def patch(self, path, body):
        self.calls.append(("PATCH", path))
        self.objects[path] = {**self.objects[path], "spec": {**self.objects[path]["spec"], **body.get("spec", {})}}
        return self.objects[path]

    async def delete(self, path):
        self.calls.append(("DELETE", path))
        self.objects.pop(path, None)

    async def list(self, path, label_selector=None):
        return []


@pytest.mark.parametrize("pool_body,scaled", [(None, False), (pool("Listed", phase="Pending"), False),
                                              (pool("Listed"), True)])
async def test_the_serve_step_of_an_engine_of_a_pool_applies_no_workload_of_its_own(pool_body, scaled):
    own = workload("v1")
    deployment_path = "/apis/apps/v1/namespaces/ml/deployments/chat"
    kube = RecordingKube({deployment_path: own})
    ctx = Context(kube=kube, store=None, config=CONFIG, keys=KeyPair(b"private", b"public"))
    w = pooled({"servingVersion": "v1"}, pool_body, deployment=own)
    w.body["metadata"]["uid"] = "u-1"
    outcome = await serve(ctx, w, decide(w), logging.getLogger("test"))
    created = [path for verb, path in kube.calls if verb == "POST"]
    assert created == ["/api/v1/namespaces/ml/secrets/kiln-verify-key"]  # the pool's pods mount it
    changed = [path for verb, path in kube.calls if verb == "PATCH"]
    assert changed == ([deployment_path] if scaled else [])
    assert (outcome.deployment["spec"]["replicas"] == 0) is scaled and outcome.new_pods is None
