"""An adapter's PEFT files from its source (any scheme ``spec.model`` takes), and the base checkpoint the gate
compares with: ``kiln build-adapter --fetch-only`` fetches both into the work dir, ``--prefetched`` finds them.

Local sources (``file://``, ``pvc://``) are read in place after :func:`kiln.builder.local_source.check_local_path`
(no symlinks, no ``..``); ``s3://`` and ``hf://`` download only ``adapter_config.json`` and ``*.safetensors``
into ``<work>/adapter-<name>`` (pickles are never fetched).
"""

from __future__ import annotations

import logging
from pathlib import Path

from kiln.builder.checkpoint import Checkpoint
from kiln.builder.errors import FetchError
from kiln.builder.local_source import check_local_path
from kiln.builder.prefetch import fetch_only, load_fetched

log = logging.getLogger("kiln.build.adapter")
WANTED = ("adapter_config.json", "adapter_model.safetensors")


def adapter_dir(work_dir: Path, adapter) -> Path:
    """Where the adapter is (local sources) or lands (remote ones)."""
    if adapter.model_source.scheme in ("file", "pvc"):
        return check_local_path(adapter.source)
    return work_dir / f"adapter-{adapter.name}"


def fetch_adapter(engine, index: int, adapter, work_dir: Path, with_base: bool = True) -> Path:
    """Fetch the adapter (and the base checkpoint, for the gate) into ``work_dir``; the adapter's directory."""
    work_dir.mkdir(parents=True, exist_ok=True)
    dest = adapter_dir(work_dir, adapter)
    field = f"spec.lora.adapters[{index}].source"
    scheme = adapter.model_source.scheme
    try:
        if scheme == "s3":
            _fetch_s3(adapter.source, dest)
        elif scheme == "hf":
            _fetch_hf(adapter.source, adapter.revision or "main", dest)
    except FetchError:
        raise
    except Exception as exc:  # noqa: BLE001  (boto3 / hub errors: one line naming the field)
        raise FetchError(f"{field}: cannot fetch {adapter.source}: {str(exc).splitlines()[0]}") from None
    if not dest.is_dir():
        raise FetchError(f"{field}: {adapter.source} -> {dest} is not a directory")
    if with_base:
        fetch_only(engine, work_dir)
    return dest


def base_checkpoint(engine, work_dir: Path, prefetched: bool) -> Checkpoint:
    """The base checkpoint the gate loads: what --fetch-only left, or fetched now (a local source: in place)."""
    if prefetched:
        return load_fetched(engine, work_dir)
    return fetch_only(engine, work_dir)


def _fetch_s3(source: str, dest: Path) -> None:
    import boto3

    bucket, _, prefix = source[len("s3://"):].partition("/")
    prefix = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
    client = boto3.client("s3")
    dest.mkdir(parents=True, exist_ok=True)
    for name in WANTED:
        client.download_file(bucket, prefix + name, str(dest / name))
    log.info("fetched %s into %s", source, dest)


def _fetch_hf(source: str, revision: str, dest: Path) -> None:
    import huggingface_hub

    repo = source[len("hf://"):]
    huggingface_hub.snapshot_download(repo_id=repo, revision=revision, local_dir=dest, allow_patterns=list(WANTED))
