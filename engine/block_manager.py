"""The paged KV pool's bookkeeping: which block holds what, who uses it, what can be reused.

Blocks are reference counted. A full block whose tokens are computed gets a
chained key (parent block's key + its own tokens, SHA-256: ``prefix_hash.py``) and is registered in the
prefix cache; a later request whose leading blocks hash the same, *and* whose
tokens equal the stored ones, shares the block instead of recomputing it.
A block whose count drops to zero goes to the back of the free queue but keeps
its contents and hash, so it can still be hit until it is handed out again
(LRU eviction: blocks are taken from the front). Requests free their blocks
tail first, so the tails of prefixes are evicted before their heads.
"""

from __future__ import annotations

from collections import OrderedDict

from kiln.engine.prefix_hash import chain_hash
from kiln.engine.sequence import Request


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "adapter")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] = ()
        self.adapter: str | None = None  # the content digest of the LoRA adapter it was computed under


class Blocks:
    """The pool's blocks by id, each made on its first use: making 100k ``Block`` objects up front was 0.13 s of
    an engine's load. Iterates the blocks made so far, by id (a block never made has no contents)."""

    __slots__ = ("_made", "_count")

    def __init__(self, count: int) -> None:
        self._made: dict[int, Block] = {}
        self._count = count

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, block_id: int) -> Block:
        block = self._made.get(block_id)
        if block is None:
            if not 0 <= block_id < self._count:
                raise IndexError(f"block {block_id} outside the pool's {self._count}")
            block = self._made[block_id] = Block(block_id)
        return block

    def __iter__(self):
        return iter([self._made[i] for i in sorted(self._made)])


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = Blocks(num_blocks)
        self.free_block_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[bytes, int] = {}
        self.prefix_cache_queries = 0  # prompt tokens looked up at first admission
        self.prefix_cache_hits = 0     # of those, tokens found in the cache

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_blocks(self, req: Request) -> list[int]:
        """Leading blocks of ``req`` already in the cache; always leaves the last token to compute."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent, root = None, req.prefix_root
        bs = self.block_size
        for i in range((req.num_tokens - 1) // bs):
            tokens = tuple(req.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, tokens, root)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
            parent = h
        return hits

    def can_allocate(self, req: Request, cached: list[int], num_new_tokens: int) -> bool:
        """Whether ``req`` (no blocks yet) can take ``cached`` plus blocks for ``num_new_tokens`` more."""
        reclaimed = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        needed = self.blocks_needed(len(cached) * self.block_size + num_new_tokens) - len(cached)
        return needed <= self.num_free_blocks - reclaimed

    def allocate(self, req: Request, cached: list[int], num_new_tokens: int) -> None:
        """Give a newly admitted request its cached prefix blocks and fresh blocks for its first chunk."""
        assert not req.block_table
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
            req.block_table.append(block_id)
        req.num_hashed_blocks = len(cached)
        req.num_computed_tokens = len(cached) * self.block_size
        if req.num_preemptions == 0 and self.enable_prefix_caching:
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += req.num_computed_tokens
            req.num_cached_tokens = req.num_computed_tokens
        self.append_slots(req, num_new_tokens)

    def can_append(self, req: Request, num_new_tokens: int) -> bool:
        needed = self.blocks_needed(req.num_computed_tokens + num_new_tokens) - len(req.block_table)
        return needed <= self.num_free_blocks

    def append_slots(self, req: Request, num_new_tokens: int) -> None:
        """Grow ``req``'s block table to hold ``num_new_tokens`` more tokens."""
        needed = self.blocks_needed(req.num_computed_tokens + num_new_tokens) - len(req.block_table)
        for _ in range(needed):
            block_id, _ = self.free_block_ids.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:  # evict the cached contents this block held
                if self.hash_to_block.get(block.hash) == block_id:
                    del self.hash_to_block[block.hash]
                block.hash, block.token_ids = None, ()
            block.ref_count = 1
            req.block_table.append(block_id)

    def cache_full_blocks(self, req: Request) -> None:
        """Register the blocks that became full and computed this step in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(req.num_computed_tokens, req.num_tokens) // bs
        parent = self.blocks[req.block_table[req.num_hashed_blocks - 1]].hash if req.num_hashed_blocks else None
        root = req.prefix_root
        adapter = None if req.lora is None else req.lora.digest
        # Its chain was dropped (forget_adapter), or its adapter unloaded: cache no more of it.
        if (req.num_hashed_blocks and parent is None) or (req.lora is not None and req.lora.removed):
            req.num_hashed_blocks = max(req.num_hashed_blocks, num_full)
            return
        for i in range(req.num_hashed_blocks, num_full):
            block = self.blocks[req.block_table[i]]
            tokens = tuple(req.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, tokens, root)
            block.hash, block.token_ids, block.adapter = h, tokens, adapter
            self.hash_to_block.setdefault(h, block.block_id)
            parent = h
        req.num_hashed_blocks = max(req.num_hashed_blocks, num_full)

    def forget_adapter(self, digest: str) -> int:
        """Drop every cached block computed under the LoRA adapter version ``digest`` (salted or not: an
        adapter unloaded); returns how many. Blocks in use keep their contents."""
        dropped = 0
        for block in self.blocks:
            if block.hash is None or block.adapter != digest:
                continue
            if self.hash_to_block.get(block.hash) == block.block_id:
                del self.hash_to_block[block.hash]
            block.hash, block.token_ids, block.adapter = None, (), None
            if block.ref_count == 0:
                self.free_block_ids.move_to_end(block.block_id, last=False)
            dropped += 1
        return dropped

    def trim(self, req: Request) -> None:
        """Free the blocks past ``req``'s computed tokens (rejected speculative drafts wrote there).
        They hold no committed block, so they are unhashed and go to the front of the free queue."""
        keep = self.blocks_needed(req.num_computed_tokens)
        while len(req.block_table) > keep:
            block_id = req.block_table.pop()
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count == 0 and block.hash is None, "a speculative tail block was shared or cached"
            self.free_block_ids[block_id] = None
            self.free_block_ids.move_to_end(block_id, last=False)

    def free(self, req: Request) -> None:
        """Release ``req``'s blocks, tail first (see module docstring)."""
        for block_id in reversed(req.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    # Uncached contents are worthless: hand these out before cached ones.
                    self.free_block_ids[block_id] = None
                    self.free_block_ids.move_to_end(block_id, last=False)
                else:
                    self.free_block_ids[block_id] = None
        req.block_table = []
        req.num_hashed_blocks = 0
