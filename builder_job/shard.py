"""Shard the checkpoint for tensor (and pipeline) parallelism into the per-rank files the runtime loads directly.

Each ``weights/rank-{r}-of-{n}.safetensors`` holds rank ``r``'s parameters under the
runtime's own names (fused ``qkv_proj``/``gate_up_proj``, vocab-parallel embedding
slices), already in the envelope's dtype and, for ``int8``/``fp8``, quantized with
``<name>.weight_scale``. The runtime's ``shard_checkpoint`` builds each rank with
its own layers (every parameter slicing its shard), so the layout comes from the
code that will load it. With pipeline parallelism (``spec.pipeline_parallel`` > 1, once the
API carries it) there is one file per (stage, TP rank): ``r = stage * tensor_parallel + tp_rank``,
each stage's file holding only its layers.
"""

from __future__ import annotations

import logging
from pathlib import Path

from kiln.builder.errors import InvalidSpec

log = logging.getLogger("kiln.build.shard")


def pipeline_parallel(spec) -> int:
    """The spec's pipeline-parallel degree (1 until the API's spec carries ``pipeline_parallel``)."""
    return int(getattr(spec, "pipeline_parallel", None) or 1)


def shard_weights(checkpoint_dir: Path, out_dir: Path, spec) -> list[Path]:
    """Write one safetensors file per rank into ``out_dir``; returns their paths in rank order."""
    from kiln.engine.artifact import write_rank_weights
    from kiln.engine.errors import ConfigError

    try:  # each rank's file is written as it is built: one rank in memory at a time
        written = write_rank_weights(checkpoint_dir, out_dir, spec.tensor_parallel, dtype=spec.dtype,
                                     quantization=None if spec.quantization == "none" else spec.quantization,
                                     pp_size=pipeline_parallel(spec))
    except ConfigError as exc:
        raise InvalidSpec(f"the kiln runtime cannot shard this checkpoint: {exc}") from None
    for path, num_tensors in written:
        log.info("wrote %s (%d tensors, %.1f MiB)", path.name, num_tensors, path.stat().st_size / 2**20)
    return [path for path, _ in written]
