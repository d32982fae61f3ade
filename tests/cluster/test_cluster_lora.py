"""LoRA on the real control plane: an adapter added to a running engine's spec.lora is built by its own Job,
listed in the engine's adapters ConfigMap, and reaches the serving pod through the kubelet-style volume
refresh, without a restart (docs/lora.md)."""

from __future__ import annotations

import json
import urllib.request

import pytest
from clusterlib import GROUP, Kube, endpoint_addresses
from conftest import ENGINE_NS, engine_manifest

pytestmark = pytest.mark.timeout(1800)  # builds and rollouts on a busy 2-core machine

NAME = "tiny-lora"
LORA = {"maxLoras": 1, "maxLoraRank": 8}


def served_models(address: tuple[str, int]) -> list[str]:
    with urllib.request.urlopen(f"http://{address[0]}:{address[1]}/v1/models", timeout=10) as resp:
        return [m["id"] for m in json.loads(resp.read())["data"]]


def complete(address: tuple[str, int], model: str) -> str:
    body = {"model": model, "prompt": "hello there", "max_tokens": 8, "temperature": 0}
    req = urllib.request.Request(f"http://{address[0]}:{address[1]}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())["choices"][0]["text"]


def test_an_adapter_added_to_spec_lora_reaches_the_running_pod_without_a_restart(installed: Kube, tiny_s3,
                                                                                   tiny_adapter_s3):
    installed.apply(engine_manifest(NAME, tiny_s3, "r1", lora=dict(LORA, adapters=[])))
    (address,) = installed.wait_for("the engine's endpoint", lambda: endpoint_addresses(installed, NAME, ENGINE_NS),
                                    timeout=600, every=2)
    (pod,) = installed.get("pods", ns=ENGINE_NS, selector=f"serving.kiln.dev/engine={NAME}")
    base_text = complete(address, NAME)

    adapters = [{"name": "tiny-a", "source": tiny_adapter_s3, "credentialsSecret": "models"}]
    installed.apply(engine_manifest(NAME, tiny_s3, "r1", lora=dict(LORA, adapters=adapters)))
    installed.wait_for("tiny-a served", lambda: "tiny-a" in served_models(address), timeout=600, every=2)
    assert complete(address, "tiny-a") != base_text, "the adapter changes the greedy output"
    (after,) = installed.get("pods", ns=ENGINE_NS, selector=f"serving.kiln.dev/engine={NAME}")
    assert after["metadata"]["uid"] == pod["metadata"]["uid"]
    assert after["status"]["containerStatuses"][0]["restartCount"] == 0
    eng = installed.engine(NAME, ENGINE_NS)
    assert [a["phase"] for a in eng["status"]["adapters"]] == ["Ready"]
    installed.kubectl("delete", f"llmengines.{GROUP}", NAME, "-n", ENGINE_NS, "--wait=true")
