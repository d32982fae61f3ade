"""The prefix-cache block keys, scheme ``kiln-prefix-v1``: what a router computes to predict hits.

A prompt's token ids are cut into full blocks of ``block_size`` tokens (the engine's
KV block size, published on ``/metrics`` as ``vllm:cache_config_info{block_size}`` and
by ``GET /v1/prefix_cache``). Block ``i``'s key is::

    key[-1] = SHA-256(b"kiln-prefix-v1")
    key[i]  = SHA-256(key[i-1] || token ids of block i as uint32 little-endian)

A request under a LoRA adapter (docs/lora.md) starts its chain from the adapter's own root, so a
prefix computed under one adapter (or the base) is never reused by another. The root names the
adapter's content (its ``digest``, hex: SHA-256 of its files), not its served name, so a new version
loaded under an old name never hits the old one's KV::

    key[-1] = SHA-256(b"kiln-prefix-v1" || b"\x00lora\x00" || adapter digest as ASCII hex)

A request with a ``cache_salt`` (vLLM's field: one per tenant) salts that root, so only requests with
the same salt share blocks, and no client learns from ``cached_tokens`` or latency whether another
tenant's prompt is cached::

    key[-1] = SHA-256(root || b"\x00salt\x00" || cache_salt as UTF-8)

In an engine pool (several engines behind one server, docs/pools.md) the keys a server publishes are rooted at
the engine's version too (its content-addressed artifact version), before any adapter, so two engines of one
pod given the same prompt get different keys; a single engine's keys stay as above::

    key[-1] = SHA-256(b"kiln-prefix-v1" || b"\x00engine\x00" || engine version as ASCII)
    key[-1] = SHA-256(b"kiln-prefix-v1" || b"\x00engine\x00" || engine version || b"\x00lora\x00" || digest)

A request reuses the cached KV of its longest run of leading blocks whose keys the engine
holds, except that the prompt's last token is always computed: a prompt of ``n`` tokens
can hit at most ``(n - 1) // block_size`` blocks. Keys are cryptographic on purpose: a
client cannot craft a prompt whose chain collides with another tenant's prefix.

Plain Python (hashlib), no torch: the server, routers and tests import it as is.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

PREFIX_HASH_SCHEME = "kiln-prefix-v1"
ROOT_KEY = hashlib.sha256(PREFIX_HASH_SCHEME.encode()).digest()


def root_key(adapter: str | None = None, cache_salt: str | None = None, engine: str | None = None) -> bytes:
    """``key[-1]``: the scheme's root, or a LoRA adapter's (by its content digest), under a pool's engine (by its
    version) when ``engine`` is given, salted by ``cache_salt``."""
    root = ROOT_KEY
    if adapter is not None or engine is not None:
        named = PREFIX_HASH_SCHEME.encode() + (b"\x00engine\x00" + engine.encode() if engine is not None else b"")
        root = hashlib.sha256(named + (b"\x00lora\x00" + adapter.encode() if adapter is not None else b"")).digest()
    if cache_salt:
        root = hashlib.sha256(root + b"\x00salt\x00" + cache_salt.encode()).digest()
    return root


def chain_hash(parent: bytes | None, token_ids: Sequence[int], root: bytes = ROOT_KEY) -> bytes:
    """The key of a block holding ``token_ids`` whose preceding block's key is ``parent`` (None: the first
    block, chained from ``root``)."""
    return hashlib.sha256((parent or root) + struct.pack(f"<{len(token_ids)}I", *token_ids)).digest()


def block_keys(token_ids: Sequence[int], block_size: int, limit: int | None = None,
               adapter: str | None = None, cache_salt: str | None = None, engine: str | None = None) -> list[bytes]:
    """Keys of the full blocks of ``token_ids`` (at most ``limit`` of them), under the adapter whose content
    digest is ``adapter``, the pool's engine whose version is ``engine`` and the ``cache_salt`` if given."""
    count = len(token_ids) // block_size if limit is None else min(limit, len(token_ids) // block_size)
    keys: list[bytes] = []
    parent, root = None, root_key(adapter, cache_salt, engine)
    for i in range(count):
        parent = chain_hash(parent, token_ids[i * block_size:(i + 1) * block_size], root)
        keys.append(parent)
    return keys
