"""The build's ``shard`` stage: the checkpoint for tensor (and pipeline) parallelism, as the per-rank files
the runtime loads directly.

Each ``weights/rank-{r}-of-{n}.safetensors`` holds rank ``r``'s parameters under the
runtime's own names (fused ``qkv_proj``/``gate_up_proj``, vocab-parallel embedding
slices), already in the envelope's dtype and, for ``int8``/``fp8``, quantized with
``<name>.weight_scale``. The runtime's ``shard_checkpoint`` builds each rank with
its own layers (every parameter slicing its shard), so the layout comes from the
code that will load it. With ``quantization: gguf`` the GGUF's block tensors replace the linears, the
embedding and the head (:mod:`kiln.builder.gguf_artifact`). With pipeline parallelism (``spec.pipeline_parallel`` > 1) there is one file
per (stage, TP rank): ``r = stage * tensor_parallel + tp_rank``, each stage's file holding only its
layers. A draft model (``spec.speculative.draftModel``) is written beside rank 0's file
(:func:`kiln.builder.draft_model.write_draft`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from kiln.builder.context import BuildContext
from kiln.builder.draft_model import write_draft
from kiln.builder.errors import InvalidSpec
from kiln.builder.gguf_artifact import write_gguf_ranks
from kiln.builder.report import human_bytes
from kiln.builder.sizing import pipeline_parallel
from kiln.builder.stages.package import copy_model_files, dir_bytes
from kiln.engine.artifact import write_rank_weights
from kiln.engine.config import canonical_quantization
from kiln.engine.errors import ConfigError

log = logging.getLogger("kiln.build.shard")


def record_tokenizer(out: Path, copied: list[str]) -> None:
    """The tokenizer's record in the artifact (kiln.engine.light_tokenizer): a serving pod's first load of the
    artifact builds it without importing transformers (1.0-1.2 s of a start). Made from the tokenizer as serving
    loads it from these files; a tokenizer that cannot have one is loaded through transformers at every start."""
    from kiln.engine.light_tokenizer import save_artifact_record
    from kiln.engine.tokenizer import load_hf_tokenizer

    try:
        recorded = save_artifact_record(out, load_hf_tokenizer(str(out)), copied)
    except Exception as exc:  # noqa: BLE001 - the record only saves time; the quality stage judges the tokenizer
        log.warning("tokenizer not recorded (%s: %s): serving loads it through transformers", type(exc).__name__, exc)
        return
    if recorded is not None:
        log.info("tokenizer: recorded for loads without transformers")


def run(ctx: BuildContext) -> None:
    """Config and tokenizer copied, one weights file per rank (and the draft's); the sizes into the report."""
    ckpt, out = ctx.checkpoint, ctx.out
    record_tokenizer(out, copy_model_files(ckpt.path, out))
    rank_files = shard_weights(ckpt.path, out / "weights", ctx.spec)
    weights_per_rank = max(p.stat().st_size for p in rank_files)
    ctx.report.record("sizes", {"source_weight_bytes": sum(s for n, s in ckpt.files.items()
                                                           if n.endswith(".safetensors")),
                                "artifact_weight_bytes": dir_bytes(out / "weights"),
                                "weight_bytes_per_rank": weights_per_rank,
                                "rank_files": [p.name for p in rank_files]})
    log.info("weights: %s per rank, %d rank file(s)", human_bytes(weights_per_rank), len(rank_files))
    if ctx.has_draft_model:  # on rank 0, beside its shard; counted on every rank (rank 0 sets every pool)
        weights_per_rank += write_draft(ctx.draft_checkpoint, out, ctx.spec).stat().st_size
    ctx.weights_per_rank = weights_per_rank


def shard_weights(checkpoint_dir: Path, out_dir: Path, spec) -> list[Path]:
    """Write one safetensors file per rank into ``out_dir``; returns their paths in rank order."""
    if spec.quantization == "gguf":  # the GGUF file's own blocks (kiln.builder.gguf_artifact)
        written = write_gguf_ranks(checkpoint_dir, out_dir, spec, pipeline_parallel(spec))
        for path, num_tensors in written:
            log.info("wrote %s (%d tensors, GGUF blocks, %.1f MiB)", path.name, num_tensors, path.stat().st_size / 2**20)
        return [path for path, _ in written]
    try:  # each rank's file is written as it is built: one rank in memory at a time
        written = write_rank_weights(checkpoint_dir, out_dir, spec.tensor_parallel, dtype=spec.dtype,
                                     quantization=canonical_quantization(spec.quantization),
                                     pp_size=pipeline_parallel(spec))
    except ConfigError as exc:
        raise InvalidSpec(f"the kiln runtime cannot shard this checkpoint: {exc}") from None
    for path, num_tensors in written:
        log.info("wrote %s (%d tensors, %.1f MiB)", path.name, num_tensors, path.stat().st_size / 2**20)
    return [path for path, _ in written]
