"""Speculative drafts take only the KV blocks left after every running request's committed tokens: they
shrink instead of preempting anyone (``Scheduler.schedule``), while a committed token that truly does not
fit still preempts the newest request. No model: the BlockManager and Scheduler alone."""

from __future__ import annotations

from kiln.engine.block_manager import BlockManager
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.scheduler import Scheduler
from kiln.engine.sequence import Request, RequestStatus
from kiln.engine.spec_decode.config import SpeculativeConfig


def req(rid: str, tokens: list[int], max_tokens: int = 16) -> Request:
    return Request(rid, None, tokens, SamplingParams(max_tokens=max_tokens), max_tokens)


def scheduler(num_blocks: int, max_num_tokens: int = 64) -> Scheduler:
    spec = SpeculativeConfig(num_speculative_tokens=3)
    return Scheduler(BlockManager(num_blocks, 2), max_batch_size=4, max_num_tokens=max_num_tokens, speculative=spec)


def commit(out, sampled: dict[str, int]) -> None:
    """What the engine does after a step whose drafts were all rejected: the scheduled committed tokens are
    computed, a finished prefill or a decode samples one token."""
    for r, n in out.scheduled:
        r.num_computed_tokens += n - len(r.spec_token_ids)
        if r.num_computed_tokens == r.num_tokens:
            r.token_ids.append(sampled[r.request_id])
        r.spec_token_ids = []


def two_decodes_at_a_block_boundary(num_blocks: int) -> tuple[Scheduler, Request, Request]:
    """a = 1 2 1 2 | 1 and b = 3 4 3 4 | 3 (block size 2): each needs a new block for its committed token,
    and prompt lookup drafts two more tokens for each (2 1 / 4 3), which would need a second new block."""
    s = scheduler(num_blocks)
    a, b = req("a", [1, 2, 1, 2]), req("b", [3, 4, 3, 4])
    s.add(a)
    s.add(b)
    commit(s.schedule(), {"a": 1, "b": 3})
    assert a.num_computed_tokens == b.num_computed_tokens == 4 and len(a.block_table) == len(b.block_table) == 2
    return s, a, b


def test_drafts_shrink_instead_of_preempting_a_later_decode():
    s, a, b = two_decodes_at_a_block_boundary(num_blocks=6)  # 2 free blocks: one per committed token
    out = s.schedule()
    assert out.num_preempted == 0 and s.num_preemptions == 0
    assert a.status is b.status is RequestStatus.RUNNING
    # Each gets its committed token's block; the one free slot left in it holds one draft.
    assert [(r.request_id, n, r.spec_token_ids) for r, n in out.scheduled] == [("a", 2, [2]), ("b", 2, [4])]
    assert s.block_manager.num_free_blocks == 0


def test_drafts_take_only_blocks_a_running_prefill_chunk_does_not_need():
    s = scheduler(num_blocks=8, max_num_tokens=8)
    a, c = req("a", [1, 2, 1, 2]), req("c", list(range(10, 20)))
    s.add(a)
    s.add(c)
    commit(s.schedule(), {"a": 1})  # a's prompt and c's first 4-token chunk
    assert (a.num_computed_tokens, c.num_computed_tokens, s.block_manager.num_free_blocks) == (4, 4, 4)
    out = s.schedule()
    # a: committed token (a 3rd block) and drafts; c: a 5-token chunk (3 more blocks). Two drafts would
    # need a 4th block for a and leave c short: a keeps one draft, c is not preempted.
    assert out.num_preempted == 0 and c.status is RequestStatus.RUNNING
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 2), ("c", 5)]
    assert a.spec_token_ids == [2] and s.block_manager.num_free_blocks == 0


def test_a_committed_token_that_does_not_fit_still_preempts_the_newest():
    s, a, b = two_decodes_at_a_block_boundary(num_blocks=4)  # no free block: a's committed token needs b's
    out = s.schedule()
    assert out.num_preempted == 1 and b.status is RequestStatus.WAITING and s.waiting[0] is b
    assert [r.request_id for r, _ in out.scheduled] == ["a"] and len(a.block_table) >= 3
    assert b.block_table == [] and b.num_computed_tokens == 0


def test_drafts_are_unchanged_when_the_pool_has_room():
    s, a, b = two_decodes_at_a_block_boundary(num_blocks=16)
    out = s.schedule()
    assert out.num_preempted == 0
    assert [(r.request_id, n, r.spec_token_ids) for r, n in out.scheduled] == [("a", 3, [2, 1]), ("b", 3, [4, 3])]
