"""``kiln build --fetch-only`` / ``--prefetched``: fetching the checkpoint apart from building it.

A build Job runs the two halves in two containers of one pod, so the user's model
credentials (``spec.model.credentialsSecret``: HF_TOKEN, AWS_*) and the artifact
store's credentials are never in one environment: the fetch init container
downloads with the first into the shared work dir and records what it fetched
(:data:`FETCHED_RECORD`); the build container, holding only the second, builds
from that record. This module imports neither torch nor the store.
"""

from __future__ import annotations

import json
from pathlib import Path

from kiln.builder.checkpoint import Checkpoint, fetch_checkpoint
from kiln.builder.draft_model import fetch_draft
from kiln.builder.errors import InvalidSpec

FETCHED_RECORD = "fetched-checkpoint.json"
DRAFT_RECORD = "draft/fetched-checkpoint.json"  # a speculative draft model's (kiln.builder.draft_model)


def fetch_only(engine, work_dir: Path) -> Checkpoint:
    """Fetch ``engine``'s checkpoint (and a draft model's, into ``work_dir/draft``) into ``work_dir`` and
    record them there for :func:`load_fetched`."""
    spec = engine.spec
    ckpt = fetch_checkpoint(spec.model.source, spec.model.revision, work_dir, file=spec.model.file)
    _record(work_dir / FETCHED_RECORD, ckpt, spec.model)
    if spec.speculative is not None and spec.speculative.draft_model is not None:
        _record(work_dir / DRAFT_RECORD, fetch_draft(spec, work_dir), spec.speculative.draft_model)
    return ckpt


def _record(path: Path, ckpt: Checkpoint, model) -> None:
    record = {**ckpt.provenance(), "file": model.file, "path": str(ckpt.path)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")


def load_fetched(engine, work_dir: Path) -> Checkpoint:
    """The checkpoint a ``--fetch-only`` run left in ``work_dir``, for this spec's source and revision."""
    return _load(work_dir / FETCHED_RECORD, engine.spec.model, "spec.model")


def load_fetched_draft(engine, work_dir: Path) -> Checkpoint | None:
    """The draft model a ``--fetch-only`` run left in ``work_dir`` (None without one in the spec)."""
    spec = engine.spec
    if spec.speculative is None or spec.speculative.draft_model is None:
        return None
    return _load(work_dir / DRAFT_RECORD, spec.speculative.draft_model, "spec.speculative.draftModel")


def _load(path: Path, model, field: str) -> Checkpoint:
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise InvalidSpec(f"--prefetched: no {path}; run `kiln build --fetch-only` with the same --work-dir "
                          "first (a build Job's fetch init container does)") from None
    except ValueError as exc:
        raise InvalidSpec(f"--prefetched: {path} is not valid JSON ({exc}); run `kiln build --fetch-only` "
                          "again") from None
    wanted = {"source": model.source, "revision": model.revision, "file": model.file}
    if {k: record.get(k) for k in wanted} != wanted:
        held = f"{record.get('source')}@{record.get('revision')}" + (f" file {record['file']}" if record.get("file") else "")
        asked = f"{model.source}@{model.revision}" + (f" file {model.file}" if model.file else "")
        raise InvalidSpec(f"--prefetched: {path} holds {held}, but {field} is {asked}; fetch this spec's model "
                          "with `kiln build --fetch-only` into that work dir")
    ckpt_dir = Path(record.get("path") or "")
    if not ckpt_dir.is_dir():
        raise InvalidSpec(f"--prefetched: the fetched checkpoint {ckpt_dir} named in {path} is gone; fetch again")
    extra = {"gguf": record["gguf"]} if record.get("gguf") else {}  # a GGUF source's provenance
    return Checkpoint(path=ckpt_dir, source=record["source"], revision=record["revision"],
                      resolved_revision=record.get("resolved_revision"), files=dict(record.get("files") or {}),
                      **extra)
