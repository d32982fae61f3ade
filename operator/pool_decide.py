"""What one reconcile of an LLMEnginePool decides, as pure functions: no API calls, no store reads, no clock.

:func:`kiln.operator.pool_reconcile.reconcile_pool` reads the pool, its members (the LLMEngines of its namespace
whose ``spec.serving.pool`` names it) and its Deployment into a :class:`PoolWorld`; :func:`judge` gives each member
its state, :func:`listed_entries` the engine list the pool's pods follow, :func:`listed_adapters` the adapter list
they follow beside it (the Listed members' adapters), and :func:`compose_pool_status` the
pool's ``status``. Tested without a cluster (tests/operator/test_pool_decide.py).

A member is, in this order:

- Refused when it can never run in the pool's pods: another ``spec.gpu``, more than one rank
  (``spec.tensorParallel x spec.pipelineParallel``: the pool's runtime loads single-rank engines) (known before it
  is built, so it is refused at once);
- Building until its status shows a built, pinned artifact of its current version (``status.engineVersion`` is
  the spec's, ``status.artifact`` pins it) and the store's manifest is that build (:class:`MemberView`); but a
  member the pool listed before stays Listed at that version meanwhile (its pin from the engine's status.history,
  verified again: :attr:`MemberView.previous`), its message ``building <new>; <old> serves``: a rebuild never
  takes it out of service;
- Refused when that artifact cannot be listed (untrusted, its engine.json unreadable), or when what it counts
  (its verified engine.json: :func:`kiln.memory_budget.engine_memory`) exceeds the pool's budget;
- else Listed.

The budget is ``spec.memoryBudget``, else ``spec.resources.limits.memory`` less the server's margins
(:func:`kiln.memory_budget.budget_of`), else unknown: the node's memory, which only the pods know (nothing is
refused for memory here; the runtime refuses at load). The pool is Failed when its spec is invalid, or when it
has built members and every one of them is too big for the budget (reason BudgetTooSmall naming the field);
Ready when its Deployment has a ready pod, or when KEDA scaled it to zero (``minReplicas: 0``: Ready False,
reason ScaledToZero, as an engine's; a request through the interceptor wakes it); else Pending.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kiln.operator.naming import pool_workload_name
from kiln.operator.pool_member import SCALED_TO_ZERO, ready_condition
from kiln.operator.pools import pool_endpoint
from kiln.operator.status import ObjectRead, condition

from kiln import adapter_list
from kiln.api import LLMEngineSpec
from kiln.engine_list import EngineEntry
from kiln.memory_budget import MARGIN_FRACTION, SERVER_MARGIN_BYTES, budget_of, human
from kiln.pool_api import LeftOutAdapter, LLMEnginePoolSpec, PoolMember, adapter_name_clashes

BUILDING, LISTED, REFUSED = "Building", "Listed", "Refused"
PENDING, READY, FAILED = "Pending", "Ready", "Failed"
# The Ready condition's reasons; a Failed one is posted as a Warning event.
INVALID_SPEC, BUDGET_TOO_SMALL, NO_REPLICAS, PODS_NOT_READY, SERVING, AUTOSCALER_MISSING, NAME_CONFLICT = (
    "InvalidSpec", "BudgetTooSmall", "NoReplicas", "PodsNotReady", "Serving", "AutoscalerMissing", "NameConflict")
PREREQUISITE_MISSING = "PrerequisiteMissing"  # an engine's reason too (status.py): here, the InferencePool CRD
POOL_FAILURES = {INVALID_SPEC, BUDGET_TOO_SMALL, NAME_CONFLICT}


@dataclass(frozen=True)
class MemberView:
    """One LLMEngine whose ``spec.serving.pool`` names the pool, as read (``pool_reconcile.read_member``)."""

    name: str
    spec: LLMEngineSpec
    version: str | None = None  # the engine version of its spec (being built, or built)
    digest: str | None = None  # the content digest its status pinned for ``version`` (None: not built and pinned)
    artifact_uri: str | None = None  # the store's URI of ``version``, once its manifest is there
    memory: tuple[int, str] | None = None  # (bytes, source) its verified engine.json counts
    problem: str | None = None  # why its built artifact cannot be listed (untrusted, engine.json unreadable)
    waiting: str | None = None  # why it is still Building, when it is not simply being built
    adapters: Any = None  # its <engine>-adapters ConfigMap's adapter list, parsed (None: no spec.lora, or none yet)
    previous: MemberView | None = None  # while ``version`` is not built: the verified build the pool listed before


@dataclass(frozen=True)
class PoolWorld(ObjectRead):
    """What one pool reconcile read, once (``pool_reconcile.observe_pool``)."""

    body: dict[str, Any]  # the LLMEnginePool
    invalid: str | None = None  # why its spec can never work (nothing else was read)
    spec: LLMEnginePoolSpec | None = None
    members: tuple[MemberView, ...] = ()
    deployment: dict[str, Any] | None = None  # the pool's Deployment, as read or as applied
    scaler_problem: str | None = None  # why spec.autoscaling's object could not be applied (its API is missing)
    routing_problem: str | None = None  # why spec.routing.inferencePool's InferencePool could not be (likewise)
    taken: str | None = None  # another object controls the Deployment under its name (naming.taken_name)


def budget(spec: LLMEnginePoolSpec) -> tuple[int, str] | None:
    """(bytes, what it is) the loaded engines may count; None when only the pods know (the node's memory)."""
    if (given := spec.memory_budget_bytes) is not None:
        return given, f"spec.memoryBudget ({spec.memory_budget})"
    if (limit := spec.memory_limit_bytes) is not None:
        return budget_of(limit, "spec.resources.limits.memory")
    return None


def budget_field(spec: LLMEnginePoolSpec) -> str:
    """The field that sets the budget (what a fix raises)."""
    return "spec.resources.limits.memory" if spec.memory_budget is None else "spec.memoryBudget"


def raise_to(spec: LLMEnginePoolSpec, need: int) -> str:
    """The fix for a budget that must hold ``need`` bytes: its field, and the least value that does."""
    if spec.memory_budget is not None:
        return f"raise the pool's spec.memoryBudget to at least {human(need)}"
    limit = math.ceil((need + SERVER_MARGIN_BYTES) / (1 - MARGIN_FRACTION))  # budget_of's margins, inverted
    return f"raise the pool's spec.resources.limits.memory to at least {human(limit)}"


def _shape_problem(member: MemberView, pool: str, spec: LLMEnginePoolSpec) -> str | None:
    """Why the member can never run in the pool's pods, whatever it measures; None when it can."""
    mine = member.spec
    if mine.gpu != spec.gpu:
        return (f"engine {member.name} is built for spec.gpu {mine.gpu}, the pool {pool}'s pods run on spec.gpu "
                f"{spec.gpu}; set the engine's spec.gpu to {spec.gpu}, or move it to a pool of {mine.gpu} "
                "(spec.serving.pool)")
    if (ranks := mine.tensor_parallel * mine.pipeline_parallel) > 1:
        return (f"engine {member.name} runs {ranks} ranks (spec.tensorParallel x spec.pipelineParallel "
                f"{mine.tensor_parallel}x{mine.pipeline_parallel}), a pool's pods serve engines of one rank; set "
                "both to 1, or remove spec.serving.pool to serve it from its own pods")
    return None


def _too_big(member: MemberView, memory: tuple[int, str], pool: str, room: tuple[int, str],
             spec: LLMEnginePoolSpec) -> str:
    (need, source), (have, what) = memory, room
    return (f"engine {member.name} counts {human(need)} ({source}), more than the pool {pool}'s budget of "
            f"{human(have)} ({what}); {raise_to(spec, need)}, or make the engine smaller (a lower "
            "maxSeqLen/maxBatchSize, or quantization), or remove its spec.serving.pool to serve it from its own pods")


def judge(member: MemberView, pool: str, spec: LLMEnginePoolSpec) -> PoolMember:
    """The member's entry of ``status.engines`` (module docstring: the order of the rules)."""
    entry = {"name": member.name, "engine_version": member.version}
    if problem := _shape_problem(member, pool, spec):
        return PoolMember(**entry, state=REFUSED, message=problem)
    if member.version is None or member.digest is None or member.artifact_uri is None:
        return _still_serving(member, spec) or PoolMember(**entry, state=BUILDING, message=member.waiting)
    if member.problem is not None:
        return PoolMember(**entry, state=REFUSED, message=member.problem)
    assert member.memory is not None
    room = budget(spec)
    if room is not None and member.memory[0] > room[0]:
        return PoolMember(**entry, state=REFUSED, memory_bytes=member.memory[0],
                          message=_too_big(member, member.memory, pool, room, spec))
    return PoolMember(**entry, state=LISTED, memory_bytes=member.memory[0])


def _still_serving(member: MemberView, spec: LLMEnginePoolSpec) -> PoolMember | None:
    """While the member's version is built: the entry that keeps the build the pool listed before (when it is
    still trusted and fits the budget), else None."""
    prior = member.previous
    if prior is None or prior.memory is None or prior.problem is not None or prior.artifact_uri is None:
        return None
    room = budget(spec)
    if room is not None and prior.memory[0] > room[0]:
        return None
    return PoolMember(name=member.name, engine_version=prior.version, state=LISTED, memory_bytes=prior.memory[0],
                      message=f"building {member.version}; {prior.version} serves")


def listed_view(member: MemberView, judged: PoolMember) -> MemberView:
    """The build of ``member`` its entry lists: its current one, or the one the pool listed before."""
    if member.previous is not None and judged.engine_version == member.previous.version != member.version:
        return member.previous
    return member


def judge_all(world: PoolWorld, now: str | None = None) -> list[PoolMember]:
    """Every member's entry, by name; a Listed one stamped ``listedSince`` (:func:`listed_since`)."""
    assert world.spec is not None
    judged = sorted((judge(m, world.name, world.spec) for m in world.members), key=lambda m: m.name)
    return listed_since(judged, world.old, now) if now is not None else judged


def entries_by_name(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A pool status's ``engines`` entries, by name."""
    return {e.get("name"): e for e in status.get("engines") or []}


def listed_since(judged: list[PoolMember], old: dict[str, Any], now: str) -> list[PoolMember]:
    """Each Listed entry with when its version was first listed: kept from the old status while it lists the same
    version, else ``now``."""
    before = entries_by_name(old)
    out = []
    for j in judged:
        prior = before.get(j.name) or {}
        same = prior.get("state") == LISTED and prior.get("engineVersion") == j.engine_version
        since = (prior.get("listedSince") if same else None) or now
        out.append(j.model_copy(update={"listed_since": since}) if j.state == LISTED else j)
    return out


def listed_entries(world: PoolWorld, judged: list[PoolMember]) -> list[EngineEntry]:
    """The engine list the pool's pods follow: each Listed member's artifact and the digest its engine pinned."""
    by_name = {m.name: m for m in world.members}
    views = [(j, listed_view(by_name[j.name], j)) for j in judged if j.state == LISTED]
    return [EngineEntry(j.name, view.artifact_uri or "", view.digest) for j, view in views]


def _listed_adapters_by_member(world: PoolWorld, judged: list[PoolMember]) -> list[tuple[str, str, dict[str, str]]]:
    """(member, base version, entry) of each Listed member's pinned adapters of the version the pool lists (its
    ConfigMap also keeps its old base's adapters while that base's own pods serve: not the pool's), the member
    listed first first (``listedSince``, then name)."""
    by_name = {m.name: m for m in world.members}
    out = []
    for judged_member in sorted(judged, key=lambda j: (j.listed_since or "", j.name)):
        member = by_name[judged_member.name]
        base = listed_view(member, judged_member).version
        if judged_member.state != LISTED or base is None:
            continue
        for item in adapter_list.wanted(member.adapters, base).values():
            if isinstance(item.get("version"), str) and isinstance(item.get("contentDigest"), str):
                out.append((member.name, base, adapter_list.entry(
                    item["name"], item["artifactURI"], item["version"], base, item["contentDigest"])))
    return out


def adapter_clashes(world: PoolWorld, judged: list[PoolMember]) -> dict[tuple[str, str], str]:
    """(member, adapter) -> why the pool's pods are not given that adapter of that member: a request names an
    adapter as it names an engine (``model``), so within a pool the name must say which. An adapter named as one of
    the pool's engines is left out (requests naming it reach that engine); of one name on two bases, the member
    listed first keeps it. (One base listed under two names shares its adapters: no clash.)"""
    return _clashes(world, _listed_adapters_by_member(world, judged))


def _clashes(world: PoolWorld, rows: list[tuple[str, str, dict[str, str]]]) -> dict[tuple[str, str], str]:
    """The rule is :func:`kiln.pool_api.adapter_name_clashes` (``kiln up`` refuses what it finds); here, the message."""
    found = adapter_name_clashes((m.name for m in world.members), ((m, e["name"], e["version"]) for m, _, e in rows))
    return {(member, name): f"its adapter {name!r} is not served by the pool: " + (
        "the pool has an engine of that name, which requests naming it reach; rename the adapter" if kind == "engine"
        else f"{other!r}, listed before it, has an adapter of that name; rename one of them")
        for (member, name), (kind, other) in found.items()}


def listed_adapters(world: PoolWorld, judged: list[PoolMember]) -> list[dict[str, str]]:
    """The adapter list the pool's pods follow: each Listed member's pinned adapters of the version the pool lists,
    less those :func:`adapter_clashes` leaves out."""
    rows = _listed_adapters_by_member(world, judged)
    clashes = _clashes(world, rows)
    out: dict[tuple[str, str], dict[str, str]] = {}
    for member, base, entry in rows:
        if (member, entry["name"]) not in clashes:
            out[(base, entry["name"])] = entry
    return list(out.values())


def with_adapter_clashes(world: PoolWorld, judged: list[PoolMember]) -> list[PoolMember]:
    """``judged`` with each member's left-out adapters in ``adaptersLeftOut`` and said in its ``message``."""
    clashes = adapter_clashes(world, judged)
    out = []
    for j in judged:
        left = [LeftOutAdapter(name=name, message=why) for (member, name), why in sorted(clashes.items())
                if member == j.name]
        out.append(j.model_copy(update={"message": "; ".join(filter(None, [j.message, *(a.message for a in left)])),
                                        "adapters_left_out": left}) if left else j)
    return out


def budget_too_small(world: PoolWorld, judged: list[PoolMember]) -> str | None:
    """The Failed message when the pool has built members and none fits its budget; None otherwise."""
    assert world.spec is not None
    built = [(j.memory_bytes, j.name) for j in judged if j.memory_bytes is not None]
    if not built or any(j.state != REFUSED for j in judged if j.memory_bytes is not None):
        return None
    room = budget(world.spec)
    assert room is not None  # only a known budget refuses for memory
    need, smallest = min(built)
    field = budget_field(world.spec)
    return (f"{field}: the budget of {human(room[0])} ({room[1]}) holds none of the pool's {len(built)} built "
            f"engine(s); the smallest, {smallest}, counts {human(need)}: {raise_to(world.spec, need)}")


def _ready(world: PoolWorld, judged: list[PoolMember]) -> tuple[str, bool, str, str]:
    """(phase, Ready, reason, message)."""
    if world.invalid is not None:
        return FAILED, False, INVALID_SPEC, world.invalid
    if world.taken is not None:
        return FAILED, False, NAME_CONFLICT, world.taken
    if (too_small := budget_too_small(world, judged)) is not None:
        return FAILED, False, BUDGET_TOO_SMALL, too_small
    assert world.spec is not None
    if world.scaler_problem is not None:
        return PENDING, False, AUTOSCALER_MISSING, world.scaler_problem
    if world.routing_problem is not None:
        return PENDING, False, PREREQUISITE_MISSING, world.routing_problem
    listed, desired = sum(j.state == LISTED for j in judged), desired_replicas(world)
    if desired == 0 and world.spec.autoscaling is not None:
        svc = pool_workload_name(world.name)
        return READY, False, SCALED_TO_ZERO, (
            f"scaled to zero by ScaledObject/{svc}; a request through the KEDA HTTP add-on's interceptor (Host: "
            f"{svc}.{world.namespace}.svc) starts a pod")
    if desired == 0:
        return PENDING, False, NO_REPLICAS, "spec.replicas is 0: no pod serves the pool; raise it to serve"
    ready = ((world.deployment or {}).get("status") or {}).get("readyReplicas") or 0
    if ready > 0:
        return READY, True, SERVING, (f"{ready} of {desired} pod(s) ready, serving {listed} "
                                      f"engine(s) of {len(judged)}")
    return PENDING, False, PODS_NOT_READY, (f"no pod of Deployment {pool_workload_name(world.name)} is ready yet (0 of "
                                            f"{desired}); {listed} engine(s) listed")


def desired_replicas(world: PoolWorld) -> int:
    """The pods the pool is meant to have: ``spec.replicas``, or, autoscaled, what the autoscaler last set on the
    Deployment (0 once KEDA took a pool of ``minReplicas: 0`` to zero)."""
    assert world.spec is not None
    if world.spec.autoscaling is None:
        return world.spec.replicas
    return ((world.deployment or {}).get("spec") or {}).get("replicas") or world.spec.autoscaling.min_replicas


def compose_pool_status(world: PoolWorld, judged: list[PoolMember], now: str | None = None) -> dict[str, Any]:
    """``status`` of the pool (camelCase, as stored)."""
    phase, ok, reason, message = _ready(world, judged)
    cond = condition("Ready", ok, reason, message, world.generation, world.old.get("conditions"), now)
    status: dict[str, Any] = {"phase": phase, "observedGeneration": world.generation, "conditions": [cond]}
    if world.spec is None:
        return status
    room = budget(world.spec)
    ready = ((world.deployment or {}).get("status") or {}).get("readyReplicas") or 0
    return {**status, "endpoint": pool_endpoint(world.name, world.namespace, world.spec),
            "memoryBudgetBytes": room[0] if room else None,
            "engines": [j.to_k8s() for j in with_adapter_clashes(world, judged)],
            "listedEngines": sum(j.state == LISTED for j in judged), "replicas": desired_replicas(world),
            "readyReplicas": ready}


def changed_members(old: dict[str, Any], new: dict[str, Any]) -> set[str]:
    """The engines whose view of the pool changed between two of its statuses (their status follows it): all of
    them when the pool's phase, endpoint or Ready reason changed (a Ready pool taken to zero), else those whose entry
    changed, appeared or went."""
    was, now = entries_by_name(old), entries_by_name(new)
    names = set(was) | set(now)
    if any(old.get(key) != new.get(key) for key in ("phase", "endpoint")) or \
            ready_condition(old).get("reason") != ready_condition(new).get("reason"):
        return {n for n in names if n}
    return {n for n in names if n and was.get(n) != now.get(n)}
