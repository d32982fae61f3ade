"""A checkpoint from its source into a local directory, pinned and safetensors-only: :class:`Checkpoint` and
:func:`fetch_checkpoint`, the library the build's ``fetch`` stage (:mod:`kiln.builder.stages.fetch`), the draft
model's (:mod:`kiln.builder.draft_model`), ``kiln build --fetch-only`` (:mod:`kiln.builder.prefetch`) and the
adapter build's base checkpoint (:mod:`kiln.builder.adapter.source`) fetch with.

Sources (``spec.model.source``):

- ``hf://org/name`` — Hugging Face Hub. The revision (branch, tag or sha) is resolved
  to a commit sha first and the download uses that sha, so the artifact records
  exactly which weights it was built from. Token: ``HF_TOKEN`` (from the
  ``credentialsSecret``). Only safetensors, config and tokenizer files are fetched.
- ``s3://bucket/prefix`` — any S3-compatible store through boto3 (endpoint from
  ``AWS_ENDPOINT_URL_S3``, credentials from the standard AWS variables).
- ``file:///abs/path`` or ``file://./relative`` (relative to the working directory) and
  ``pvc://claim/sub/path`` (mounted at ``$KILN_PVC_ROOT/claim``, default ``/models/claim``)
  are used in place, read-only.

Pickle checkpoints (``*.bin``, ``*.pt``) are refused: loading them runs arbitrary
code, and so would ``trust_remote_code``, which kiln never sets.

Local sources (``file://``, ``pvc://``) are read in place, so they must be what they
say: :mod:`kiln.builder.local_source` refuses symlinks and ``..`` escapes.

GGUF: a source naming a ``.gguf`` file (``file://``, ``s3://``, ``pvc://``, or ``hf://``
with ``spec.model.file``) is checked and dequantized into a checkpoint directory under
the work dir (:mod:`kiln.builder.gguf`); the provenance records the file's sha256.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import boto3
import huggingface_hub
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from kiln.builder import gguf
from kiln.builder.errors import FetchError
from kiln.builder.local_source import check_local_path, local_hint, refuse_linked_files

log = logging.getLogger("kiln.build.fetch")

# The checkpoint's files besides its weights: fetched, and copied into every artifact (package.py).
MODEL_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
    "chat_template.json",
)
ALLOW_PATTERNS = ["*.safetensors", "*.safetensors.index.json", *MODEL_FILES]
PICKLE_PATTERNS = ["*.bin", "*.pt", "*.pth", "*.pkl", "*.ckpt"]


@dataclass
class Checkpoint:
    """A fetched checkpoint directory and where it came from."""

    path: Path
    source: str
    revision: str | None  # what the spec asked for
    resolved_revision: str | None  # the commit sha (hf) or None where sources have no revisions
    files: dict[str, int] = field(default_factory=dict)  # name -> bytes
    gguf: dict | None = None  # for a GGUF source: file, sha256, architecture, tensor types

    @property
    def num_bytes(self) -> int:
        return sum(self.files.values())

    def provenance(self) -> dict:
        doc = {"source": self.source, "revision": self.revision, "resolved_revision": self.resolved_revision,
               "files": dict(sorted(self.files.items()))}
        if self.gguf:
            doc["gguf"] = self.gguf
        return doc


def _allowed(name: str) -> bool:
    return "/" not in name and any(fnmatch.fnmatch(name, p) for p in ALLOW_PATTERNS)


def _refuse_pickle_only(names: list[str], where: str) -> None:
    has_safetensors = any(n.endswith(".safetensors") for n in names)
    pickles = [n for n in names if any(fnmatch.fnmatch(n, p) for p in PICKLE_PATTERNS)]
    if not has_safetensors:
        if pickles:
            raise FetchError(
                f"spec.model.source: {where} has only pickle weights ({', '.join(sorted(pickles)[:3])}); kiln "
                "loads safetensors only because unpickling runs arbitrary code. Convert the checkpoint to "
                "safetensors (e.g. `model.save_pretrained(dir, safe_serialization=True)`) and point at that"
            )
        raise FetchError(f"spec.model.source: {where} has no *.safetensors weights; found: "
                         f"{', '.join(sorted(names)[:8]) or 'nothing'}")
    if "config.json" not in names:
        raise FetchError(f"spec.model.source: {where} has no config.json; point at a Hugging Face checkpoint "
                         "directory (config.json + *.safetensors + tokenizer files)")


def _fetch_local(source: str, revision: str | None, work_dir: Path) -> Checkpoint:
    path = check_local_path(source)
    if gguf.is_gguf(path.name):
        if not path.is_file():
            raise FetchError(f"spec.model.source: {source} -> {path} is not a file{local_hint(source, path)}")
        return _from_gguf(path, source, revision, None, work_dir)
    if not path.is_dir():
        raise FetchError(f"spec.model.source: {source} -> {path} is not a directory{local_hint(source, path)}")
    names = [p.name for p in path.iterdir() if p.is_file()]
    _refuse_pickle_only(names, str(path))
    refuse_linked_files(source, path, [n for n in names if _allowed(n)])
    files = {n: (path / n).stat().st_size for n in names if _allowed(n)}
    log.info("using local checkpoint %s (%d files, %.1f MiB)", path, len(files), sum(files.values()) / 2**20)
    return Checkpoint(path=path.resolve(), source=source, revision=revision, resolved_revision=None, files=files)


def _from_gguf(path: Path, source: str, revision: str | None, resolved: str | None, work_dir: Path
               ) -> Checkpoint:
    """Check a GGUF file and dequantize it into ``work_dir/checkpoint-gguf``.

    Outside hf:// (where the revision is the repo's commit), a 64-hex ``revision`` is the file's sha256.
    """
    expected = revision if resolved is None and gguf.is_sha256(revision) else None
    info = gguf.inspect_gguf(path, source, expected)
    ckpt_dir = gguf.convert_gguf(path, info, work_dir / "checkpoint-gguf")
    files = {p.name: p.stat().st_size for p in ckpt_dir.iterdir() if p.is_file() and _allowed(p.name)}
    log.info("GGUF %s (sha256 %s, %s) -> checkpoint %s (%.1f MiB float32)", info.file, info.sha256[:12],
             info.architecture, ckpt_dir, sum(files.values()) / 2**20)
    return Checkpoint(path=ckpt_dir, source=source, revision=revision, resolved_revision=resolved, files=files,
                      gguf=info.to_dict())


class _Progress:
    """Logs download progress at most every few seconds (boto3 calls this per chunk)."""

    def __init__(self, total: int, what: str) -> None:
        self.total, self.what, self.done, self.last = max(total, 1), what, 0, 0.0

    def __call__(self, num_bytes: int) -> None:
        self.done += num_bytes
        now = time.monotonic()
        if now - self.last > 5 or self.done >= self.total:
            self.last = now
            log.info("fetch %s: %.1f/%.1f MiB (%.0f%%)", self.what, self.done / 2**20, self.total / 2**20,
                     100 * self.done / self.total)


def _fetch_s3(source: str, revision: str | None, dest: Path, work_dir: Path | None = None) -> Checkpoint:
    bucket, _, prefix = source[len("s3://"):].partition("/")
    prefix = prefix.strip("/")
    if not bucket:
        raise FetchError(f"spec.model.source: {source!r} names no bucket; use s3://bucket/prefix")
    key_prefix = f"{prefix}/" if prefix else ""
    try:
        client = boto3.client("s3")
        if gguf.is_gguf(prefix):
            return _fetch_s3_gguf(client, source, bucket, prefix, revision, work_dir or dest.parent)
        objects: dict[str, int] = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key_prefix):
            for obj in page.get("Contents", []):
                objects[obj["Key"][len(key_prefix):]] = obj["Size"]
        if not objects:
            raise FetchError(f"spec.model.source: nothing under {source} (bucket {bucket}, prefix {key_prefix!r})")
        names = [n for n in objects if "/" not in n]
        _refuse_pickle_only(names, source)
        wanted = {n: s for n, s in objects.items() if _allowed(n)}
        progress = _Progress(sum(wanted.values()), source)
        dest.mkdir(parents=True, exist_ok=True)
        for name, size in sorted(wanted.items()):
            target = dest / name
            if target.exists() and target.stat().st_size == size:
                progress(size)  # a retried Job reuses what it already downloaded
                continue
            tmp = target.with_name(target.name + ".part")
            client.download_file(bucket, key_prefix + name, str(tmp), Callback=progress)
            tmp.replace(target)
    except FetchError:
        raise
    except NoCredentialsError:
        raise FetchError(f"spec.model.source: no AWS credentials to read {source}; set AWS_ACCESS_KEY_ID/"
                         "AWS_SECRET_ACCESS_KEY (spec.model.credentialsSecret)") from None
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "?")
        raise FetchError(f"spec.model.source: cannot read {source}: S3 error {code}: "
                         f"{exc.response.get('Error', {}).get('Message', '')}".rstrip(": ")) from None
    except BotoCoreError as exc:
        raise FetchError(f"spec.model.source: cannot reach S3 for {source}: {exc}") from None
    log.info("fetched %d files (%.1f MiB) from %s", len(wanted), sum(wanted.values()) / 2**20, source)
    return Checkpoint(path=dest, source=source, revision=revision, resolved_revision=None, files=wanted)


def _fetch_s3_gguf(client, source: str, bucket: str, key: str, revision: str | None, work_dir: Path) -> Checkpoint:
    """One GGUF object: download it (reused when complete) and convert it."""
    try:
        size = client.head_object(Bucket=bucket, Key=key)["ContentLength"]
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            raise FetchError(f"spec.model.source: no object {key!r} in bucket {bucket} ({source})") from None
        raise
    target = work_dir / "gguf" / key.rsplit("/", 1)[-1]
    target.parent.mkdir(parents=True, exist_ok=True)
    if not (target.exists() and target.stat().st_size == size):
        tmp = target.with_name(target.name + ".part")
        client.download_file(bucket, key, str(tmp), Callback=_Progress(size, source))
        tmp.replace(target)
    return _from_gguf(target, source, revision, None, work_dir)


def _fetch_hf_gguf(source: str, repo_id: str, file: str, revision: str | None, work_dir: Path) -> Checkpoint:
    """``spec.model.file`` of an hf:// repo: resolve the revision, download that one file, convert it."""
    token = os.environ.get("HF_TOKEN") or None
    info = huggingface_hub.HfApi().model_info(repo_id, revision=revision or "main", token=token)
    sha = info.sha
    names = [s.rfilename for s in (info.siblings or [])]
    if names and file not in names:
        ggufs = sorted(n for n in names if gguf.is_gguf(n))
        raise FetchError(f"spec.model.file: {file!r} is not in {repo_id}@{sha}; its GGUF files: "
                         f"{', '.join(ggufs[:8]) or 'none'}")
    log.info("resolved %s@%s to commit %s", repo_id, revision or "main", sha)
    try:
        path = huggingface_hub.hf_hub_download(repo_id, filename=file, revision=sha, token=token,
                                               local_dir=work_dir / "gguf")
    except EntryNotFoundError:
        raise FetchError(f"spec.model.file: {file!r} is not in {repo_id}@{sha}") from None
    return _from_gguf(Path(path), source, revision, sha, work_dir)


def _fetch_hf(source: str, revision: str | None, dest: Path, file: str | None = None) -> Checkpoint:

    repo_id = source[len("hf://"):].strip("/")
    token = os.environ.get("HF_TOKEN") or None
    try:
        if file:
            return _fetch_hf_gguf(source, repo_id, file, revision, dest.parent)
        info = huggingface_hub.HfApi().model_info(repo_id, revision=revision or "main", token=token)
        sha = info.sha
        names = [s.rfilename for s in (info.siblings or []) if "/" not in s.rfilename]
        _refuse_pickle_only(names, f"{source}@{sha}")
        log.info("resolved %s@%s to commit %s", repo_id, revision or "main", sha)
        path = huggingface_hub.snapshot_download(repo_id, revision=sha, token=token, local_dir=dest,
                                                 allow_patterns=ALLOW_PATTERNS)
    except FetchError:
        raise
    except GatedRepoError:
        raise FetchError(f"spec.model.source: {source} is gated; accept its license on the Hub and give a token "
                         "with access as HF_TOKEN (spec.model.credentialsSecret)") from None
    except RepositoryNotFoundError:
        raise FetchError(f"spec.model.source: {source} not found on the Hub (or private: set HF_TOKEN through "
                         "spec.model.credentialsSecret)") from None
    except RevisionNotFoundError:
        raise FetchError(f"spec.model.revision: {revision!r} is not a branch, tag or commit of {repo_id}") from None
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise FetchError(f"spec.model.source: cannot download {source}: {str(exc).splitlines()[0]}") from None
    path = Path(path)
    files = {p.name: p.stat().st_size for p in path.iterdir() if p.is_file() and _allowed(p.name)}
    return Checkpoint(path=path, source=source, revision=revision, resolved_revision=sha, files=files)


def fetch_checkpoint(source: str, revision: str | None, work_dir: Path, *, file: str | None = None
                     ) -> Checkpoint:
    """Fetch ``source`` (downloading into ``work_dir/checkpoint`` when remote).

    ``file`` is ``spec.model.file``: a GGUF file inside an hf:// repo.
    """
    dest = work_dir / "checkpoint"
    if file and not source.startswith("hf://"):
        raise FetchError(f"spec.model.file: only used with hf:// sources; put the file's path in "
                         f"spec.model.source ({source})")
    if source.startswith(("file://", "pvc://")):
        return _fetch_local(source, revision, work_dir)
    if source.startswith("s3://"):
        return _fetch_s3(source, revision, dest, work_dir)
    if source.startswith("hf://"):
        return _fetch_hf(source, revision, dest, file)
    raise FetchError(f"spec.model.source: unsupported scheme in {source!r}; use hf://, s3://, file:// or pvc://")

