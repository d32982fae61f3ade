"""The adapter digests the operator pins in the ``<engine>-adapters`` ConfigMap (issue 38, Med 4): what it reads
back as its pins, and the serving pod's side: an adapter whose signed manifest has another content digest than
the one listed is refused, never loaded."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from kiln.operator.adapters import ADAPTERS_FILE_KEY, pinned_digests
from kiln.serving.lora_sync import AdapterSync

from kiln.artifacts import ArtifactStore
from kiln.signing import Signer, generate_key_pair


def test_pins_are_read_back_from_the_configmap_and_a_broken_one_pins_nothing():
    doc = {"format": 1, "adapters": [{"name": "sql", "version": "v-sql", "contentDigest": "d1"},
                                     {"name": "old", "version": "v-old"}]}
    assert pinned_digests({"data": {ADAPTERS_FILE_KEY: json.dumps(doc)}}) == {"v-sql": "d1"}
    for broken in (None, {}, {"data": {ADAPTERS_FILE_KEY: "{not json"}}, {"data": {ADAPTERS_FILE_KEY: "[1]"}},
                   {"data": {ADAPTERS_FILE_KEY: json.dumps({"adapters": [1, None]})}}):
        assert pinned_digests(broken) == {}


def test_a_pod_refuses_an_adapter_whose_digest_is_not_the_pinned_one(tmp_path):
    private, public = generate_key_pair(tmp_path / "keys")
    store = ArtifactStore.from_uri(f"file://{tmp_path / 'store'}")
    src = tmp_path / "adapter"
    src.mkdir()
    (src / "adapter_model.safetensors").write_bytes(b"x" * 64)
    digest = store.publish("base-sql-0123", src, {"kind": "lora-adapter"}, signer=Signer.from_pem(private)).content_digest
    added: list[str] = []

    async def add(name: str, path: str) -> None:
        added.append(name)

    ctx = SimpleNamespace(config=SimpleNamespace(cache_dir=tmp_path / "cache", verify_key=public),
                          loras=SimpleNamespace(add=add))
    entry = {"name": "sql", "artifactURI": store.artifact_uri("base-sql-0123"), "version": "base-sql-0123"}
    sync = AdapterSync(ctx, tmp_path / "adapters.json")
    asyncio.run(sync.apply({"sql": {**entry, "contentDigest": "0" * 64}}))
    assert added == [] and sync.held == {} and list(sync.failed) == [f"sql@{entry['artifactURI']}"]
    sync = AdapterSync(ctx, tmp_path / "adapters.json")
    asyncio.run(sync.apply({"sql": {**entry, "contentDigest": digest}}))
    assert added == ["sql"] and sync.held == {"sql": entry["artifactURI"]}
