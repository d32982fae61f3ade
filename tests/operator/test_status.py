"""Status and condition logic as pure functions, plus the semantic spec checks."""

from __future__ import annotations

import pytest
from kiln.operator.settings import OperatorConfig
from kiln.operator.status import (
    JobState,
    Observation,
    compose_status,
    condition,
    job_duration_seconds,
    job_state,
    rollout_complete,
    serving_version,
    termination_message,
    transitions,
)
from kiln.operator.validation import InvalidSpec, validate_spec

NOW = "2026-01-01T00:00:00Z"


def deployment(version: str, replicas: int = 2, generation: int = 3, observed: int = 3,
               updated: int = 2, available: int = 2, total: int = 2) -> dict:
    return {"metadata": {"generation": generation},
            "spec": {"replicas": replicas, "template": {"metadata": {
                "annotations": {"serving.kiln.dev/engine-version": version}}}},
            "status": {"observedGeneration": observed, "updatedReplicas": updated,
                       "availableReplicas": available, "replicas": total}}


def test_serving_version_only_moves_when_the_rollout_has_landed():
    assert serving_version(deployment("new"), previous="old") == "new"
    assert serving_version(deployment("new", observed=2), previous="old") == "old"  # not yet observed
    assert serving_version(deployment("new", updated=1, total=3), previous="old") == "old"  # surge
    assert serving_version(deployment("new", available=1), previous="old") == "old"
    assert serving_version(deployment("new", updated=2, available=2, total=3), "old") == "old"  # old pod left
    assert serving_version(None, previous="old") is None
    assert serving_version(deployment("new", replicas=0, updated=0, available=0, total=0), "old") is None
    assert not rollout_complete({"metadata": {"generation": 1}, "spec": {"replicas": 1}})


def test_job_state_and_termination_message():
    assert job_state({}) == JobState("running")
    assert job_state({"status": {"conditions": [{"type": "Complete", "status": "True"}]}}).state == "succeeded"
    failed = job_state({"status": {"conditions": [
        {"type": "Failed", "status": "True", "reason": "DeadlineExceeded", "message": "too slow"}]}})
    assert failed == JobState("failed", "DeadlineExceeded", "too slow")
    assert job_state({"status": {"conditions": [{"type": "Failed", "status": "False"}]}}).state == "running"
    pods = [{"status": {"containerStatuses": [{"state": {"terminated": {
        "finishedAt": "2026-01-01T00:00:01Z", "message": "x" * 5000 + "spec.maxSeqLen too long"}}}]}},
            {"status": {"containerStatuses": [{"state": {"terminated": {
                "finishedAt": "2026-01-01T00:00:00Z", "message": "older"}}}]}}]
    msg = termination_message(pods, limit=100)
    assert msg.endswith("spec.maxSeqLen too long") and len(msg) == 101
    assert termination_message([{"status": {}}]) == ""
    # The fetch init container fails before the build container starts: its message is the one to show.
    fetch_failed = [{"status": {
        "initContainerStatuses": [{"name": "fetch", "state": {"terminated": {
            "finishedAt": "2026-01-01T00:00:05Z", "message": "FetchError: spec.model.source: s3://m is gated"}}}],
        "containerStatuses": [{"name": "build", "state": {"waiting": {"reason": "PodInitializing"}}}]}}]
    assert termination_message(fetch_failed) == "FetchError: spec.model.source: s3://m is gated"
    assert job_duration_seconds({"status": {"startTime": "2026-01-01T00:00:00Z",
                                            "completionTime": "2026-01-01T00:02:30Z"}}) == 150


def test_condition_keeps_transition_time_while_status_is_unchanged():
    first = condition("Ready", False, "Building", "m", 1, [], now="t0")
    same = condition("Ready", False, "RollingOut", "m2", 2, [first], now="t1")
    flipped = condition("Ready", True, "Serving", "m3", 2, [same], now="t2")
    assert same["lastTransitionTime"] == "t0" and flipped["lastTransitionTime"] == "t2"
    assert flipped["observedGeneration"] == 2


def status_of(**kw) -> dict:
    base = dict(generation=2, old={}, engine_version="m-new", artifact_uri="s3://b/engines/m-new",
                job_name="kiln-build-m-new", endpoint="http://demo.ns.svc:8000/v1")
    return compose_status(Observation(**{**base, **kw}), now=NOW)


def conds(status: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_phases_follow_the_observation():
    building = status_of(built=False, job=JobState("running"), serving="m-old")
    assert building["phase"] == "Building" and building["servingVersion"] == "m-old"
    assert conds(building) == {"Built": ("False", "Building"), "Ready": ("False", "Building")}
    assert "m-old keeps serving" in building["conditions"][1]["message"]
    assert building["endpoint"].endswith("/v1")
    assert status_of(built=False, job=JobState("running"))["endpoint"] is None  # nothing serves yet

    failed = status_of(built=False, job=JobState("failed", "BackoffLimitExceeded", "limit"),
                       failure_detail="spec.model.source: 404")
    assert failed["phase"] == "Failed" and conds(failed)["Built"] == ("False", "BuildFailed")
    assert "BackoffLimitExceeded" in failed["conditions"][0]["message"]
    assert "spec.model.source: 404" in failed["conditions"][0]["message"]

    deploying = status_of(built=True, serving="m-old")
    assert deploying["phase"] == "Deploying" and conds(deploying)["Ready"] == ("False", "RollingOut")
    ready = status_of(built=True, serving="m-new", replicas=2)
    assert ready["phase"] == "Ready" and conds(ready) == {"Built": ("True", "ArtifactAvailable"),
                                                          "Ready": ("True", "Serving")}
    assert ready["observedGeneration"] == 2 and ready["engineVersion"] == "m-new"

    invalid = status_of(invalid="spec.gpu: nope")
    assert invalid["phase"] == "Failed" and invalid["engineVersion"] is None
    assert conds(invalid)["Ready"] == ("False", "InvalidSpec")


def test_transitions_emit_one_event_per_changed_condition():
    building = status_of(built=False, job=JobState("running"))
    ready = status_of(built=True, serving="m-new", old=building)
    events = transitions(building, ready)
    assert [(t, r) for t, r, _ in events] == [("Normal", "ArtifactAvailable"), ("Normal", "Serving")]
    assert transitions(ready, status_of(built=True, serving="m-new", old=ready)) == []
    failed = status_of(built=False, job=JobState("failed", "DeadlineExceeded", ""), old=building)
    assert transitions(building, failed)[0][:2] == ("Warning", "BuildFailed")


CFG = OperatorConfig(store_uri="s3://b/p")


@pytest.mark.parametrize("raw, field", [
    ({"model": {"source": "file:///models/x"}, "gpu": "cpu"}, "spec.model.source"),
    ({"model": {"source": "hf://o/m"}, "gpu": "cpu", "maxInputLen": 4096, "maxSeqLen": 4096}, "maxInputLen"),
    ({"model": {"source": "hf://o/m"}, "gpu": "cpu", "tensorParallel": 3}, "spec.tensorParallel"),
    ({"model": {"source": "hf://o/m"}, "gpu": "H100-80GB",
      "serving": {"resources": {"limits": {"nvidia.com/gpu": 2}}}}, "spec.serving.resources.limits"),
    ({"model": {"source": "hf://o/m"}, "gpu": "cpu", "bogus": 1}, "spec.bogus"),
])
def test_invalid_specs_name_their_field(raw: dict, field: str):
    with pytest.raises(InvalidSpec, match=field.replace(".", r"\.")):
        validate_spec(raw, CFG)


def test_a_sku_missing_from_the_node_label_map_is_a_spec_error():
    cfg = OperatorConfig(store_uri="s3://b/p", sku_node_labels={"cpu": {}})
    with pytest.raises(InvalidSpec, match="spec.gpu: L4 has no node label"):
        validate_spec({"model": {"source": "hf://o/m"}, "gpu": "L4"}, cfg)
    assert validate_spec({"model": {"source": "hf://o/m"}, "gpu": "cpu"}, cfg).gpu == "cpu"


def test_history_has_one_rule():
    """kiln.engine_status.add_to_history is the one rule the operator uses: new versions first, a revert keeps order."""
    from kiln.engine_status import HISTORY_LIMIT, add_to_history

    history: list[dict] = []
    for i in range(HISTORY_LIMIT + 3):
        history = add_to_history(history, {"engineVersion": f"v{i}"})
    assert len(history) == HISTORY_LIMIT and history[0]["engineVersion"] == f"v{HISTORY_LIMIT + 2}"
    reverted = add_to_history(history, {"engineVersion": history[4]["engineVersion"]})
    assert reverted == history  # a GitOps revert rebuilds nothing: the list stays in build order


def test_reconcile_interval_is_read_in_one_place():
    import pytest
    from kiln.operator.settings import ConfigError, OperatorConfig, reconcile_interval_from_env

    assert reconcile_interval_from_env({}) == OperatorConfig.reconcile_interval
    assert OperatorConfig.from_env({"KILN_RECONCILE_INTERVAL": "7.5"}).reconcile_interval == 7.5
    with pytest.raises(ConfigError, match="KILN_RECONCILE_INTERVAL"):
        reconcile_interval_from_env({"KILN_RECONCILE_INTERVAL": "0"})
    assert OperatorConfig.from_env({}).pool_list_sync_seconds == 90
    assert OperatorConfig.from_env({"KILN_POOL_LIST_SYNC_SECONDS": "12"}).pool_list_sync_seconds == 12
    with pytest.raises(ConfigError, match=r"KILN_POOL_LIST_SYNC_SECONDS must be > 0.*pools\.listSyncSeconds"):
        OperatorConfig.from_env({"KILN_POOL_LIST_SYNC_SECONDS": "-1"})
