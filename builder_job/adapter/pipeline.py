"""An adapter build as a list of stages, run by the engines' loop (:func:`kiln.builder.stage_loop.run_stages`).

base (the base artifact's config.json, verified) -> fetch (the PEFT files) -> check (against the base and
maxLoraRank) -> convert (to the engine's dtype) -> fetch_base (the base checkpoint, for the gate) -> gate ->
package (adapter.json) -> publish (the engine's own stage: signed, atomic). Nothing reaches the store before
``publish``. Imports torch through the gate; the command's cache-hit path does not import this module.
"""

from __future__ import annotations

import shutil

from kiln.builder.adapter.context import AdapterContext
from kiln.builder.adapter.stages import base, check, convert, fetch, fetch_base, gate, package
from kiln.builder.stage_loop import Stages, always, run_stages
from kiln.builder.stages import publish

STAGES: Stages = (
    (base, always),
    (fetch, always),
    (check, always),
    (convert, always),
    (fetch_base, always),
    (gate, always),
    (package, always),
    (publish, always),
)


def run_adapter_build(ctx: AdapterContext) -> dict:
    """Run every stage on ``ctx``; the adapter's build report (``adapter.json`` as published)."""
    if ctx.out.exists():
        shutil.rmtree(ctx.out)  # a retried Job stages the adapter from scratch
    run_stages(STAGES, ctx)
    return ctx.document
