"""Versions on the real control plane: a revision bump builds once and reverting it is a cache hit (no Job);
the operator pod deleted mid-build comes back and adopts the running Job instead of starting another."""

from __future__ import annotations

from clusterlib import GROUP, Kube
from conftest import ENGINE_NS, OPERATOR_NS, engine_manifest

NAME = "tiny-versions"


def engine(kube: Kube) -> dict:
    return kube.engine(NAME, ENGINE_NS) or {}


def ready_version(kube: Kube, timeout: float = 600) -> str:
    def check():
        status = engine(kube).get("status") or {}
        assert status.get("phase") != "Failed", status
        return kube.condition(engine(kube), "Ready").get("status") == "True" and status.get("engineVersion")

    return kube.wait_for(f"{NAME} Ready", check, timeout=timeout, every=2)


def jobs(kube: Kube) -> list[str]:
    return sorted(j["metadata"]["name"] for j in kube.jobs(ENGINE_NS)
                  if any(o.get("name") == NAME for o in j["metadata"].get("ownerReferences") or []))


def test_a_bump_builds_once_the_operator_deleted_mid_build_adopts_it_and_a_revert_is_a_cache_hit(
        installed: Kube, tiny_s3):
    installed.apply(engine_manifest(NAME, tiny_s3, "r1"))
    first = ready_version(installed)
    assert len(jobs(installed)) == 1

    installed.apply(engine_manifest(NAME, tiny_s3, "r2"))
    installed.wait_for("the bump's build Job", lambda: len(jobs(installed)) == 2, timeout=120)
    old = installed.get("pods", ns=OPERATOR_NS, selector="app.kubernetes.io/component=operator")
    installed.kubectl("delete", "pod", "-n", OPERATOR_NS, old[0]["metadata"]["name"], "--wait=false")
    installed.wait_for("a new operator pod Ready", lambda: any(
        p["metadata"]["uid"] != old[0]["metadata"]["uid"] and installed.condition(p, "Ready").get("status") == "True"
        for p in installed.get("pods", ns=OPERATOR_NS, selector="app.kubernetes.io/component=operator") or []),
        timeout=180)
    second = ready_version(installed)
    assert second != first
    assert len(jobs(installed)) == 2, "the new operator adopted the running build; it did not start another"

    installed.apply(engine_manifest(NAME, tiny_s3, "r1"))
    installed.wait_for("the reverted version", lambda: ready_version(installed) == first, timeout=300)
    assert len(jobs(installed)) == 2, "a version already in the store is a cache hit: no Job"
    installed.kubectl("delete", f"llmengines.{GROUP}", NAME, "-n", ENGINE_NS, "--wait=true")
