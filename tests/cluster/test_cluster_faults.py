"""Faults and privilege on the real control plane: the apiserver itself refuses bad engines with the CRD's
messages; a build pod that fails is retried by the Job's back-off, then the engine goes Failed naming why;
the operator's ServiceAccount can do what it needs and no more (docs/operator-trust.md)."""

from __future__ import annotations

import pytest
from clusterlib import GROUP, Kube, KubectlError
from conftest import ENGINE_NS, OPERATOR_NS, build_jobs_of, engine_manifest

pytestmark = pytest.mark.timeout(1800)  # builds and rollouts on a busy 2-core machine

SA = f"system:serviceaccount:{OPERATOR_NS}:kiln"

BAD = [
    ({"maxInputLen": 512, "maxSeqLen": 512}, "spec.maxInputLen must be less than spec.maxSeqLen"),
    ({"tensorParallel": 3}, "spec.tensorParallel: Unsupported value: 3"),
    ({"lora": {"adapters": [{"name": "a", "source": "s3://models/a"}, {"name": "a", "source": "s3://models/b"}]}},
     "spec.lora.adapters names must be unique"),
    ({"dtype": "float64"}, 'spec.dtype: Unsupported value: "float64"'),
]


@pytest.mark.parametrize(("spec", "message"), BAD, ids=[m.split(":")[0][:30] for _, m in BAD])
def test_bad_engines_are_refused_by_the_apiserver_with_the_crds_message(installed: Kube, tiny_s3, spec, message):
    with pytest.raises(KubectlError) as refused:
        installed.apply(engine_manifest("bad-engine", tiny_s3, **spec))
    assert message in refused.value.stderr
    assert installed.engine("bad-engine", ENGINE_NS) is None


def test_a_failing_build_is_retried_by_the_jobs_back_off_then_the_engine_fails_naming_why(installed: Kube):
    name = "missing-model"
    installed.apply(engine_manifest(name, "s3://models/no-such-model"))

    def failed():
        eng = installed.engine(name, ENGINE_NS) or {}
        return (eng.get("status") or {}).get("phase") == "Failed" and eng

    eng = installed.wait_for(f"{name} Failed", failed, timeout=300, every=2)
    (job,) = build_jobs_of(installed, name)
    assert job["spec"]["backoffLimit"] == 1
    assert job["status"].get("failed") == 2, "backoffLimit 1: the build pod ran twice"
    pods = installed.get("pods", ns=OPERATOR_NS, selector=f"job-name={job['metadata']['name']}")
    assert len(pods) == 2 and all(p["status"]["phase"] == "Failed" for p in pods)
    ready = installed.condition(eng, "Ready")
    assert ready["status"] == "False" and "no-such-model" in ready["message"], ready
    installed.kubectl("delete", f"llmengines.{GROUP}", name, "-n", ENGINE_NS, "--wait=true")


def can_i(kube: Kube, verb: str, resource: str, ns: str, name: str = "") -> bool:
    args = ["auth", "can-i", verb, f"{resource}/{name}" if name else resource, "-n", ns, f"--as={SA}"]
    return kube.kubectl(*args, check=False).strip() == "yes"


# Build Jobs run in the operator's namespace (the only one with the private signing key); engine namespaces get
# Deployments, the verify key and copies of nothing private. get secrets there: the credentials a spec names,
# copied next to the Job (the operator could mount them through a Deployment anyway).
ALLOWED = [("create", "jobs.batch", OPERATOR_NS, ""), ("delete", "jobs.batch", OPERATOR_NS, ""),
           ("patch", f"llmengines.{GROUP}", ENGINE_NS, ""), ("patch", f"llmengines.{GROUP}/status", ENGINE_NS, ""),
           ("create", "deployments.apps", ENGINE_NS, ""), ("get", "secrets", ENGINE_NS, "kiln-verify-key"),
           ("create", "secrets", ENGINE_NS, ""), ("get", "secrets", OPERATOR_NS, "kiln-signing-key"),
           ("get", "secrets", ENGINE_NS, "models"), ("list", "pods", ENGINE_NS, ""),
           ("create", "events", ENGINE_NS, "")]
DENIED = [("create", "jobs.batch", ENGINE_NS, ""), ("list", "secrets", ENGINE_NS, ""),
          ("patch", "secrets", ENGINE_NS, "models"), ("delete", "secrets", ENGINE_NS, "kiln-store"),
          ("create", "pods", ENGINE_NS, ""),
          ("delete", "deployments.apps", ENGINE_NS, ""), ("delete", f"llmengines.{GROUP}", ENGINE_NS, ""),
          ("create", "roles.rbac.authorization.k8s.io", ENGINE_NS, ""), ("delete", "namespaces", "", ""),
          ("create", "pods/exec", ENGINE_NS, ""), ("update", "configmaps", "kube-system", "")]


def test_the_operator_can_do_what_it_needs_and_no_more(installed: Kube):
    assert [a for a in ALLOWED if not can_i(installed, *a)] == []
    assert [d for d in DENIED if can_i(installed, *d)] == []
