"""The strict emulator behaves like an API server where the operator relies on it."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from conftest import Kube, wait_for
from kmock_ext import labels_match, parse_label_selector

JOBS = "/apis/batch/v1/namespaces/ns/jobs"
ENGINES = "/apis/serving.kiln.dev/v1alpha1/namespaces/ns/llmengines"
DEPLOYMENTS = "/apis/apps/v1/namespaces/ns/deployments"


def job(name: str, **labels: str) -> dict:
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "labels": labels},
            "spec": {"template": {}}, "status": {"succeeded": 1}}


def test_create_sets_server_fields_and_returns_201(kube: Kube):
    resp = kube.call("POST", JOBS, job("a"), content_type="application/json")
    assert resp.status_code == 201
    meta = resp.json()["metadata"]
    assert meta["uid"] and meta["resourceVersion"] and meta["generation"] == 1 and meta["creationTimestamp"]
    assert meta["namespace"] == "ns"
    assert "status" not in resp.json()  # status subresource: ignored on create
    again = kube.call("POST", JOBS, job("a"), ok=(409,), content_type="application/json")
    assert again.status_code == 409 and again.json()["reason"] == "AlreadyExists"
    named = kube.create(JOBS, {"metadata": {"generateName": "x-"}, "spec": {}})
    assert named["metadata"]["name"].startswith("x-") and len(named["metadata"]["name"]) > 2


def test_stale_resource_version_conflicts(kube: Kube):
    created = kube.create(JOBS, job("a"))
    rv = created["metadata"]["resourceVersion"]
    updated = kube.patch(f"{JOBS}/a", {"metadata": {"resourceVersion": rv, "labels": {"x": "1"}}})
    assert int(updated["metadata"]["resourceVersion"]) > int(rv)
    stale = kube.call("PATCH", f"{JOBS}/a", {"metadata": {"resourceVersion": rv, "labels": {"x": "2"}}}, ok=(409,))
    assert stale.status_code == 409 and stale.json()["reason"] == "Conflict"
    put = dict(updated, spec={"parallelism": 2})
    replaced = kube.call("PUT", f"{JOBS}/a", put, content_type="application/json").json()
    assert replaced["spec"] == {"parallelism": 2} and replaced["metadata"]["uid"] == created["metadata"]["uid"]
    assert kube.call("PUT", f"{JOBS}/a", put, ok=(409,), content_type="application/json").status_code == 409


def test_status_subresource_is_separate_and_generation_tracks_spec(kube: Kube):
    kube.create(JOBS, job("a"))
    main = kube.patch(f"{JOBS}/a", {"status": {"succeeded": 1}, "metadata": {"labels": {"l": "v"}}})
    assert "status" not in main and main["metadata"]["generation"] == 1  # labels: no generation bump
    status = kube.patch(f"{JOBS}/a/status", {"status": {"active": 1}, "spec": {"parallelism": 9}})
    assert status["status"] == {"active": 1} and status["spec"] == {"template": {}}
    assert status["metadata"]["generation"] == 1
    bumped = kube.patch(f"{JOBS}/a", {"spec": {"parallelism": 3}})
    assert bumped["metadata"]["generation"] == 2 and bumped["status"] == {"active": 1}
    json_patch = kube.call("PATCH", f"{JOBS}/a", [{"op": "replace", "path": "/spec/parallelism", "value": 4}],
                           content_type="application/json-patch+json").json()
    assert json_patch["spec"]["parallelism"] == 4 and json_patch["metadata"]["generation"] == 3
    same = kube.patch(f"{JOBS}/a", {"spec": {"parallelism": 4}})
    assert same["metadata"]["resourceVersion"] == json_patch["metadata"]["resourceVersion"]


def test_label_and_field_selectors(kube: Kube):
    kube.create(JOBS, job("a", app="kiln", tier="build"))
    kube.create(JOBS, job("b", app="kiln"))
    kube.create(JOBS, job("c", app="other"))
    names = lambda **p: sorted(j["metadata"]["name"] for j in kube.list(JOBS, **p))  # noqa: E731
    assert names(labelSelector="app=kiln") == ["a", "b"]
    assert names(labelSelector="app=kiln,tier") == ["a"]
    assert names(labelSelector="app=kiln,!tier") == ["b"]
    assert names(labelSelector="app in (kiln, other),tier!=build") == ["b", "c"]
    assert names(labelSelector="app notin (kiln)") == ["c"]
    assert names(fieldSelector="metadata.name=b") == ["b"]
    assert names() == ["a", "b", "c"]
    assert kube.list("/apis/batch/v1/namespaces/elsewhere/jobs") == []
    assert labels_match({"a": "1"}, parse_label_selector("a==1"))


def test_watch_filters_by_label_and_ends_at_timeout(emulator, kube: Kube):
    kube.create(JOBS, job("old", app="kiln"))
    rv = kube.create(JOBS, job("other"))["metadata"]["resourceVersion"]
    seen: list[tuple[str, str]] = []

    def watch() -> None:
        params = {"watch": "true", "labelSelector": "app=kiln", "timeoutSeconds": "1", "resourceVersion": rv}
        with httpx.stream("GET", emulator.url + JOBS, params=params, timeout=10) as resp:
            for line in resp.iter_lines():
                if line.strip():
                    event = json.loads(line)
                    seen.append((event["type"], event["object"]["metadata"]["name"]))

    thread = threading.Thread(target=watch)
    thread.start()
    wait_for(lambda: emulator.handler._buses[next(iter(
        r for r in emulator.handler.resources if r.plural == "jobs"))].consumer_count, what="watcher")
    kube.create(JOBS, job("new", app="kiln"))
    kube.create(JOBS, job("unlabelled"))
    kube.delete(f"{JOBS}/new")
    thread.join(5)
    assert not thread.is_alive(), "the watch did not end at timeoutSeconds"
    assert seen == [("ADDED", "new"), ("DELETED", "new")]  # "old" is before resourceVersion


def test_finalizers_hold_deletion_until_removed(kube: Kube):
    kube.create(ENGINES, {"metadata": {"name": "e", "finalizers": ["kiln"]}, "spec": {}})
    kube.delete(f"{ENGINES}/e")
    held = kube.get(f"{ENGINES}/e")
    assert held and held["metadata"]["deletionTimestamp"]
    kube.patch(f"{ENGINES}/e", {"metadata": {"finalizers": None}})
    assert kube.get(f"{ENGINES}/e") is None
    assert kube.delete(f"{ENGINES}/e").status_code == 404


def owned_by(*owners: dict) -> dict:
    return {"ownerReferences": [{"apiVersion": "serving.kiln.dev/v1alpha1", "kind": "LLMEngine",
                                 "name": o["metadata"]["name"], "uid": o["metadata"]["uid"]} for o in owners]}


def test_garbage_collector_follows_owner_references(kube: Kube):
    a = kube.create(ENGINES, {"metadata": {"name": "a"}, "spec": {}})
    b = kube.create(ENGINES, {"metadata": {"name": "b"}, "spec": {}})
    kube.create(DEPLOYMENTS, {"metadata": {"name": "a", **owned_by(a)}, "spec": {}})
    kube.create(JOBS, {"metadata": {"name": "shared", **owned_by(a, b)}, "spec": {}})
    kube.create(JOBS, {"metadata": {"name": "free"}, "spec": {}})
    kube.delete(f"{ENGINES}/a")
    assert kube.get(f"{DEPLOYMENTS}/a") is None
    shared = kube.get(f"{JOBS}/shared")
    assert [r["name"] for r in shared["metadata"]["ownerReferences"]] == ["b"]
    kube.delete(f"{ENGINES}/b")
    assert kube.get(f"{JOBS}/shared") is None and kube.get(f"{JOBS}/free") is not None


def test_orphan_propagation_keeps_dependents(kube: Kube):
    a = kube.create(ENGINES, {"metadata": {"name": "a"}, "spec": {}})
    kube.create(DEPLOYMENTS, {"metadata": {"name": "a", **owned_by(a)}, "spec": {}})
    kube.call("DELETE", f"{ENGINES}/a", {"propagationPolicy": "Orphan"}, content_type="application/json")
    dep = kube.get(f"{DEPLOYMENTS}/a")
    assert dep is not None and "ownerReferences" not in dep["metadata"]


@pytest.mark.parametrize("path", [f"{JOBS}/missing", f"{JOBS}/missing/status"])
def test_writes_to_missing_objects_are_404(kube: Kube, path: str):
    assert kube.call("PATCH", path, {"spec": {}}, ok=(404,)).status_code == 404


def test_a_resource_type_the_server_does_not_serve_is_404(kube: Kube, emulator):
    """Like an API server without the CRD: the operator tells "not installed" from "not created yet" by this."""
    pools = "/apis/inference.networking.k8s.io/v1/namespaces/ns/inferencepools"
    assert kube.create(pools, {"metadata": {"name": "p"}, "spec": {}})["metadata"]["name"] == "p"
    missing = "/apis/example.com/v1/namespaces/ns/widgets"
    resp = kube.call("POST", missing, {"metadata": {"name": "w"}}, ok=(404,), content_type="application/json")
    # no resource of example.com/v1 is served: the real apiserver answers in plain text, not with a Status
    assert resp.status_code == 404 and resp.text.strip() == "404 page not found"
    assert kube.get(f"{missing}/w") is None and kube.delete(f"{missing}/w").status_code == 404
    emulator.handler.uninstalled.add("inferencepools")  # the CRD removed: its type (and here its group) is gone
    assert kube.call("GET", f"{pools}/p", ok=(404,)).text.strip() == "404 page not found"
    deployments = "/apis/apps/v1/namespaces/ns/widgets"  # a served group, an unknown type: a Status
    assert kube.call("GET", f"{deployments}/w", ok=(404,)).json()["message"] == (
        "the server could not find the requested resource")
