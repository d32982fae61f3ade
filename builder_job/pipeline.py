"""The build pipeline: a list of stages run in order over one :class:`~kiln.builder.context.BuildContext`.

fetch (-> fetch_draft, with a draft model) -> check -> quality_reference (converting as it streams) ->
shard (and the draft) -> plan -> quality_runtime -> tune (and the KV plan again, less the CUDA graphs'
memory) -> tactics (each op's implementations timed, the winners shipped) -> compile -> speculative (with
spec.speculative on: where drafts pay per batch bucket, the table shipped) -> kernels (compiled,
autotuned, packed) -> package -> publish.

Each stage is the module ``kiln.builder.stages.<name>``, ``<name>`` being what the build report calls it
(``stage_seconds``), and runs as ``stage.run(ctx)`` inside ``report.stage(name)`` (progress log + timing):
the loop is :func:`kiln.builder.stage_loop.run_stages`, which runs an adapter's stages too.
Nothing reaches the store until the last stage, and the store's publish is atomic, so a
build that fails or is killed at any point leaves no visible version. The
quality gate runs twice: first on the converted weights in a reference model
(cheap, fails before sharding), then on the packaged artifact loaded by the
runtime itself, so what is published is exactly what was measured. Neither gate holds
a whole full-precision model: the reference models stream one unit of weights at a
time from the checkpoint (:mod:`kiln.builder.reference`), converting as they go, so
no stage before ``shard`` loads the checkpoint whole.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from kiln.builder.checkpoint import Checkpoint
from kiln.builder.context import BuildContext
from kiln.builder.errors import InvalidSpec
from kiln.builder.report import BuildReport
from kiln.builder.stage_loop import always, run_stages
from kiln.builder.stages import (
    check,
    fetch,
    fetch_draft,
    kernels,
    package,
    plan,
    publish,
    quality_reference,
    quality_runtime,
    shard,
    speculative,
    tactics,
    tune,
)
from kiln.builder.stages import compile as compile_stage  # `compile` would hide the builtin
from kiln.engine.artifact import current_arch

# The build, in order: (stage module, whether it runs for this build).
STAGES: tuple[tuple[ModuleType, Callable[[BuildContext], bool]], ...] = (
    (fetch, always),
    (fetch_draft, lambda ctx: ctx.has_draft_model),
    (check, always),
    (quality_reference, always),
    (shard, always),
    (plan, always),
    (quality_runtime, always),
    (tune, always),
    (tactics, always),
    (compile_stage, always),
    (speculative, lambda ctx: ctx.speculates),
    (kernels, always),
    (package, always),
    (publish, always),
)


@dataclass
class BuildResult:
    version: str
    artifact_uri: str
    engine_json: dict[str, Any]


def run_build(engine, store, version: str, envelope: dict, work_dir: Path, report: BuildReport,
              checkpoint: Checkpoint | None = None, built_by=None, draft_checkpoint: Checkpoint | None = None,
              signer=None) -> BuildResult:
    """Build ``engine`` (an ``LLMEngine``) as ``version`` and publish it to ``store``.

    ``checkpoint`` / ``draft_checkpoint``: already fetched (``--prefetched``); otherwise this fetches them. ``built_by``
    (:class:`kiln.artifacts.BuiltBy`) is recorded in the published manifest, which ``signer``
    (:class:`kiln.signing.Signer`) signs.
    """
    ctx = BuildContext(engine=engine, store=store, version=version, envelope=envelope, work_dir=work_dir,
                       report=report, built_by=built_by, checkpoint=checkpoint,
                       draft_checkpoint=draft_checkpoint, signer=signer)
    _prepare(ctx)
    run_stages(STAGES, ctx)
    return BuildResult(version=version, artifact_uri=store.artifact_uri(version), engine_json=ctx.document)


def _prepare(ctx: BuildContext) -> None:
    """Before any stage: a clean staging folder, the right machine, and the device the build runs on."""
    if ctx.out.exists():
        shutil.rmtree(ctx.out)  # a retried Job starts the package from scratch
    _check_build_machine(ctx.spec)  # before a download that could take an hour
    ctx.device = "cuda" if torch.cuda.is_available() and not ctx.spec.gpu_spec.is_cpu else "cpu"


def _check_build_machine(spec) -> None:
    """The gate and the tuning run the artifact here, so this machine must be the target's arch."""
    here = current_arch()
    if here != spec.gpu_spec.arch:
        raise InvalidSpec(f"spec.gpu: {spec.gpu} engines ({spec.gpu_spec.arch}) must be built on a {spec.gpu} "
                          f"(the build verifies and tunes on the target), but this machine is {here}; run the "
                          f"build on a {spec.gpu} node, or set spec.gpu: cpu for a CPU engine")
