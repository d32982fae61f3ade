"""The one loop every build runs: a list of stages over one context, each timed and named in the build report.

A stage is a module with ``run(ctx)``; its name in the report (``stage_seconds``, ``memory``) is its module's
last name (``kiln.builder.stages.tune`` -> ``tune``, ``kiln.builder.adapter.stages.gate`` -> ``gate``). A list
pairs each stage with whether it runs for this build. The engine's list is
:data:`kiln.builder.pipeline.STAGES` over a :class:`~kiln.builder.context.BuildContext`, an adapter's is
:data:`kiln.builder.adapter.pipeline.STAGES` over an :class:`~kiln.builder.adapter.context.AdapterContext`;
the context only needs a ``report`` (:class:`~kiln.builder.report.BuildReport`). Imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

Stages = Sequence[tuple[ModuleType, Callable[[Any], bool]]]


def always(ctx: Any) -> bool:
    """A stage every build of its kind runs."""
    return True


def stage_name(stage: ModuleType) -> str:
    """The name the report gives a stage: its module's (``kiln.builder.stages.tune`` -> ``tune``)."""
    return stage.__name__.rpartition(".")[2]


def run_stages(stages: Stages, ctx: Any) -> None:
    """Each stage that runs for ``ctx``, in order, inside ``ctx.report.stage(name)`` (progress log, timing)."""
    for stage, runs in stages:
        if runs(ctx):
            with ctx.report.stage(stage_name(stage)):
                stage.run(ctx)
