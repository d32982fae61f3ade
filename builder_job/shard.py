"""Shard the checkpoint for tensor parallelism into the per-rank files the runtime loads directly.

Each ``weights/rank-{r}-of-{n}.safetensors`` holds rank ``r``'s parameters under the
runtime's own names (fused ``qkv_proj``/``gate_up_proj``, vocab-parallel embedding
slices), already in the envelope's dtype and, for ``int8``/``fp8``, quantized with
``<name>.weight_scale``. The runtime's ``shard_checkpoint`` does the work when the
engine provides one; otherwise the same thing is done here with the engine's own
model classes: build rank ``r``'s model without a process group
(``parallel.shard_context``), let every parameter load its slice, quantize, save.
Either way the layout comes from the code that will load it.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("kiln.build.shard")


def rank_file(rank: int, size: int) -> str:
    return f"rank-{rank}-of-{size}.safetensors"


def _shard_with_engine_models(checkpoint_dir: Path, out_dir: Path, spec) -> list[Path]:
    import torch
    from kiln.engine import parallel
    from kiln.engine.config import EngineConfig
    from kiln.engine.model_runner import build_model
    from safetensors.torch import save_file

    n = spec.tensor_parallel
    paths = []
    for rank in range(n):
        config = EngineConfig(
            model=str(checkpoint_dir), dtype=spec.dtype, tensor_parallel_size=n, device="cpu",
            quantization=None if spec.quantization == "none" else spec.quantization,
            max_seq_len=spec.max_seq_len, max_input_len=spec.max_input_len, max_batch_size=spec.max_batch_size,
            max_num_tokens=spec.max_num_tokens,
        )
        with parallel.shard_context(rank, n), torch.no_grad():
            model = build_model(config)
        # named_parameters() drops tied duplicates (lm_head = embed_tokens), as the loader expects.
        state = {name: p.detach().contiguous() for name, p in model.named_parameters()}
        path = out_dir / rank_file(rank, n)
        save_file(state, str(path), metadata={"rank": str(rank), "tensor_parallel": str(n)})
        paths.append(path)
        log.info("wrote %s (%d tensors, %.1f MiB)", path.name, len(state), path.stat().st_size / 2**20)
        del model, state
    return paths


def shard_weights(checkpoint_dir: Path, out_dir: Path, spec) -> list[Path]:
    """Write one safetensors file per rank into ``out_dir``; returns their paths in rank order."""
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        from kiln.engine.artifact import shard_checkpoint
    except ImportError:
        shard_checkpoint = None
    if shard_checkpoint is None:
        return _shard_with_engine_models(checkpoint_dir, out_dir, spec)
    paths = shard_checkpoint(
        checkpoint_dir, out_dir, tensor_parallel_size=spec.tensor_parallel, dtype=spec.dtype,
        quantization=None if spec.quantization == "none" else spec.quantization,
    )
    return [Path(p) for p in paths]
