"""Assemble the engine directory that is published: ``engine.json``, config, tokenizer, weights.

Layout (the runtime's ``LLM.from_artifact`` reads it; see docs/artifacts.md)::

    engine.json                          format_version, versions, envelope, gpu, engine_config,
                                         kv_plan, tuning, build_report, kernels (what kernels/ holds),
                                         chat (the tool-call format of the model's family)
    config.json, tokenizer files, chat template, generation_config.json (copied)
    weights/rank-{r}-of-{n}.safetensors  one per (pipeline stage, tensor-parallel rank), engine parameter names
    kernels/triton-cache/                CUDA builds: Triton's compiled-kernel cache (kiln.engine.kernels.cache)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from kiln.builder.fetch import MODEL_FILES

import kiln

ENGINE_JSON = "engine.json"
# Everything fetched from the checkpoint except weights: the runtime needs config + tokenizer.
COPIED_FILES = MODEL_FILES


def copy_model_files(checkpoint_dir: Path, out_dir: Path) -> list[str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in COPIED_FILES:
        src = checkpoint_dir / name
        if src.is_file():
            shutil.copyfile(src, out_dir / name)
            copied.append(name)
    return copied


def engine_config(spec, num_kv_blocks: int, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Keyword arguments for ``LLM(...)``: the envelope's limits plus what was planned and tuned."""
    cfg = {
        "dtype": spec.dtype,
        "quantization": None if spec.quantization == "none" else spec.quantization,
        "kv_cache_dtype": spec.kv_cache_dtype,
        "tensor_parallel_size": spec.tensor_parallel,
        "pipeline_parallel_size": int(getattr(spec, "pipeline_parallel", None) or 1),
        "max_batch_size": spec.max_batch_size,
        "max_input_len": spec.max_input_len,
        "max_seq_len": spec.max_seq_len,
        "max_num_tokens": spec.max_num_tokens,
        "block_size": spec.kv.block_size,
        "enable_prefix_caching": spec.kv.enable_prefix_caching,
        "num_kv_blocks": num_kv_blocks,
        "kv_memory_fraction": spec.kv.memory_fraction,
        "cuda_graph_batch_sizes": None,
    }
    cfg.update(overrides or {})
    return cfg


def engine_document(*, spec, envelope: dict, version: str, config: dict, kv_plan: dict, tuning: dict,
                    build_report: dict, kernels: dict | None = None) -> dict[str, Any]:
    """``kernels``: the record of :func:`kiln.builder.kernel_cache.build_kernel_cache` (None before it ran)."""
    import torch

    from kiln.envelope import ARTIFACT_FORMAT_VERSION

    gpu = spec.gpu_spec
    return {
        "format_version": ARTIFACT_FORMAT_VERSION,
        "kiln_version": kiln.__version__,
        "torch_version": torch.__version__,
        "engine_version": version,
        "envelope": envelope,
        "gpu": {"sku": spec.gpu, "arch": gpu.arch, "compute_capability": gpu.compute_capability,
                "memory_gib": gpu.memory_gib},
        "engine_config": config,
        "kv_plan": kv_plan,
        "tuning": tuning,
        "build_report": build_report,
        "kernels": kernels,
    }


def chat_document(model_dir: Path) -> dict[str, Any]:
    """What serving needs to know of the chat template: the tool-call format of the model's family
    (``kiln.engine.structured.tool_format``), from chat_template.jinja or tokenizer_config.json."""
    from kiln.engine.structured.tool_format import detect_tool_call_format

    template = None
    if (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    elif (model_dir / "tokenizer_config.json").is_file():
        template = json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return {"tool_call_format": detect_tool_call_format(template if isinstance(template, str) else None)}


def write_engine_json(out_dir: Path, document: dict[str, Any]) -> Path:
    path = out_dir / ENGINE_JSON
    document.setdefault("chat", chat_document(out_dir))  # the copied template is beside engine.json
    path.write_text(json.dumps(document, indent=2, sort_keys=False) + "\n")
    return path


def dir_bytes(path: Path, pattern: str = "**/*") -> int:
    return sum(p.stat().st_size for p in path.glob(pattern) if p.is_file())
