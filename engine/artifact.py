"""Engine artifacts: what the builder writes and ``LLM.from_artifact`` loads.

Layout (docs/artifacts.md, "The engine artifact"): ``engine.json`` (format version, GPU arch, the
``engine_config`` kwargs for ``LLM``), config.json and tokenizer files, and
``weights/rank-{r}-of-{n}.safetensors``: each rank's shard of the model (``n`` =
tensor_parallel_size x pipeline_parallel_size, ``r = pp_stage * tp_size + tp_rank``: a
stage's file holds only its layers, stage 0 the embedding, the last stage the norm and
LM head) under
engine parameter names (fused ``qkv_proj``/``gate_up_proj``), already cast and,
for weight-only quantization, int8 / float8_e4m3fn ``<name>.weight`` plus a
float32 ``<name>.weight_scale`` per output channel. The runtime copies these
tensors as they are; no conversion happens at serving time.

``iter_rank_states`` produces those per-rank state dicts with the runtime's
own layers (each parameter slicing its shard), so what the builder writes is
by construction what the runtime expects; ``write_rank_weights`` writes each rank's
file as it is built and drops it, holding one rank at a time.
"""

from __future__ import annotations

import gc
import json
import logging
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from kiln.engine import parallel
from kiln.engine.config import EngineConfig, canonical_quantization
from kiln.engine.errors import ConfigError
from kiln.engine.layers.linear import quantize_weight

__all__ = ["FORMAT_VERSION", "artifact_engine_config", "current_arch", "iter_rank_states", "quantize_weight",
           "read_engine_json", "save_rank_weights", "shard_checkpoint", "weights_file_name", "write_rank_weights"]

log = logging.getLogger("kiln.engine.artifact")

# Mirrors kiln.envelope.ARTIFACT_FORMAT_VERSION (the engine imports nothing of kiln core).
FORMAT_VERSION = 1
TACTICS_FILE = "tactics.json"  # the build's tactic table (kiln.engine.tactics), beside engine.json
# What ``engine.json``'s ``engine_config`` may set: the settings a build decides (``ENGINE_SETTINGS`` in
# builder_job/engine_settings.py and its stages' overrides). Paths the engine loads code from or writes to
# (compile_cache, tactics, tactics_cache, weights_dir, model), devices and where ranks meet come from the
# caller, never from the store (docs/operator-trust.md).
ARTIFACT_SETTINGS = frozenset({
    "dtype", "quantization", "kv_cache_dtype", "tensor_parallel_size", "pipeline_parallel_size", "max_batch_size",
    "max_input_len", "max_seq_len", "max_num_tokens", "block_size", "enable_prefix_caching", "num_kv_blocks",
    "kv_memory_fraction", "cuda_graph_batch_sizes", "enforce_eager", "enable_lora", "max_loras", "max_lora_rank",
    "max_cpu_loras", "compile", "attention_backend", "speculative_config", "tactics_exclude", "lm_head_int8"})


def weights_file_name(rank: int, size: int) -> str:
    return f"rank-{rank}-of-{size}.safetensors"


def current_arch() -> str:
    """"cpu", or "sm<major><minor>" of the visible CUDA device."""
    if not torch.cuda.is_available():
        return "cpu"
    major, minor = torch.cuda.get_device_capability()
    return f"sm{major}{minor}"


def read_engine_json(artifact_dir: str | Path) -> dict[str, Any]:
    path = Path(artifact_dir) / "engine.json"
    if not path.is_file():
        raise ConfigError(f"{artifact_dir} is not an engine artifact: engine.json is missing")
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    version = doc.get("format_version")
    if version != FORMAT_VERSION:
        raise ConfigError(f"{path}: format_version {version!r} is not supported by this runtime "
                          f"(it reads format_version {FORMAT_VERSION}); rebuild the engine with this kiln version")
    return doc


def artifact_engine_config(artifact_dir: str | Path, **overrides: Any) -> EngineConfig:
    """The EngineConfig to run an artifact here; refuses another GPU arch or mismatched weights."""
    root = Path(artifact_dir)
    doc = read_engine_json(root)
    built_arch = (doc.get("gpu") or {}).get("arch", "cpu")
    here = current_arch()
    if built_arch != "cpu" and built_arch != here:
        sku = (doc.get("gpu") or {}).get("sku", "?")
        raise ConfigError(f"artifact {root} was built for GPU arch {built_arch} ({sku}) but this machine's device "
                          f"is {here}; build the engine for {here} (spec.gpu) or run it on a {built_arch} GPU")
    adapt = overrides.pop("adapt_to_cpu", True)
    # Code shipped in the artifact (CPU kernel libraries, compiled GPU kernels, the Inductor cache's pickled
    # graphs and .so kernels) is loaded only when the caller verified the artifact's signature (kiln serve
    # --verify-key); else this host compiles its own.
    trusted = overrides.pop("trust_shipped_code", False)
    kwargs = stored_settings(root, doc)
    kwargs.update(overrides)
    kwargs.setdefault("device", "cpu" if built_arch == "cpu" else "cuda")
    kwargs["quantization"] = canonical_quantization(kwargs.get("quantization"))
    if kwargs["device"] == "cpu" and adapt:
        _adapt_to_cpu(kwargs, doc, dtype_forced="dtype" in overrides)
    if kwargs["device"] == "cpu":
        from kiln.engine.compile import shipped_compile

        shipped_compile(root, doc, kwargs, trusted)
        from kiln.engine.kernels.cpu_library import install_from_artifact

        install_from_artifact(root, doc, trusted)
        table = root / TACTICS_FILE
        if table.is_file():  # the build's measured kernels; another kind of host re-times, cached beside the copy
            kwargs.setdefault("tactics", str(table))
            kwargs.setdefault("tactics_cache", str(root.parent / f"{root.name}.tactics"))
    if kwargs["device"] == "cuda":  # before the first kernel compiles: the build's kernel cache, if it fits
        from kiln.engine.kernels.cache import install_shipped

        install_shipped(root, doc, trusted=trusted)
    weights = root / "weights"
    tp = int(kwargs.get("tensor_parallel_size", 1))
    pp = int(kwargs.get("pipeline_parallel_size", 1))
    n = tp * pp
    if weights.is_dir():
        missing = [weights_file_name(r, n) for r in range(n) if not (weights / weights_file_name(r, n)).is_file()]
        if missing:
            have = sorted(p.name for p in weights.glob("*.safetensors"))
            raise ConfigError(f"artifact {root} lacks {', '.join(missing)} for tensor_parallel_size={tp} x "
                              f"pipeline_parallel_size={pp} (it has {', '.join(have) or 'no weights'}); the weights "
                              f"are sharded at build time: run it with the parallel sizes it was built for")
        kwargs["weights_dir"] = str(weights)
    kwargs["model"] = str(root)
    speculative = kwargs.get("speculative_config")
    if isinstance(speculative, dict) and speculative.get("model"):
        model = Path(str(speculative["model"]))
        if "speculative_config" not in overrides:  # the artifact's: a folder inside it, nowhere else
            model = _inside(root, str(speculative["model"]))
        elif not model.is_absolute():  # the caller's: a relative draft is the artifact's, as the artifact names it
            model = root / model
        kwargs["speculative_config"] = {**speculative, "model": str(model)}
    return EngineConfig(**kwargs)


def stored_settings(root: Path, doc: dict[str, Any]) -> dict[str, Any]:
    """``engine.json``'s ``engine_config``: the :data:`ARTIFACT_SETTINGS` it sets. Refuses a known setting outside
    that list (a path the engine writes, a code cache); warns about and ignores one this runtime does not know."""
    known = {f.name for f in fields(EngineConfig)}
    stored = doc.get("engine_config") or {}
    if not isinstance(stored, dict):
        raise ConfigError(f"{root / 'engine.json'}: engine_config must be an object of settings, got "
                          f"{type(stored).__name__}; rebuild the engine with this kiln version")
    ignored = sorted(set(stored) - known)
    if ignored:
        log.warning("engine.json engine_config keys this runtime does not know, ignored: %s", ", ".join(ignored))
    refused = sorted(set(stored) & known - ARTIFACT_SETTINGS)
    if refused:
        raise ConfigError(f"{root / 'engine.json'}: engine_config sets {', '.join(refused)}, which an artifact may "
                          f"not set (paths and code caches come from the runtime, not the store); rebuild the engine "
                          f"with this kiln version, or pass them as LLM(...) keywords / kiln serve flags")
    return {k: v for k, v in stored.items() if k in ARTIFACT_SETTINGS}


def _inside(root: Path, relative: Any) -> Path:
    """``root / relative`` for a path an artifact names, refused when it leaves the artifact's folder."""
    path = (root / str(relative)).resolve()
    if not path.is_relative_to(root.resolve()):
        raise ConfigError(f"{root / 'engine.json'}: speculative_config.model {relative!r} is outside the artifact; "
                          f"an artifact's draft model is a folder inside it: rebuild the engine with this kiln version")
    return path


def _adapt_to_cpu(kwargs: dict[str, Any], doc: dict[str, Any], dtype_forced: bool) -> None:
    """Compute dtype, int8 path and threads for this CPU (:func:`kiln.engine.cpu_target.plan_cpu_load`).

    The build's tuned thread count is a hint used only on the CPU type it was measured on.
    ``adapt_to_cpu=False`` (an ``LLM.from_artifact`` keyword) runs the artifact as built.
    """
    from kiln.engine.cpu_target import plan_cpu_load

    tuning = doc.get("tuning") or {}
    plan = plan_cpu_load(kwargs.get("dtype", "float32"), kwargs.get("quantization"),
                         kwargs.get("kv_cache_dtype", "auto"), threads_hint=tuning.get("torch_num_threads"),
                         built_on=tuning.get("cpu"))
    if dtype_forced:
        plan["dtype"] = kwargs["dtype"]
    kwargs["dtype"] = plan["dtype"]
    kwargs["kv_cache_dtype"] = plan["kv_cache_dtype"]
    kwargs["cpu_target"] = plan


def iter_rank_states(model_dir: str | Path, tp_size: int, dtype: str = "float32", quantization: str | None = None,
                     pp_size: int = 1) -> Iterator[dict[str, torch.Tensor]]:
    """Each rank's engine state dict of a Hugging Face checkpoint, cast and optionally quantized, built
    when asked for, in global rank order (``rank = pp_stage * tp_size + tp_rank``).

    Built with the runtime's own layers, one rank at a time, with no process group; a consumer that
    drops each state before asking for the next holds one rank at a time (:func:`write_rank_weights`).
    Tied LM heads are left out where the embedding is in the same file (the runtime ties
    them again at load); a last pipeline stage without the embedding stores its own head.
    """
    from kiln.engine.model_runner import build_model

    for rank in range(tp_size * pp_size):
        with parallel.shard_context(rank, tp_size, pp_size):
            config = EngineConfig(model=str(model_dir), dtype=dtype, quantization=quantization,
                                  tensor_parallel_size=tp_size, pipeline_parallel_size=pp_size, device="cpu",
                                  num_kv_blocks=1)
            model = build_model(config)
        names = {n for n, _ in model.named_parameters()}
        state = {n: t.detach().contiguous() for n, t in model.state_dict().items() if n in names}
        del model
        yield state
        del state  # before the next rank is built: the consumer may have dropped it


def shard_checkpoint(model_dir: str | Path, tp_size: int, dtype: str = "float32",
                     quantization: str | None = None, pp_size: int = 1) -> list[dict[str, torch.Tensor]]:
    """Every rank's state dict of :func:`iter_rank_states` at once (tests, small models)."""
    return list(iter_rank_states(model_dir, tp_size, dtype, quantization, pp_size))


def _save_rank(state: dict[str, torch.Tensor], out: Path, rank: int, size: int, pp_size: int) -> Path:
    from safetensors.torch import save_file

    path = out / weights_file_name(rank, size)
    tp = size // pp_size
    save_file(state, str(path), metadata={"format": "pt", "kiln_rank": str(rank), "kiln_tp": str(tp),
                                          "kiln_pp": str(pp_size), "kiln_pp_stage": str(rank // tp)})
    return path


def save_rank_weights(states: list[dict[str, torch.Tensor]], weights_dir: str | Path,
                      pp_size: int = 1) -> list[Path]:
    """Write ``weights/rank-{r}-of-{n}.safetensors`` for each state dict of ``shard_checkpoint``."""
    out = Path(weights_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [_save_rank(state, out, rank, len(states), pp_size) for rank, state in enumerate(states)]


def write_rank_weights(model_dir: str | Path, weights_dir: str | Path, tp_size: int, dtype: str = "float32",
                       quantization: str | None = None, pp_size: int = 1) -> list[tuple[Path, int]]:
    """Shard and write each rank's file as soon as it is built, then drop it: one rank in memory at a time.

    The files are those of ``save_rank_weights(shard_checkpoint(...))``: same header and data bytes
    (safetensors orders the ``__metadata__`` keys by a randomly seeded hash map, in either). Returns
    (path, number of tensors) per rank.
    """
    out = Path(weights_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    # No enumerate(): it keeps its last (index, item) tuple, so the last rank, until the next is built.
    for state in iter_rank_states(model_dir, tp_size, dtype, quantization, pp_size):
        written.append((_save_rank(state, out, len(written), tp_size * pp_size, pp_size), len(state)))
        del state
        gc.collect()
    return written
