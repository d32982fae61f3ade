"""Checkpoint sources: local paths (file://, pvc://) and the Hub's revision pinning and file filtering.

The Hub is not reachable here, so the hf:// test replaces ``HfApi.model_info`` and
``snapshot_download`` with fakes that serve a real toy checkpoint and record how they were called.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
from kiln.builder.checkpoint import ALLOW_PATTERNS, fetch_checkpoint
from kiln.builder.errors import FetchError

SHA = "0123456789abcdef0123456789abcdef01234567"


def test_relative_file_and_pvc_sources_are_used_in_place(toy_model, tmp_path, monkeypatch):
    model = toy_model("llama-tiny")
    monkeypatch.chdir(model.parent)
    ckpt = fetch_checkpoint(f"file://./{model.name}", "seed-0", tmp_path / "work")
    assert ckpt.path == model.resolve() and "model.safetensors" in ckpt.files
    assert "kiln-toy.json" not in ckpt.files  # only weights, config and tokenizer files count

    monkeypatch.setenv("KILN_PVC_ROOT", str(model.parent.parent))
    pvc = fetch_checkpoint(f"pvc://{model.parent.name}/{model.name}", None, tmp_path / "work")
    assert pvc.path == model.resolve()
    with pytest.raises(FetchError, match=r"pvc:// sources are read from \$KILN_PVC_ROOT/<claim>"):
        fetch_checkpoint("pvc://other-claim/models/x", None, tmp_path / "work")


def test_hf_source_resolves_the_revision_to_a_sha_and_fetches_only_safe_files(toy_model, tmp_path, monkeypatch):
    model = toy_model("llama-tiny")
    calls = {}

    def model_info(self, repo_id, revision=None, token=None, **_):
        calls["info"] = (repo_id, revision, token)
        names = [p.name for p in model.iterdir()] + ["pytorch_model.bin", "original/consolidated.00.pth"]
        return SimpleNamespace(sha=SHA, siblings=[SimpleNamespace(rfilename=n) for n in names])

    def snapshot_download(repo_id, revision=None, token=None, local_dir=None, allow_patterns=None, **_):
        calls["download"] = (repo_id, revision, token, allow_patterns)
        shutil.copytree(model, local_dir, dirs_exist_ok=True)
        return str(local_dir)

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    ckpt = fetch_checkpoint("hf://org/tiny", "main", tmp_path / "work")
    assert calls["info"] == ("org/tiny", "main", "hf_secret")
    assert calls["download"] == ("org/tiny", SHA, "hf_secret", ALLOW_PATTERNS)
    assert ckpt.resolved_revision == SHA and ckpt.provenance()["resolved_revision"] == SHA
    assert not any(p.endswith((".bin", ".pth")) for p in ALLOW_PATTERNS)
    assert ckpt.path == tmp_path / "work" / "checkpoint" and "model.safetensors" in ckpt.files


def test_hf_pickle_only_repo_is_refused_before_downloading(tmp_path, monkeypatch):
    def model_info(self, repo_id, revision=None, token=None, **_):
        names = ["config.json", "pytorch_model.bin", "tokenizer.json"]
        return SimpleNamespace(sha=SHA, siblings=[SimpleNamespace(rfilename=n) for n in names])

    def snapshot_download(*_a, **_k):
        raise AssertionError("must not download a pickle-only repo")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(FetchError, match=rf"hf://org/old@{SHA} has only pickle weights \(pytorch_model.bin\)"):
        fetch_checkpoint("hf://org/old", None, tmp_path / "work")


def test_s3_fetch_is_resumable(toy_model, s3_bucket, tmp_path):
    import boto3

    model = toy_model("llama-tiny")
    s3 = boto3.client("s3")
    for f in model.iterdir():
        s3.upload_file(str(f), s3_bucket, f"m/{f.name}")
    first = fetch_checkpoint(f"s3://{s3_bucket}/m/", None, tmp_path / "work")
    stamp = (first.path / "model.safetensors").stat().st_mtime_ns
    again = fetch_checkpoint(f"s3://{s3_bucket}/m", None, tmp_path / "work")
    assert again.files == first.files and (again.path / "model.safetensors").stat().st_mtime_ns == stamp
    assert Path(again.path / "config.json").read_bytes() == (model / "config.json").read_bytes()
