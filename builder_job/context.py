"""The one object the build's stages share: the spec, the folders, the report, and what each stage hands on.

:func:`kiln.builder.pipeline.run_build` makes one :class:`BuildContext` and runs each stage of
:data:`kiln.builder.pipeline.STAGES` on it (``stage.run(ctx)``). A stage reads what the stages before it
set (``checkpoint`` after ``fetch``, ``facts`` after ``check``, ``kv_plan`` and ``config`` after ``plan``,
...) and sets its own; the fields below are in the order the stages fill them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.builder.errors import InvalidSpec
from kiln.builder.report import BuildReport
from kiln.engine.errors import ConfigError

# Tokens of KV the build-time runtime loads need: the calibration prompts and the tuning batches.
BUILD_TIME_KV_TOKENS = 8 * 1024


@dataclass
class BuildContext:
    engine: Any  # the LLMEngine being built
    store: Any  # kiln.artifacts.ArtifactStore
    version: str
    envelope: dict
    work_dir: Path
    report: BuildReport
    built_by: Any = None  # kiln.artifact_manifest.BuiltBy, recorded in the published manifest
    signer: Any = None  # kiln.signing.Signer that signs the published manifest; None: unsigned
    checkpoint: Any = None  # kiln.builder.checkpoint.Checkpoint: given (--prefetched) or fetched
    draft_checkpoint: Any = None  # the draft model's, with spec.speculative.draftModel
    device: str = "cpu"  # where the build runs the artifact: "cuda" or "cpu"
    facts: Any = None  # kiln.builder.model_facts.ModelFacts of the target
    tokenizer: Any = None
    prompts: list[str] = field(default_factory=list)  # the calibration texts
    token_lists: list[list[int]] = field(default_factory=list)  # ... tokenized for the gate
    draft_kv_bytes_per_token: int = 0  # the draft's K/V, planned into the pool beside the target's
    metrics: dict[str, Any] = field(default_factory=dict)  # the quality gate's measurements
    source: Any = None  # the source model (a StreamedCausalLM), until the runtime gate is done with it
    weights_per_rank: int = 0  # bytes of the largest rank's file (with the draft's on rank 0)
    kv_plan: dict[str, Any] = field(default_factory=dict)
    build_pool: int = 0  # KV blocks of the build-time loads (gate, tuning): see plan_build_pool
    config: dict[str, Any] = field(default_factory=dict)  # engine.json's engine_config
    tuning: dict[str, Any] = field(default_factory=dict)
    kernels: dict[str, Any] | None = None  # kiln.builder.kernel_cache's record, after the kernels stage
    document: dict[str, Any] = field(default_factory=dict)  # engine.json as published

    @property
    def spec(self):
        return self.engine.spec

    @property
    def out(self) -> Path:
        """The staged engine directory: what is published."""
        return self.work_dir / f"engine-{self.version}"

    @property
    def has_draft_model(self) -> bool:
        speculative = self.spec.speculative
        return speculative is not None and speculative.draft_model is not None

    @property
    def speculates(self) -> bool:
        return self.spec.speculative is not None and self.spec.speculative.is_on

    def plan_build_pool(self) -> None:
        """Build-time loads (gate, tuning) share the device with the fp32 source model, so they get a small
        KV pool: enough for their own requests. engine.json keeps the planned pool for serving."""
        block_size = self.spec.kv.block_size
        self.build_pool = min(self.kv_plan["num_kv_blocks"], BUILD_TIME_KV_TOKENS // block_size
                              + math.ceil(self.spec.max_seq_len / block_size))

    def load_llm(self, **overrides):
        """The staged artifact loaded through the runtime, with the build-time pool unless overridden."""
        # Deferred: the engine pulls in torch, and the torch-free stages (fetch, check) import this module.
        from kiln.engine import LLM

        try:
            # The build's own staged output: its kernels are the ones it just compiled and will ship.
            return LLM.from_artifact(str(self.out), device=self.device, trust_shipped_code=True,
                                     **{"num_kv_blocks": self.build_pool, **overrides})
        except ConfigError as exc:  # a limit the runtime enforces beyond the checks above
            raise InvalidSpec(f"the kiln runtime cannot run this envelope: {exc}") from None
