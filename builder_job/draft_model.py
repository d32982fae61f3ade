"""The draft model of ``spec.speculative.method: draft_model``: fetched, checked, converted into the artifact.

The draft is fetched like the target (any source ``spec.model`` accepts, GGUF included, into its own
work folder), must be an architecture the runtime runs, cover ``maxSeqLen`` positions and share the
target's tokenizer (every token the same id: :func:`kiln.engine.spec_decode.draft_model.tokenizer_mismatch`).
It is written unsharded, in the envelope's dtype and quantization, to ``draft/`` in the artifact
(config.json, ``weights/rank-0-of-1.safetensors``): the runtime runs it on rank 0 alone, over the
target's block tables, whatever the target's parallelism. The KV plan counts its weights and its
K/V per token (:func:`draft_kv_bytes_per_token`), since its pool has as many blocks as the target's.
Not a stage of its own: the ``fetch_draft``, ``quality_reference`` and ``shard`` stages call it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from kiln.builder.checkpoint import Checkpoint, fetch_checkpoint
from kiln.builder.errors import FetchError, InvalidSpec
from kiln.builder.model_facts import ModelFacts, model_facts, supported_architectures
from kiln.builder.sizing import DTYPE_BYTES, kv_dtype_name
from kiln.builder.stages.package import copy_model_files
from kiln.engine.errors import ConfigError

log = logging.getLogger("kiln.build.draft")
FIELD = "spec.speculative.draftModel"


def fetch_draft(spec, work_dir: Path) -> Checkpoint:
    """The draft checkpoint, fetched into ``work_dir/draft``; errors name the draftModel field."""
    draft = spec.speculative.draft_model
    try:
        return fetch_checkpoint(draft.source, draft.revision, work_dir / "draft", file=draft.file)
    except FetchError as exc:
        raise FetchError(str(exc).replace("spec.model", FIELD)) from None


def check_draft(spec, draft: Checkpoint, target_tokenizer) -> ModelFacts:
    """The draft's facts; InvalidSpec naming the field when the runtime cannot run it as this target's draft."""
    # Deferred: it imports torch, and the torch-free fetch-only path (kiln.builder.prefetch) imports us.
    from kiln.engine.spec_decode.draft_model import tokenizer_mismatch

    facts = model_facts(draft.path)
    where = f"{FIELD} ({spec.speculative.draft_model.source})"
    if facts.architecture not in supported_architectures():
        raise InvalidSpec(f"{where}: architecture {facts.architecture} is not one kiln runs "
                          f"({', '.join(supported_architectures())}); pick a draft of a supported family")
    if facts.max_positions < spec.max_seq_len:
        raise InvalidSpec(f"{where}: the draft supports {facts.max_positions} positions, fewer than spec.maxSeqLen "
                          f"({spec.max_seq_len}); lower maxSeqLen or pick a draft with a longer context")
    why = tokenizer_mismatch(target_tokenizer, str(draft.path))
    if why:
        raise InvalidSpec(f"{where}: {why}")
    return facts


def draft_kv_bytes_per_token(facts: ModelFacts, spec) -> int:
    """The draft's K and V per token: every layer and KV head (it is not sharded), in the KV dtype."""
    return 2 * facts.num_layers * facts.num_key_value_heads * facts.head_dim * DTYPE_BYTES[kv_dtype_name(spec)]


def write_draft(draft: Checkpoint, out: Path, spec) -> Path:
    """``out/draft``: config, tokenizer files and the one rank file of engine weights; returns the rank file."""
    # Deferred: they import torch, and the torch-free fetch-only path (kiln.builder.prefetch) imports us.
    from kiln.engine.artifact import write_rank_weights
    from kiln.engine.config import canonical_quantization
    from kiln.engine.spec_decode.draft_model import ARTIFACT_DRAFT_DIR

    root = out / ARTIFACT_DRAFT_DIR
    copy_model_files(draft.path, root)
    try:
        [(path, num_tensors)] = write_rank_weights(draft.path, root / "weights", 1, dtype=spec.dtype,
                                                   quantization=canonical_quantization(spec.quantization))
    except ConfigError as exc:
        raise InvalidSpec(f"{FIELD}: the kiln runtime cannot convert the draft checkpoint: {exc}") from None
    log.info("draft model: wrote %s (%d tensors, %.1f MiB)", path.relative_to(out), num_tensors,
             path.stat().st_size / 2**20)
    return path
