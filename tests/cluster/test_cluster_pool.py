"""Engine pools on the real control plane (issue 42, docs/pools.md): an LLMEnginePool's pod serves the engines
whose spec.serving.pool names it. An engine built as usual is listed in the pool's engine list (a ConfigMap the
pod follows through the kubelet-style volume refresh) and answers through the pool's Service under its name; the
member's LoRA adapter, built by its own Job, answers through the pool under its own name; a second engine joins
the running pod without a restart; an engine named as a member's adapter takes that name from it until it leaves;
one that leaves is unloaded, is a 404 naming the pool's models, and gets its
own Deployment again, whose greedy answers (its own and its adapter's) are the pool's; an engine that cannot fit
a pool's budget is refused naming both figures, and that pool goes Failed naming spec.memoryBudget; a member
deleted is dropped from the pod's list within seconds.

The tests run in file order and share the pool and its engines (one story, as in test_cluster_engine_life)."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from clusterlib import GROUP, Kube, endpoint_addresses
from conftest import ENGINE_NS, MODELS_BUCKET, engine_manifest

from kiln.memory_budget import human, parse_quantity

pytestmark = pytest.mark.timeout(1800)  # builds and rollouts on a busy 2-core machine

POOL, TIGHT = "tiny-pool", "tiny-tight"
A, B = "pool-a", "pool-b"
ADAPTER = "pool-a-lora"  # pool-a's LoRA adapter: a request names it as it names an engine of the pool
BUDGET, TIGHT_BUDGET = "2Gi", "1Mi"  # a tiny engine's plan alone (KV pool and weights) is above 1.8 MiB
BUILD_TIMEOUT = 900
POOLS = f"llmenginepools.{GROUP}"
seen: dict[str, str] = {}  # greedy answers, by engine, as the pool gave them


def pool_manifest(name: str, budget: str, replicas: int = 1) -> dict:
    return {"apiVersion": f"{GROUP}/v1alpha1", "kind": "LLMEnginePool",
            "metadata": {"name": name, "namespace": ENGINE_NS},
            "spec": {"gpu": "cpu", "replicas": replicas, "port": 8000, "memoryBudget": budget,
                     "maxLoadedEngines": 2}}


def member_manifest(name: str, source: str, pool: str | None, lora: dict | None = None) -> dict:
    return engine_manifest(name, source, "r1", **({"serving": {"pool": pool}} if pool else {}),
                           **({"lora": lora} if lora else {}))


@pytest.fixture(scope="module")
def a_lora(tiny_adapter_s3: str) -> dict:
    """pool-a's spec.lora, the same in each of its manifests here (so one build envelope): one adapter."""
    return {"maxLoras": 1, "maxLoraRank": 8,
            "adapters": [{"name": ADAPTER, "source": tiny_adapter_s3, "credentialsSecret": "models"}]}


@pytest.fixture(scope="module")
def tiny_b_s3(installed: Kube, tmp_path_factory) -> str:
    """A second random-weight Llama (another seed: its greedy answers differ from the first's)."""
    from kiln.engine.random_checkpoint import make_random_model

    out = make_random_model(tmp_path_factory.mktemp("tiny-b"), "llama-tiny", seed=4)
    for path in out.iterdir():
        installed.s3().upload_file(str(path), MODELS_BUCKET, f"tiny-b/{path.name}")
    return f"s3://{MODELS_BUCKET}/tiny-b"


@pytest.fixture(scope="module")
def pools(installed: Kube) -> Iterator[Kube]:
    """The pool CRD established; the pools and engines this file made are deleted after it."""
    installed.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{POOLS}")
    yield installed
    for kind, names in ((f"llmengines.{GROUP}", (A, B, ADAPTER)), (POOLS, (POOL, TIGHT))):
        installed.kubectl("delete", kind, *names, "-n", ENGINE_NS, "--ignore-not-found", "--wait=true",
                          "--timeout=120s", check=False)


def get_pool(kube: Kube, name: str = POOL) -> dict:
    return kube.get(POOLS, name, ENGINE_NS) or {}


def member(pool: dict, name: str) -> dict:
    return next((m for m in (pool.get("status") or {}).get("engines") or [] if m["name"] == name), {})


def call(address: tuple[str, int], path: str, body: dict | None = None) -> tuple[int, dict]:
    """(HTTP status, JSON body) of a GET (no body) or POST to the pool's pod; the first request for an engine waits
    for its load."""
    req = urllib.request.Request(f"http://{address[0]}:{address[1]}{path}",
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def complete(address: tuple[str, int], model: str, answered: bool = True) -> str | None:
    """``model``'s greedy answer; with ``answered=False``, None while the pod does not know the name (404)."""
    status, body = call(address, "/v1/completions",
                        {"model": model, "prompt": "hello there", "max_tokens": 8, "temperature": 0})
    if status == 404 and not answered:
        return None
    assert status == 200, f"{model}: {status} {body}"
    return body["choices"][0]["text"]


def models(address: tuple[str, int]) -> dict[str, dict]:
    status, body = call(address, "/v1/models")
    assert status == 200, body
    return {m["id"]: m for m in body["data"]}


def evictions(address: tuple[str, int], engine: str) -> dict[str, float]:
    """kiln:pool_engine_evictions_total of ``engine`` on the pod's /metrics, by reason."""
    with urllib.request.urlopen(f"http://{address[0]}:{address[1]}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out = {}
    for labels, value in re.findall(r"^kiln:pool_engine_evictions_total\{([^}]*)\} (\S+)$", text, re.M):
        label = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if label.get("engine") == engine:
            out[label["reason"]] = float(value)
    return out


def pool_address(kube: Kube) -> tuple[str, int]:
    (address,) = kube.wait_for("the pool Service's endpoint", lambda: endpoint_addresses(kube, f"{POOL}-pool",
                                                                                          ENGINE_NS),
                               timeout=600, every=2)
    return address


def pool_pod(kube: Kube) -> dict:
    pods = [p for p in kube.get("pods", ns=ENGINE_NS, selector=f"{GROUP}/pool={POOL}") or []
            if p["metadata"]["name"].startswith(f"{POOL}-pool-") and not p["metadata"].get("deletionTimestamp")]
    assert len(pods) == 1, f"one pod of {POOL}-pool expected: {[p['metadata']['name'] for p in pods]}"
    return pods[0]


def listed(kube: Kube, name: str) -> dict | None:
    """The pool, once it lists ``name`` (failing at once if the engine or the pool failed)."""
    eng, pool = kube.engine(name, ENGINE_NS) or {}, get_pool(kube)
    for obj in (eng, pool):
        if (obj.get("status") or {}).get("phase") == "Failed":
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']} failed: {json.dumps(obj['status'])[:2000]}")
    return pool if member(pool, name).get("state") == "Listed" else None


def engine_list(kube: Kube) -> dict[str, dict]:
    cm = kube.get("configmap", f"{POOL}-pool-engines", ENGINE_NS) or {}
    doc = json.loads((cm.get("data") or {}).get("engines.json") or '{"engines": []}')
    return {e["name"]: e for e in doc["engines"]}


def test_a_member_is_built_listed_and_answers_through_the_pool_service(pools: Kube, tiny_s3, a_lora):
    pools.apply(pool_manifest(POOL, BUDGET))
    pools.apply(member_manifest(A, tiny_s3, POOL, a_lora))
    pool = pools.wait_for(f"{A} listed in {POOL}", lambda: listed(pools, A), timeout=BUILD_TIMEOUT, every=2)
    eng = pools.engine(A, ENGINE_NS)
    entry = engine_list(pools)[A]
    assert entry["artifactURI"] == eng["status"]["artifactURI"]
    assert entry["contentDigest"] == eng["status"]["artifact"]["contentDigest"]
    assert pool["status"]["endpoint"] == f"http://{POOL}-pool.{ENGINE_NS}.svc:8000/v1"
    assert pools.get("deployment", A, ENGINE_NS) is None, "a member has no Deployment of its own"
    address = pool_address(pools)
    served = pools.wait_for(f"{A} on the pod's /v1/models", lambda: models(address), timeout=120, every=2)
    assert set(served) == {A}, served
    assert served[A]["memory_bytes"] == member(pool, A)["memoryBytes"], "the operator counts what the pod counts"
    seen[A] = complete(address, A)
    assert models(address)[A]["state"] == "loaded"
    eng = pools.wait_for(f"{A} Ready through the pool", lambda: (
        (e := pools.engine(A, ENGINE_NS)) and (e["status"] or {}).get("phase") == "Ready" and e),
        timeout=300)  # Ready pools.listSyncSeconds (10 s in the local values) after it was listed, at its next timer
    assert eng["status"]["endpoint"] == pool["status"]["endpoint"]
    assert {k: eng["status"]["pool"].get(k) for k in ("name", "state")} == {"name": POOL, "state": "Listed"}
    # Its adapter, built by its own Job against that version, reaches the pod through the pool's adapter list.
    seen[ADAPTER] = pools.wait_for(f"{ADAPTER} answering through the pool", lambda: complete(
        address, ADAPTER, answered=False), timeout=BUILD_TIMEOUT, every=2)
    assert seen[ADAPTER] != seen[A], "the adapter changes the greedy output"
    assert models(address)[ADAPTER]["parent"] == A
    assert [a["phase"] for a in pools.engine(A, ENGINE_NS)["status"]["adapters"]] == ["Ready"]


def test_an_engine_joins_the_running_pool_and_answers_without_a_pod_restart(pools: Kube, tiny_b_s3):
    address, pod = pool_address(pools), pool_pod(pools)
    pools.apply(member_manifest(B, tiny_b_s3, POOL))
    pools.wait_for(f"{B} listed in {POOL}", lambda: listed(pools, B), timeout=BUILD_TIMEOUT, every=2)
    pools.wait_for(f"{B} on the pod's /v1/models", lambda: B in models(address), timeout=120, every=2)
    seen[B] = complete(address, B)
    assert seen[B] != seen[A], "each name runs its own engine (two random models answer differently)"
    assert complete(address, A) == seen[A]
    assert {m["state"] for m in models(address).values() if "state" in m} == {"loaded"}  # adapters have none
    after = pool_pod(pools)
    assert after["metadata"]["uid"] == pod["metadata"]["uid"], "the pool's pod followed its engine list"
    assert after["status"]["containerStatuses"][0]["restartCount"] == 0


def adapter_message(kube: Kube, engine: str, adapter: str) -> str | None:
    """The message of ``adapter`` in the engine's status.adapters (None: none, or no such adapter)."""
    status = (kube.engine(engine, ENGINE_NS) or {}).get("status") or {}
    return next((a.get("message") for a in status.get("adapters") or [] if a["name"] == adapter), None)


def test_an_engine_named_as_a_members_adapter_takes_the_name_and_gives_it_back_when_it_leaves(pools: Kube, tiny_s3,
                                                                                              a_lora):
    """An engine named pool-a-lora joins (pool-a's checkpoint and slot limits, so pool-a's version: no Job). A request
    naming pool-a-lora reaches it, so pool-a's adapter of that name is left out of the pool's adapter list, and
    pool-a's status.adapters says so; once the engine leaves, the adapter answers under its name again."""
    address = pool_address(pools)
    pools.apply(member_manifest(ADAPTER, tiny_s3, POOL, {**a_lora, "adapters": []}))
    pools.wait_for(f"{ADAPTER} listed in {POOL}", lambda: listed(pools, ADAPTER), timeout=BUILD_TIMEOUT, every=2)
    same = pools.engine(ADAPTER, ENGINE_NS)["status"]["artifactURI"] == pools.engine(A, ENGINE_NS)["status"][
        "artifactURI"]
    assert same, "the engine is pool-a's build envelope, so pool-a's artifact"
    # The pod reads its adapter list at each request and its engine list every few seconds, but a name found in
    # neither reads the engine list once more before its 404: the name is answered throughout (200), first by
    # the adapter, then by the engine.
    pools.wait_for(f"{ADAPTER} answered by the engine of that name", lambda: complete(address, ADAPTER) == seen[A],
                   timeout=120, every=2)
    pools.wait_for(f"{ADAPTER} listed once on /v1/models, as an engine", lambda: [
        m.get("parent") for m in call(address, "/v1/models")[1]["data"] if m["id"] == ADAPTER] == [None],
        timeout=120, every=2)
    left = pools.wait_for(f"{ADAPTER} left out of {A}'s entry", lambda: member(get_pool(pools), A).get(
        "adaptersLeftOut"), timeout=60, every=2)
    assert [a["name"] for a in left] == [ADAPTER]
    said = pools.wait_for(f"{A}'s status.adapters saying so", lambda: adapter_message(pools, A, ADAPTER),
                          timeout=120, every=2)
    assert said.startswith(f"built, but the pool {POOL!r} does not serve it: ") and "rename the adapter" in said
    pools.kubectl("delete", f"llmengines.{GROUP}", ADAPTER, "-n", ENGINE_NS, "--wait=true", "--timeout=120s")
    # Answered throughout the leave as well (200): a request waiting for the engine as it leaves looks the name up
    # once more, and the adapter is read into pool-a's engine before a request for it goes on.
    pools.wait_for(f"{ADAPTER} answered by {A}'s adapter again", lambda: complete(address, ADAPTER) == seen[ADAPTER],
                   timeout=120, every=2)
    assert models(address)[ADAPTER]["parent"] == A
    pools.wait_for(f"the message gone from {A}'s status.adapters", lambda: adapter_message(pools, A, ADAPTER) is None,
                   timeout=120, every=2)


def test_an_engine_that_leaves_is_unloaded_and_serves_alone_as_it_did_in_the_pool(pools: Kube, tiny_s3, a_lora):
    address, pod = pool_address(pools), pool_pod(pools)
    pools.apply(member_manifest(A, tiny_s3, None, a_lora))
    pools.wait_for(f"{A} gone from the pod's /v1/models", lambda: A not in models(address), timeout=120, every=2)
    assert A not in engine_list(pools) and not member(get_pool(pools), A)
    status, body = call(address, "/v1/completions", {"model": A, "prompt": "hello there", "max_tokens": 8})
    assert status == 404, body
    assert f"the pool serves {B!r}" in body["error"]["message"], body
    pools.wait_for(f"{A} unloaded", lambda: evictions(address, A).get("removed") == 1, timeout=60, every=2)
    assert complete(address, B) == seen[B]
    assert pool_pod(pools)["metadata"]["uid"] == pod["metadata"]["uid"]
    (alone,) = pools.wait_for(f"{A}'s own endpoint", lambda: endpoint_addresses(pools, A, ENGINE_NS),
                              timeout=600, every=2)
    assert complete(alone, A) == seen[A], "greedy: the pool answered as the engine alone does"
    assert pools.wait_for(f"{ADAPTER} on {A}'s own pod", lambda: complete(alone, ADAPTER, answered=False),
                          timeout=300, every=2) == seen[ADAPTER], "and its adapter as it does there"


def test_an_engine_too_big_for_a_pool_is_refused_naming_both_figures(pools: Kube, tiny_s3, a_lora):
    pools.apply(pool_manifest(TIGHT, TIGHT_BUDGET, replicas=0))
    pools.apply(member_manifest(A, tiny_s3, TIGHT, a_lora))

    def refused():
        eng, pool = pools.engine(A, ENGINE_NS) or {}, get_pool(pools, TIGHT)
        done = (eng.get("status") or {}).get("phase") == "Failed" and member(pool, A).get("state") == "Refused"
        return (eng, pool) if done and (pool.get("status") or {}).get("phase") == "Failed" else None

    eng, pool = pools.wait_for(f"{A} refused by {TIGHT}", refused, timeout=300, every=2)
    needs, budget = member(pool, A)["memoryBytes"], parse_quantity(TIGHT_BUDGET)
    assert needs > budget
    (cond,) = [c for c in eng["status"]["conditions"] if c.get("reason") == "EngineTooBigForPool"]
    for text in (human(needs), human(budget), "spec.memoryBudget"):
        assert text in cond["message"], cond
    ready = pools.condition(pool, "Ready")
    assert ready["status"] == "False" and ready["reason"] == "BudgetTooSmall", ready
    assert "spec.memoryBudget" in ready["message"] and human(needs) in ready["message"], ready


def test_a_member_deleted_is_dropped_from_the_pool_within_seconds(pools: Kube):
    address, pod = pool_address(pools), pool_pod(pools)
    pools.kubectl("delete", f"llmengines.{GROUP}", B, "-n", ENGINE_NS, "--wait=true", "--timeout=120s")
    pools.wait_for(f"{B} gone from the pod's /v1/models", lambda: B not in models(address), timeout=60, every=2)
    assert engine_list(pools) == {} and not member(get_pool(pools), B)
    assert evictions(address, B).get("removed") == 1
    status, body = call(address, "/v1/completions", {"model": B, "prompt": "hello there", "max_tokens": 8})
    assert status == 404 and "no engines yet" in body["error"]["message"], body
    assert pool_pod(pools)["metadata"]["uid"] == pod["metadata"]["uid"]
