"""An engine's reconcile reconciles the pool it joined or left at once, only when what the pool reads of it changed
(kiln.operator.handlers._follow_pools): the scenarios' short timers would hide a missing call."""

from __future__ import annotations

import asyncio
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
