"""An engine's reconcile reconciles the pool it joined or left at once, only when what the pool reads of it changed
(kiln.operator.handlers._follow_pools): the scenarios' short timers would hide a missing call."""

from __future__ import annotations

import asyncio
import copy
import logging

import pytest
from kiln.operator import handlers
from kiln.operator.reconcile import Result


def engine(pool: str | None, version: str = "v1", digest: str | None = "d1") -> Result:
    body = {"metadata": {"name": "chat", "namespace": "ml"}, "spec": {"serving": {"pool": pool}}}
    status = {"engineVersion": version, "artifact": {"engineVersion": version, "contentDigest": digest}}
    return Result(body=body, status=status)


@pytest.fixture
def pools(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    called: list[str] = []

    async def reconcile_pool(namespace: str, name: str, memo, logger) -> None:
        called.append(name)

    monkeypatch.setattr(handlers, "_reconcile_pool", reconcile_pool)
    return called


def follow(memo: dict, result: Result, **kw) -> None:
    asyncio.run(handlers._follow_pools("ml", "chat", result, memo, logging.getLogger("test"), **kw))


def test_a_pool_is_reconciled_when_its_member_joins_is_built_moves_or_goes(pools: list[str]):
    memo: dict = {}
    follow(memo, engine("a", digest=None))
    assert pools == ["a"]  # joined
    follow(memo, engine("a", digest=None))
    assert pools == ["a"]  # nothing the pool reads changed: no pool reconcile (the pool's timer still runs)
    follow(memo, engine("a"))
    assert pools == ["a", "a"]  # built and pinned
    follow(memo, engine("b"))
    assert pools == ["a", "a", "a", "b"]  # moved: the pool it left and the one it joined
    follow(memo, Result())
    assert pools[-1] == "b" and memo["engine_pools"] == {}  # gone
    follow(memo, engine(None))
    assert len(pools) == 5  # an engine of no pool reconciles none


def test_a_poked_engine_follows_no_pool_and_a_deleted_one_names_its_pool(pools: list[str]):
    memo: dict = {}
    follow(memo, engine("a"), follow=False)
    assert pools == [] and memo["engine_pools"][("ml", "chat")][0] == "a"
    follow({}, Result(), also=("c",))  # deleted after an operator restart: the pool its spec named
    assert pools == ["c"]


def test_a_pool_is_reconciled_when_an_adapter_of_its_member_is_built_or_removed(pools: list[str]):
    memo: dict = {}
    follow(memo, engine("a"))
    sql = {"name": "sql", "version": "v1-sql-1", "phase": "Building"}
    built = engine("a")
    built.status["adapters"] = [sql]
    follow(memo, built)
    assert pools == ["a", "a"]  # status.adapters appeared (its Job runs): the pool lists nothing new, but reads it
    follow(memo, built)
    assert pools == ["a", "a"]
    built.status["adapters"] = [{**sql, "phase": "Ready"}]
    follow(memo, built)
    assert pools == ["a"] * 3  # built: the member's ConfigMap lists it, so the pool's adapter list does
    follow(memo, engine("a"))
    assert pools == ["a"] * 4  # removed from spec.lora: the pool's adapter list drops it


def test_the_reconciles_of_one_object_never_overlap_across_the_memos_kopf_hands_each_object(
        monkeypatch: pytest.MonkeyPatch, tmp_path):
    """kopf gives each object a shallow copy of the global memo: a lock made on one object's copy does not guard
    the same engine reconciled from its pool's (or the same pool from an engine's)."""
    import kopf

    monkeypatch.setenv("KILN_STORE_URI", str(tmp_path))
    running: dict[str, int] = {}
    overlaps: list[str] = []

    async def exclusive(name: str) -> None:
        running[name] = running.get(name, 0) + 1
        if running[name] > 1:
            overlaps.append(name)
        await asyncio.sleep(0.01)
        running[name] -= 1

    async def reconcile(ctx, namespace: str, name: str, logger) -> Result:
        await exclusive(f"engine {name}")
        return engine("p")

    async def reconcile_pool(ctx, namespace: str, name: str, logger) -> handlers.PoolResult:
        await exclusive(f"pool {name}")
        return handlers.PoolResult(body={"status": {}}, status={})

    monkeypatch.setattr(handlers, "reconcile", reconcile)
    monkeypatch.setattr(handlers, "reconcile_pool", reconcile_pool)
    monkeypatch.setattr(handlers, "changed_members", lambda before, now: {"chat"})
    log = logging.getLogger("test")

    async def main() -> None:
        base = kopf.Memo()
        await handlers.configure(settings=kopf.OperatorSettings(), memo=base, logger=log)
        engine_memo, pool_memo = copy.copy(base), copy.copy(base)  # as kopf does, one per object
        await asyncio.gather(handlers._reconcile("ml", "chat", engine_memo, log),  # its timer; follows pool p
                             handlers._reconcile_pool("ml", "p", pool_memo, log),  # reconciles chat after
                             handlers._reconcile_pool("ml", "p", pool_memo, log),
                             handlers._reconcile("ml", "chat", engine_memo, log))
        await base.ctx.kube.close()

    asyncio.run(main())
    assert running == {"engine chat": 0, "pool p": 0} and overlaps == []
