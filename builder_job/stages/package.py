"""The build's ``package`` stage: assemble the engine directory that is published: ``engine.json``, config,
tokenizer, weights.

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

from kiln.builder.checkpoint import MODEL_FILES
from kiln.builder.context import BuildContext
from kiln.engine.structured.tool_format import detect_tool_call_format

import kiln
from kiln.envelope import ARTIFACT_FORMAT_VERSION

ENGINE_JSON = "engine.json"
# Everything fetched from the checkpoint except weights: the runtime needs config + tokenizer.
COPIED_FILES = MODEL_FILES


def run(ctx: BuildContext) -> None:
    """The artifact's size into the report, and the final engine.json (with the kernels' record)."""
    ctx.report.record("sizes", {**ctx.report.findings["sizes"], "artifact_bytes": dir_bytes(ctx.out)})
    ctx.document = write_engine(ctx)


def write_engine(ctx: BuildContext) -> dict[str, Any]:
    """``engine.json`` in the staged engine as the build stands: the stages after ``plan`` rewrite it so that
    their loads see what the stages before them chose, as a serving pod will."""
    doc = engine_document(spec=ctx.spec, envelope=ctx.envelope, version=ctx.version, config=ctx.config,
                          kv_plan=ctx.kv_plan, tuning=ctx.tuning, build_report=ctx.report.to_dict(),
                          kernels=ctx.kernels)
    write_engine_json(ctx.out, doc)
    return doc


def copy_model_files(checkpoint_dir: Path, out_dir: Path) -> list[str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in COPIED_FILES:
        src = checkpoint_dir / name
        if src.is_file():
            shutil.copyfile(src, out_dir / name)
            copied.append(name)
    return copied


def engine_document(*, spec, envelope: dict, version: str, config: dict, kv_plan: dict, tuning: dict,
                    build_report: dict, kernels: dict | None = None) -> dict[str, Any]:
    """``kernels``: the record of :func:`kiln.builder.kernel_cache.build_kernel_cache` (None before it ran)."""
    import torch  # deferred: the torch-free fetch-only path (kiln.builder.prefetch) copies files with us

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
