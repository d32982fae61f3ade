"""BlockManager and Scheduler policy, without a model."""

from __future__ import annotations

from kiln.engine.block_manager import BlockManager
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.scheduler import Scheduler
from kiln.engine.sequence import Request, RequestStatus


def req(rid: str, tokens: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, None, tokens, SamplingParams(max_tokens=max_tokens), max_tokens)


def admit(bm: BlockManager, r: Request) -> None:
    cached = bm.find_cached_blocks(r)
    n = r.num_tokens - len(cached) * bm.block_size
    assert bm.can_allocate(r, cached, n)
    bm.allocate(r, cached, n)
    r.num_computed_tokens += n
    bm.cache_full_blocks(r)


def test_prefix_hits_share_blocks_and_leave_one_token_to_compute():
    bm = BlockManager(8, 4)
    a = req("a", list(range(10)))
    admit(bm, a)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 5
    b = req("b", list(range(8)) + [99, 98])
    admit(bm, b)
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 8
    assert bm.blocks[a.block_table[0]].ref_count == 2
    exact = req("c", list(range(8)))  # fully cached prompt: the last block is recomputed for its logits
    admit(bm, exact)
    assert exact.num_cached_tokens == 4
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (28, 12)
    for r in (a, b, exact):
        bm.free(r)
    assert bm.num_free_blocks == 8


def test_hash_hit_is_verified_against_tokens():
    bm = BlockManager(4, 2)
    a = req("a", [1, 2, 3])
    admit(bm, a)
    block = bm.blocks[a.block_table[0]]
    block.token_ids = (7, 7)  # a colliding hash must not be trusted
    assert bm.find_cached_blocks(req("b", [1, 2, 3])) == []


def test_freed_cached_blocks_are_evicted_lru_tail_first():
    bm = BlockManager(6, 2)
    a = req("a", [1, 2, 3, 4, 5, 6, 7])  # 3 full blocks + 1 partial
    admit(bm, a)
    head, mid, tail, partial = a.block_table
    bm.free(a)
    # Uncached partial block is handed out first, then the prefix's tail before its head.
    assert list(bm.free_block_ids)[:1] == [partial]
    order = list(bm.free_block_ids)
    assert order.index(tail) < order.index(mid) < order.index(head)
    # A re-admitted request still hits the freed, not-yet-evicted blocks.
    again = req("again", [1, 2, 3, 4, 5, 6, 9])
    assert bm.find_cached_blocks(again) == [head, mid, tail]
    # Consuming every free block evicts them and drops their hashes.
    big = req("big", list(range(100, 112)))
    admit(bm, big)
    assert bm.find_cached_blocks(again) == []
    assert all(bm.blocks[b].ref_count == 1 for b in bm.hash_to_block.values())


def test_scheduler_preempts_newest_and_never_starves():
    bm = BlockManager(6, 2)
    s = Scheduler(bm, max_batch_size=4, max_num_tokens=16)
    a, b = req("a", [1, 2, 3, 4]), req("b", [5, 6, 7, 8])
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 4), ("b", 4)]
    for r, n in out.scheduled:
        r.num_computed_tokens += n
        r.token_ids.append(0)
    assert bm.num_free_blocks == 2
    # Each needs a third block for its 5th token, then a 4th... until one must go.
    for _ in range(3):
        out = s.schedule()
        for r, n in out.scheduled:
            r.num_computed_tokens += n
            r.token_ids.append(0)
        if out.num_preempted:
            break
    assert out.num_preempted == 1 and b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert s.waiting[0] is b  # front of the queue: resumed before anything newer
    c = req("c", [9, 9])
    s.add(c)
    s.finish(a, "length")
    out = s.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["b", "c"]
    assert out.scheduled[0][1] == b.num_tokens  # recompute prompt + output so far
