"""Past one pod on the real control plane: a PP=2 CPU engine runs as a LeaderWorkerSet group of two pods
(LWS's own controller and webhooks), whose ranks find each other through the headless Service's names and
serve one model; the ScaledObject and InferencePool `kiln render` prints for an engine and for a pool (one scaling
to zero) are accepted by their real CRDs (server-side dry-run: no KEDA or endpoint-picker controller runs here)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest
import yaml
from clusterlib import GROUP, ROOT, Kube, endpoint_addresses
from conftest import ENGINE_NS, engine_manifest

pytestmark = pytest.mark.timeout(1800)  # builds and rollouts on a busy 2-core machine

NAME = "tiny-pp2"


def test_a_pp2_engine_serves_from_a_leaderworkerset_group_of_two_pods(installed: Kube, tiny_s3):
    installed.apply(engine_manifest(NAME, tiny_s3, "r1", pipelineParallel=2, gpusPerNode=1))
    (address,) = installed.wait_for("the group's endpoint", lambda: endpoint_addresses(installed, NAME, ENGINE_NS),
                                    timeout=900, every=2)
    lws = installed.get("leaderworkersets.leaderworkerset.x-k8s.io", ns=ENGINE_NS)
    assert [x["spec"]["leaderWorkerTemplate"]["size"] for x in lws] == [2]
    pods = installed.get("pods", ns=ENGINE_NS, selector=f"leaderworkerset.sigs.k8s.io/name={lws[0]['metadata']['name']}")
    assert len(pods) == 2  # the leader and one worker, one pipeline stage each
    body = {"model": NAME, "prompt": "hello there", "max_tokens": 8, "temperature": 0}
    req = urllib.request.Request(f"http://{address[0]}:{address[1]}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert json.loads(resp.read())["choices"][0]["text"]
    installed.kubectl("delete", f"llmengines.{GROUP}", NAME, "-n", ENGINE_NS, "--wait=true")


def test_the_rendered_scaled_object_and_inference_pool_are_accepted_by_their_real_crds(installed: Kube):
    done = subprocess.run([sys.executable, "-P", "-m", "kiln", "render", "-f",
                           str(ROOT / "examples" / "llama-3.1-8b-autoscaled.yaml"), "-n", ENGINE_NS],
                          capture_output=True, text=True, check=True)
    wanted = [d for d in yaml.safe_load_all(done.stdout) if d and d["kind"] in ("ScaledObject", "InferencePool")]
    assert sorted(d["kind"] for d in wanted) == ["InferencePool", "ScaledObject"]
    out = installed.apply(wanted, "--server-side", "--dry-run=server")
    assert out.count("(server dry run)") == 2, out


def test_a_pools_rendered_inference_pool_and_scale_to_zero_scaled_object_are_accepted_by_the_real_crds(
        installed: Kube, tmp_path):
    pool = yaml.safe_load((ROOT / "examples" / "pool-cpu.yaml").read_text())
    pool["spec"]["routing"] = {"inferencePool": True}
    pool["spec"]["autoscaling"] = {"minReplicas": 0, "maxReplicas": 3}
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(pool))
    done = subprocess.run([sys.executable, "-P", "-m", "kiln", "render", "-f", str(tmp_path / "pool.yaml"), "-n",
                           ENGINE_NS], capture_output=True, text=True, check=True)
    rendered = [d for d in yaml.safe_load_all(done.stdout) if d]
    # The HTTPScaledObject is checked against the add-on's own schema in tests/operator (its CRD is not here).
    assert [d["metadata"]["name"] for d in rendered if d["kind"] == "HTTPScaledObject"] == ["cpu-pool-pool"]
    wanted = [d for d in rendered if d["kind"] in ("InferencePool", "ScaledObject")]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in wanted) == [
        ("InferencePool", "cpu-pool-pool"), ("ScaledObject", "cpu-pool-pool")]
    assert "external-push" in [t["type"] for d in wanted if d["kind"] == "ScaledObject" for t in d["spec"]["triggers"]]
    out = installed.apply(wanted, "--server-side", "--dry-run=server")
    assert out.count("(server dry run)") == 2, out
