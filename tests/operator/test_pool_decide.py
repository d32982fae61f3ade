"""An engine pool's reconcile decisions, without a cluster: each member's state, the engine list, the pool's status,
and the pool's rendered objects (the engine list never in the pod template)."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
from harness import SPEC
from kiln.operator.pool_decide import (
    BUDGET_TOO_SMALL,
    BUILDING,
    LISTED,
    REFUSED,
    MemberView,
    PoolWorld,
    budget,
    changed_members,
    compose_pool_status,
    judge,
    judge_all,
    listed_adapters,
    listed_entries,
)
from kiln.operator.pool_member import POOL_MISMATCH, refusal
from kiln.operator.pools import build_engines_configmap, render_pool
from kiln.operator.settings import OperatorConfig
from kiln.operator.validation import InvalidSpec

from kiln import adapter_list
from kiln.adapter_list import ADAPTERS_FILE_ENV
from kiln.api import LLMEngineSpec
from kiln.engine_list import EngineEntry
from kiln.memory_budget import SERVER_MARGIN_BYTES
from kiln.pool_api import LLMEnginePoolSpec

GiB = 2**30
DIGEST = "d" * 64


def engine(**overrides) -> LLMEngineSpec:
    raw = copy.deepcopy(SPEC)
    raw.update(overrides)
    return LLMEngineSpec.model_validate(raw)


def member(name: str, memory: int | None = GiB, spec: LLMEngineSpec | None = None, **fields) -> MemberView:
    """A built, pinned member counting ``memory`` bytes (None: being built)."""
    if memory is None:
        return MemberView(name, spec or engine(), f"{name}-v", **fields)
    return MemberView(name, spec or engine(), f"{name}-v", DIGEST, f"s3://b/kiln/engines/{name}-v",
                      (memory, "measured by the build (build_report.memory.stages.tune)"), **fields)


def pool(**spec) -> LLMEnginePoolSpec:
    return LLMEnginePoolSpec.model_validate(spec)


def world(spec: LLMEnginePoolSpec, *members: MemberView, ready: int = 0, status: dict | None = None) -> PoolWorld:
    body = {"metadata": {"name": "shared", "namespace": "ml", "generation": 3}, "status": status or {}}
    return PoolWorld(body, spec=spec, members=members, deployment={"status": {"readyReplicas": ready}})


def test_a_member_is_building_until_its_current_version_is_built_and_pinned():
    entry = judge(member("chat", memory=None), "shared", pool(memoryBudget="4Gi"))
    assert (entry.state, entry.engine_version, entry.memory_bytes) == (BUILDING, "chat-v", None)
    waiting = MemberView("chat", engine(), "chat-v", DIGEST, waiting="its artifact chat-v is not in the store")
    assert judge(waiting, "shared", pool()).state == BUILDING
    assert judge(waiting, "shared", pool()).message == "its artifact chat-v is not in the store"


def test_a_member_that_fits_is_listed_with_its_artifact_and_the_digest_its_engine_pinned():
    w = world(pool(memoryBudget="4Gi"), member("chat", 3 * GiB), member("sql", memory=None))
    judged = judge_all(w)
    assert [(j.name, j.state, j.memory_bytes) for j in judged] == [("chat", LISTED, 3 * GiB), ("sql", BUILDING, None)]
    [entry] = listed_entries(w, judged)
    assert (entry.name, entry.artifact_uri, entry.content_digest) == ("chat", "s3://b/kiln/engines/chat-v", DIGEST)


def test_an_engine_too_big_is_refused_naming_both_figures_both_fields_and_the_fix():
    entry = judge(member("big", 3 * GiB), "shared", pool(memoryBudget="2Gi"))
    assert entry.state == REFUSED and entry.memory_bytes == 3 * GiB
    assert "engine big counts 3.00 GiB (measured by the build" in entry.message
    assert "budget of 2.00 GiB (spec.memoryBudget (2Gi))" in entry.message
    assert "raise the pool's spec.memoryBudget to at least 3.00 GiB" in entry.message
    assert "spec.serving.pool" in entry.message


def test_the_budget_is_memory_budget_else_the_memory_limit_less_the_margins_else_unknown():
    assert budget(pool(memoryBudget="6Gi")) == (6 * GiB, "spec.memoryBudget (6Gi)")
    limited = pool(resources={"limits": {"memory": "4Gi"}})
    room = budget(limited)
    assert room is not None and room[0] == int(4 * GiB * 0.9) - SERVER_MARGIN_BYTES
    assert room[1].startswith("spec.resources.limits.memory (4.00 GiB) less 10%")
    entry = judge(member("big", 4 * GiB), "shared", limited)
    # the least limit whose budget (less 10% and 768Mi) holds 4 GiB: (4 GiB + 768 MiB) / 0.9 = 5.28 GiB
    assert entry.state == REFUSED
    assert "raise the pool's spec.resources.limits.memory to at least 5.28 GiB" in entry.message
    assert budget(pool()) is None
    assert judge(member("huge", 500 * GiB), "shared", pool()).state == LISTED  # the pods refuse at load


def test_another_gpu_or_more_than_one_rank_is_refused_before_the_build():
    other = judge(member("g", memory=None, spec=engine(gpu="H100-80GB", dtype="bfloat16")), "shared", pool())
    assert other.state == REFUSED and "spec.gpu H100-80GB" in other.message and "spec.gpu cpu" in other.message
    wide = engine(gpu="H100-80GB", dtype="bfloat16", tensorParallel=8, pipelineParallel=2)
    spans = judge(member("w", memory=None, spec=wide), "shared", pool(gpu="H100-80GB"))
    assert spans.state == REFUSED and "runs 16 ranks" in spans.message
    roomy = pool(gpu="H100-80GB", resources={"limits": {"nvidia.com/gpu": 2}})
    for parallel in ({"tensorParallel": 2}, {"pipelineParallel": 2}):  # the pool's runtime loads one rank per engine
        entry = judge(member("t", spec=engine(gpu="H100-80GB", dtype="bfloat16", **parallel)), "shared", roomy)
        assert entry.state == REFUSED and entry.memory_bytes is None
        assert "spec.tensorParallel x spec.pipelineParallel" in entry.message and "set both to 1" in entry.message
    assert refusal(entry.to_k8s()) == POOL_MISMATCH
    assert judge(member("one", spec=engine(gpu="H100-80GB", dtype="bfloat16")), "shared", roomy).state == LISTED


def test_an_untrusted_artifact_is_refused_with_its_problem():
    entry = judge(member("chat", problem="engine chat: its artifact chat-v is not listed: unsigned"), "shared",
                  pool())
    assert entry.state == REFUSED and entry.message.endswith("unsigned")


def test_a_budget_too_small_for_every_built_member_fails_the_pool_naming_the_field_and_the_smallest():
    w = world(pool(memoryBudget="1Gi"), member("a", 3 * GiB), member("b", 2 * GiB), member("c", memory=None),
              ready=1)
    status = compose_pool_status(w, judge_all(w), now="2026-01-01T00:00:00Z")
    assert status["phase"] == "Failed"
    [cond] = status["conditions"]
    assert (cond["status"], cond["reason"]) == ("False", BUDGET_TOO_SMALL)
    assert cond["message"].startswith("spec.memoryBudget: the budget of 1.00 GiB")
    assert "the smallest, b, counts 2.00 GiB" in cond["message"] and "2 built engine(s)" in cond["message"]
    fits = world(pool(memoryBudget="1Gi"), member("a", 3 * GiB), member("s", GiB // 2), ready=1)
    assert compose_pool_status(fits, judge_all(fits))["phase"] == "Ready"
    unbuilt = world(pool(memoryBudget="1Gi"), member("c", memory=None))
    assert compose_pool_status(unbuilt, judge_all(unbuilt))["phase"] == "Pending"


def test_ready_once_a_pod_is_ready_pending_before_and_with_no_replicas():
    w = world(pool(memoryBudget="4Gi", replicas=2), member("chat"))
    pending = compose_pool_status(w, judge_all(w), now="t0")
    assert pending["phase"] == "Pending" and pending["conditions"][0]["reason"] == "PodsNotReady"
    assert pending["endpoint"] == "http://shared-pool.ml.svc:8000/v1" and pending["memoryBudgetBytes"] == 4 * GiB
    assert pending["engines"] == [{"name": "chat", "engineVersion": "chat-v", "state": "Listed", "memoryBytes": GiB}]
    assert pending["listedEngines"] == 1  # kubectl get's Engines column
    ready = world(pool(memoryBudget="4Gi", replicas=2), member("chat"), ready=1, status=pending)
    status = compose_pool_status(ready, judge_all(ready), now="t1")
    assert status["phase"] == "Ready" and status["readyReplicas"] == 1 and status["replicas"] == 2
    assert status["conditions"][0]["lastTransitionTime"] == "t1" and status["observedGeneration"] == 3
    idle = world(pool(replicas=0), ready=0)
    assert compose_pool_status(idle, [])["conditions"][0]["reason"] == "NoReplicas"


def test_a_pool_keda_took_to_zero_is_ready_not_serving_and_says_how_a_request_wakes_it():
    scaled = pool(memoryBudget="4Gi", autoscaling={"minReplicas": 0, "maxReplicas": 3})
    w = world(scaled, member("chat"))
    w = replace(w, deployment={"spec": {"replicas": 0}, "status": {}})  # KEDA's count after the cooldown
    status = compose_pool_status(w, judge_all(w), now="t0")
    (ready,) = status["conditions"]
    assert status["phase"] == "Ready" and (ready["status"], ready["reason"]) == ("False", "ScaledToZero")
    assert ready["message"] == ("scaled to zero by ScaledObject/shared-pool; a request through the KEDA HTTP add-on's "
                                "interceptor (Host: shared-pool.ml.svc) starts a pod")
    assert (status["replicas"], status["readyReplicas"], status["listedEngines"]) == (0, 0, 1)
    woken = replace(w, deployment={"spec": {"replicas": 1}, "status": {"readyReplicas": 1}})
    assert compose_pool_status(woken, judge_all(woken))["conditions"][0]["reason"] == "Serving"
    starting = replace(w, deployment={"spec": {"replicas": 1}, "status": {}})  # the request's pod is starting
    assert compose_pool_status(starting, judge_all(starting))["conditions"][0]["reason"] == "PodsNotReady"


def test_an_invalid_pool_fails_with_the_field():
    w = PoolWorld({"metadata": {"name": "p", "namespace": "ml"}}, invalid="spec.engines: lists manifests")
    status = compose_pool_status(w, [])
    assert status["phase"] == "Failed" and status["conditions"][0]["reason"] == "InvalidSpec"
    assert status["conditions"][0]["message"] == "spec.engines: lists manifests"


def test_the_engines_whose_view_of_the_pool_changed():
    a, b = {"name": "a", "state": "Listed"}, {"name": "b", "state": "Building"}
    old = {"phase": "Ready", "endpoint": "e", "engines": [a, b]}
    assert changed_members(old, {**old}) == set()
    assert changed_members(old, {**old, "engines": [a, {**b, "state": "Listed"}]}) == {"b"}
    assert changed_members(old, {**old, "engines": [b]}) == {"a"}
    assert changed_members(old, {**old, "phase": "Pending"}) == {"a", "b"}
    serving, zero = ([{"type": "Ready", "reason": reason}] for reason in ("Serving", "ScaledToZero"))
    assert changed_members({**old, "conditions": serving}, {**old, "conditions": zero}) == {"a", "b"}  # still Ready


def adapters(*items: tuple[str, str, str | None]) -> dict:
    """An <engine>-adapters ConfigMap's list: (name, base version, pinned digest or None)."""
    return adapter_list.document([adapter_list.entry(name, f"s3://b/kiln/engines/{base}-{name}", f"{base}-{name}",
                                                     base, digest) for name, base, digest in items])


def test_the_pools_adapter_list_holds_the_pinned_adapters_of_each_listed_members_listed_version():
    lora = engine(lora={"adapters": [{"name": "sql", "source": "s3://adapters/sql", "revision": "v1"}]})
    doc = adapters(("sql", "chat-v", DIGEST), ("old", "chat-old", DIGEST), ("unpinned", "chat-v", None))
    w = world(pool(memoryBudget="4Gi"), member("chat", GiB, lora, adapters=doc),
              member("big", 8 * GiB, lora, adapters=adapters(("sql", "big-v", DIGEST))),
              member("new", None, lora, adapters=adapters(("sql", "new-v", DIGEST))),
              member("bad", GiB, lora, adapters={"format": 99, "adapters": doc["adapters"]}))
    judged = judge_all(w)
    assert [j.state for j in judged] == [LISTED, REFUSED, LISTED, BUILDING]  # bad, big, chat, new
    # chat's adapter of the version the pool lists, pinned: not its old base's, not one without a pin, nothing of a
    # refused or building member, nothing of a list in another format
    assert listed_adapters(w, judged) == [adapter_list.entry("sql", "s3://b/kiln/engines/chat-v-sql", "chat-v-sql",
                                                             "chat-v", DIGEST)]
    twin = replace(w, members=(*w.members, replace(w.members[0], name="chat2")))  # the same build under two names
    assert len(listed_adapters(twin, judge_all(twin))) == 1
    assert listed_adapters(world(pool(), member("chat", GiB, lora)), [judge(member("chat"), "shared", pool())]) == []


def test_an_adapter_name_says_which_engine_within_a_pool_so_a_clash_is_left_out_and_said():
    """A request names an adapter as it names an engine: of one adapter name on two members' bases, the member
    listed first keeps it; an adapter named as one of the pool's engines is left out; both are said on the
    member's entry of the pool's status."""
    lora = engine(lora={"adapters": [{"name": "sql", "source": "s3://adapters/sql", "revision": "v1"}]})
    w = world(pool(memoryBudget="8Gi"),
              member("chat", GiB, lora, adapters=adapters(("sql", "chat-v", DIGEST), ("tone", "chat-v", DIGEST))),
              member("code", GiB, lora, adapters=adapters(("sql", "code-v", DIGEST), ("chat", "code-v", DIGEST),
                                                          ("docs", "code-v", DIGEST))))
    judged = [j.model_copy(update={"listed_since": since}) for j, since in
              zip(judge_all(w), ["2026-01-02T00:00:00Z", "2026-01-01T00:00:00Z"], strict=True)]  # code listed first
    listed = {(e["baseEngineVersion"], e["name"]) for e in listed_adapters(w, judged)}
    assert listed == {("code-v", "sql"), ("code-v", "docs"), ("chat-v", "tone")}
    entries = {e["name"]: e for e in compose_pool_status(w, judged)["engines"]}
    assert "'sql' is not served by the pool: 'code', listed before it" in entries["chat"]["message"]
    assert "'chat' is not served by the pool: the pool has an engine of that name" in entries["code"]["message"]
    assert "sql" not in entries["code"]["message"] and "tone" not in entries["chat"]["message"]
    # ... and listed by name, which the member's status.adapters reads (kiln.operator.pool_member)
    assert [a["name"] for a in entries["chat"]["adaptersLeftOut"]] == ["sql"]
    assert [a["name"] for a in entries["code"]["adaptersLeftOut"]] == ["chat"]
    assert entries["code"]["adaptersLeftOut"][0]["message"] in entries["code"]["message"]
    # listed in the other order, chat keeps sql
    judged = [j.model_copy(update={"listed_since": None}) for j in judged]
    assert ("chat-v", "sql") in {(e["baseEngineVersion"], e["name"]) for e in listed_adapters(w, judged)}


def test_the_pools_pods_follow_the_adapter_list_beside_the_engine_list_and_it_never_rolls_them():
    config = OperatorConfig(store_uri="s3://b/kiln")
    listed = [adapter_list.entry("sql", "s3://b/kiln/engines/chat-v-sql", "chat-v-sql", "chat-v", DIGEST)]
    configmap = build_engines_configmap("shared", "ml", [], adapters=listed)
    assert json.loads(configmap["data"]["adapters.json"]) == adapter_list.document(listed)
    assert json.loads(build_engines_configmap("shared", "ml", [])["data"]["adapters.json"]) == {
        "format": 1, "adapters": []}
    [container] = render_pool({}, "shared", "ml", config)[1]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env[ADAPTERS_FILE_ENV] == "/etc/kiln/pool/adapters.json"  # in the directory mount the kubelet refreshes
    mount = next(m for m in container["volumeMounts"] if m["name"] == "engines")
    assert mount["mountPath"] == "/etc/kiln/pool" and "subPath" not in mount


def test_render_pool_lists_no_engine_in_the_pod_template_and_refuses_a_bad_spec_naming_the_field():
    config = OperatorConfig(store_uri="s3://b/kiln")
    body = {"apiVersion": "serving.kiln.dev/v1alpha1", "kind": "LLMEnginePool", "metadata": {"name": "shared"},
            "spec": {"memoryBudget": "6Gi", "replicas": 2, "nodeSelector": {"pool": "yes"}}}
    configmap, deployment, service, pdb, netpol = render_pool(body, "shared", "ml", config)
    assert (configmap["metadata"]["name"], deployment["metadata"]["name"], service["metadata"]["name"]) == (
        "shared-pool-engines", "shared-pool", "shared-pool")
    # 2 pods: a node drain takes them one at a time; 1 pod (or an autoscaled floor of 1): no budget to hang a drain
    assert (pdb["kind"], pdb["metadata"]["name"], pdb["spec"]) == (
        "PodDisruptionBudget", "shared-pool", {"maxUnavailable": 1, "selector": deployment["spec"]["selector"]})
    assert [o["kind"] for o in render_pool({"replicas": 1}, "shared", "ml", config)] == [
        "ConfigMap", "Deployment", "Service", "NetworkPolicy"]
    # The pods run no ranks: the serving port alone is open, from anywhere; off with the chart's networkPolicy
    assert (netpol["kind"], netpol["metadata"]["name"], netpol["spec"]) == ("NetworkPolicy", "shared-pool", {
        "podSelector": deployment["spec"]["selector"], "policyTypes": ["Ingress"],
        "ingress": [{"ports": [{"protocol": "TCP", "port": service["spec"]["ports"][0]["port"]}]}]})
    quiet = OperatorConfig(store_uri="s3://b/kiln", network_policy=False)
    assert "NetworkPolicy" not in [o["kind"] for o in render_pool(body, "shared", "ml", quiet)]
    scaled = {"autoscaling": {"minReplicas": 2, "maxReplicas": 4}, "replicas": 1}
    assert "PodDisruptionBudget" in [o["kind"] for o in render_pool(scaled, "shared", "ml", config)]
    assert json.loads(configmap["data"]["engines.json"]) == {"format": 1, "engines": []}
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["args"][:2] == ["--engines-file", "/etc/kiln/pool/engines.json"]
    assert ["--memory-budget", "6Gi"] == container["args"][container["args"].index("--memory-budget"):][:2]
    assert {"name": "engines", "configMap": {"name": "shared-pool-engines"}} in pod["spec"]["volumes"]
    assert pod["metadata"]["labels"]["serving.kiln.dev/pool"] == "shared"
    assert pod["spec"]["nodeSelector"]["pool"] == "yes"
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert render_pool(body["spec"], "shared", "ml", config)[1] == deployment
    listed = render_pool(body, "shared", "ml", config, [EngineEntry("chat", "s3://b/kiln/engines/v", DIGEST)])
    assert json.loads(listed[0]["data"]["engines.json"])["engines"][0]["contentDigest"] == DIGEST
    assert listed[1] == deployment  # the engine list is not in the pod template: a member joining rolls no pod
    assert "--batch-invariant" not in container["args"]
    steady = render_pool({**body["spec"], "batchInvariant": True}, "shared", "ml", config)[1]
    assert "--batch-invariant" in steady["spec"]["template"]["spec"]["containers"][0]["args"]
    for bad, field in (({"engines": ["a.yaml"]}, "spec.engines"), ({"memoryBudget": "6 GB"}, "spec.memoryBudget"),
                       ({"image": "evil.example/kiln:1"}, "spec.image"),
                       ({"gpu": "L4", "batchInvariant": True}, "spec.batchInvariant: is for CPU pools")):
        with pytest.raises(InvalidSpec, match=field):
            render_pool(bad, "shared", "ml", config)
    with pytest.raises(InvalidSpec, match="metadata.name"):
        render_pool({}, "Shared", "ml", config)


def test_a_member_being_rebuilt_keeps_the_build_the_pool_listed_before_until_the_new_one_is_pinned():
    old = replace(member("chat", GiB), version="chat-old", artifact_uri="s3://b/kiln/engines/chat-old")
    rebuilding = member("chat", memory=None, previous=old)  # its spec's version is chat-v, not built yet
    w = world(pool(memoryBudget="4Gi"), rebuilding, ready=1)
    [judged] = judge_all(w)
    assert (judged.state, judged.engine_version, judged.memory_bytes) == (LISTED, "chat-old", GiB)
    assert judged.message == "building chat-v; chat-old serves"
    assert listed_entries(w, [judged]) == [EngineEntry("chat", "s3://b/kiln/engines/chat-old", DIGEST)]
    # Not when that earlier build is no longer trusted, or no longer fits the budget: Building, listed nowhere.
    for prior, spec in ((replace(old, problem="unsigned"), pool(memoryBudget="4Gi")),
                        (old, pool(memoryBudget="512Mi"))):
        assert judge(member("chat", memory=None, previous=prior), "shared", spec).state == BUILDING
    # Once the new build is pinned, it is listed (the earlier one is not read then).
    assert judge(member("chat", 2 * GiB), "shared", pool(memoryBudget="4Gi")).engine_version == "chat-v"


def test_a_listed_entry_says_since_when_its_version_is_listed_kept_while_it_lists_the_same_version():
    w = world(pool(memoryBudget="4Gi"), member("chat"), member("sql", memory=None))
    first = judge_all(w, "2026-01-01T00:00:00Z")
    assert [j.listed_since for j in first] == ["2026-01-01T00:00:00Z", None]  # Building: not listed
    assert first[0].to_k8s()["listedSince"] == "2026-01-01T00:00:00Z"
    old = {"engines": [j.to_k8s() for j in first]}
    again = judge_all(replace(w, body={**w.body, "status": old}), "2026-01-01T00:01:00Z")
    assert again[0].listed_since == "2026-01-01T00:00:00Z"
    moved = replace(w, body={**w.body, "status": old}, members=(replace(member("chat"), version="chat-w"),))
    assert judge_all(moved, "2026-01-01T00:02:00Z")[0].listed_since == "2026-01-01T00:02:00Z"  # a new version
