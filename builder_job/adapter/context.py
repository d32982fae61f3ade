"""The one object an adapter build's stages share, as :class:`~kiln.builder.context.BuildContext` is an engine's.

:func:`kiln.builder.adapter.pipeline.run_adapter_build` makes one and runs each stage of
:data:`kiln.builder.adapter.pipeline.STAGES` on it; the fields below are in the order the stages fill them.
The fields the engine's ``publish`` stage reads (``store``, ``version``, ``out``, ``envelope``, ``built_by``,
``signer``) are spelled as a ``BuildContext`` spells them, so that stage publishes adapters too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.builder.checkpoint import Checkpoint
from kiln.builder.report import BuildReport

from kiln.artifact_manifest import BuiltBy
from kiln.artifacts import ArtifactStore
from kiln.lora_options import LoraAdapter
from kiln.signing import Signer


@dataclass
class AdapterContext:
    engine: Any  # the LLMEngine whose spec.lora.adapters[index] is built
    index: int
    adapter: LoraAdapter
    base: str  # the base engine's version
    version: str  # the adapter's: <base>-<name>-<hash>
    envelope: dict[str, Any]  # kiln.envelope.adapter_envelope(base, adapter)
    store: ArtifactStore
    work_dir: Path
    report: BuildReport
    built_by: BuiltBy | None = None
    signer: Signer | None = None
    prefetched: bool = False  # the adapter and the base checkpoint are what --fetch-only left in work_dir
    base_config: dict[str, Any] = field(default_factory=dict)  # the base artifact's config.json, verified
    source_dir: Path | None = None  # the PEFT files as fetched
    config: dict[str, Any] = field(default_factory=dict)  # their adapter_config.json, checked
    checkpoint: Checkpoint | None = None  # the base checkpoint the gate compares with
    document: dict[str, Any] = field(default_factory=dict)  # adapter.json as published

    @property
    def spec(self):
        return self.engine.spec

    @property
    def source_field(self) -> str:
        """The spec field every finding about this adapter's files names."""
        return f"spec.lora.adapters[{self.index}].source"

    @property
    def out(self) -> Path:
        """The staged adapter directory: what is published."""
        return self.work_dir / f"adapter-artifact-{self.adapter.name}"
