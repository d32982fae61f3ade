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


def test_an_adapter_job_of_another_version_under_the_name_is_a_conflict_never_adopted():
    from kiln.operator.adapter_steps import read_view
    from kiln.operator.adapters import adapter_job_name, adapter_phase, wants_job

    from kiln.lora_options import LoraAdapter

    version = "base-sql-" + "a" * 64
    name = adapter_job_name(version)
    assert len(name) <= 63 and len(name.rsplit("-", 1)[1]) == 16  # 64 bits of hash: Jobs of every namespace share it
    jobs: dict[str, dict] = {}

    class Kube:
        async def get(self, path: str) -> dict | None:
            return jobs.get(path.rsplit("/", 1)[1])

    store = SimpleNamespace(read_signed_manifest=lambda v: (None, None), artifact_uri=lambda v: f"s3://b/{v}")
    ctx = SimpleNamespace(kube=Kube(), store=store, config=SimpleNamespace(jobs_namespace="kiln-system"))
    adapter = LoraAdapter(name="sql", source="s3://adapters/sql")

    def view():
        return asyncio.run(read_view(ctx, "chat", "base", adapter, "base", version, b"", None))

    meta = {"name": name, "namespace": "kiln-system"}
    jobs[name] = {"metadata": {**meta, "annotations": {"serving.kiln.dev/adapter-version": "other-version"}}}
    clash = view()
    assert clash.job is None and not wants_job(clash)  # neither adopted nor created again
    phase, message = adapter_phase(clash)
    assert phase == "Failed" and f"kubectl delete job {name} -n kiln-system" in message and "other-version" in message
    jobs[name] = {"metadata": {**meta, "annotations": {"serving.kiln.dev/adapter-version": version}}}
    ours = view()
    assert ours.conflict is None and ours.job is jobs[name] and adapter_phase(ours)[0] == "Building"
