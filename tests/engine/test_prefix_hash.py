"""kiln-prefix-v1's keys (engine/prefix_hash.py, docs/prefix-routing.md): a single engine's keys are pinned to the
values they had before pools rooted theirs at the engine (a router's key sets must survive an upgrade), and a pool
engine's root is the documented one."""

from __future__ import annotations

import hashlib

from kiln.engine.prefix_hash import ROOT_KEY, block_keys, root_key

IDS = list(range(1, 9))
DIGEST = "ab" * 32

# block_keys(IDS, 4, ...) as computed before engine roots existed (commit e90965a).
PINNED = {
    "base": ["7f902f105c35774c7bd4b33525dbc994687600faabf72504d1a672008ae4feaf",
             "8da1e6a7ed22ee2ac498b4cf52d4b67e42f468d8a24cdaf63ef85116335a944f"],
    "adapter": ["b3da5089677b291ba4fabd40a5371837f568eae9c0f8fde94cbaeaf6e11087e4",
                "3f3f6a94ac87a8bdfc5be508ec8474c15d786639e233f3dd92035bddd81ab8dc"],
    "adapter+salt": ["531d17c078995d2c263f7b75f17316278c1daf98975ed58199c5b4535423688b",
                     "bca0831a5aa7d39eb3bd1b39716f18d85d51b9fb89da80dd5d1869e10002bf4a"],
    "salt": ["d38d7dfa0933f5a7c48c134edb29413a8825d91aaa61ae819ba7d4120fec6fe7",
             "d9dbc1edd8f41aeb53741774bf46e1f81ec8592f41daf97bd1a728b281c91ac2"],
}


def test_a_single_engines_keys_are_unchanged():
    assert [k.hex() for k in block_keys(IDS, 4)] == PINNED["base"]
    assert [k.hex() for k in block_keys(IDS, 4, adapter=DIGEST)] == PINNED["adapter"]
    assert [k.hex() for k in block_keys(IDS, 4, adapter=DIGEST, cache_salt="tenant-a")] == PINNED["adapter+salt"]
    assert [k.hex() for k in block_keys(IDS, 4, cache_salt="tenant-a")] == PINNED["salt"]
    assert root_key() == ROOT_KEY and block_keys(IDS, 4, engine=None) == block_keys(IDS, 4)


def test_a_pool_engines_keys_are_rooted_at_its_version_then_its_adapter():
    scheme = b"kiln-prefix-v1\x00engine\x00pool-a-0123456789ab"
    assert root_key(engine="pool-a-0123456789ab") == hashlib.sha256(scheme).digest()
    assert root_key(DIGEST, engine="pool-a-0123456789ab") == hashlib.sha256(scheme + b"\x00lora\x00" + DIGEST.encode()
                                                                         ).digest()
    salted = root_key(DIGEST, "tenant-a", engine="pool-a-0123456789ab")
    assert salted == hashlib.sha256(root_key(DIGEST, engine="pool-a-0123456789ab") + b"\x00salt\x00tenant-a").digest()
    a, b = (block_keys(IDS, 4, engine=f"pool-{n}-0123456789ab") for n in "ab")
    assert not {*a} & {*b} and not {*a} & {*block_keys(IDS, 4)}  # two engines, one prompt: no shared key
