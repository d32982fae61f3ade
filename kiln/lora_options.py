"""``spec.lora``: LoRA adapters served beside the base engine, many per batch (docs/lora.md).

``maxLoras`` (adapters on the device at once: the slots one batch mixes), ``maxLoraRank`` (how wide a
slot is: one of the runtime's ranks) and ``maxCpuLoras`` (adapters kept in host memory) size the
engine, so they are in the build envelope when ``spec.lora`` is set (:mod:`kiln.envelope`). The
adapter list is not: each adapter is built by its own Job into its own artifact
(``<base version>-<name>-<hash>``, :func:`kiln.envelope.adapter_version`) and loaded into running pods
without a restart, so adding or removing one never rebuilds the base engine.

An adapter is served under its ``name`` (requests send ``model: <name>``), so a name must be unique and
must not be the base's served name, which is the LLMEngine's ``metadata.name``: that rule sees the
object's metadata, so it is a root-level CEL rule (:data:`LORA_ROOT_RULES`, twin :func:`served_name_problems`).

The memory bound: an adapter's device slot holds ``maxLoraRank x (in + out)`` weights per target module
per layer, which depends on the model (unknown when the spec is checked: nothing is fetched). A Llama-3.1-8B
with all seven projections costs about 5 MiB per rank per slot in bf16, so ``maxLoras x maxLoraRank`` is
bounded by :data:`RANK_SLOTS_PER_GIB` per GiB of the SKU's memory (2560 on an 80 GiB GPU: about 13 GiB at
that size) and :data:`CPU_RANK_SLOTS` on cpu. The runtime sizes its KV pool after the slots, so a
larger model just gets fewer KV blocks; the bound only stops a spec that could not fit on any model.

:data:`LORA_RULES` are this part's cross-field rules (CEL, joined into ``kiln.api.CROSS_FIELD_RULES``);
:func:`lora_problems` is their Python twin.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationError, field_validator

from kiln.api_base import DNS1123_LABEL, DNS1123_SUBDOMAIN
from kiln.api_base import APIModel as _Model
from kiln.model_source import SOURCE_PATTERN, ModelSource, scheme_problems
from kiln.skus import GPU_SKUS

# The runtime's --max-lora-rank choices (kiln.engine.config.LORA_RANKS; the core imports no engine: a test
# checks they agree).
LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
LoraRank = Literal[8, 16, 32, 64, 128, 256, 320, 512]
MAX_ADAPTERS = 64
RANK_SLOTS_PER_GIB = 32
CPU_RANK_SLOTS = 4096


def rank_slot_budget(gpu: str) -> int:
    """The most ``maxLoras x maxLoraRank`` on ``gpu`` (module docstring)."""
    memory = GPU_SKUS[gpu].memory_gib
    return CPU_RANK_SLOTS if memory is None else memory * RANK_SLOTS_PER_GIB


class LoraAdapter(_Model):
    name: str = Field(
        max_length=63, pattern=DNS1123_LABEL,
        description="The adapter's served name (requests send model: <name>); unique, and not the engine's "
        "name (the base's served name). A DNS-1123 label.",
    )
    source: str = Field(
        max_length=1024, json_schema_extra={"pattern": SOURCE_PATTERN},
        description="Where the PEFT adapter directory (adapter_config.json + adapter_model.safetensors) lives: "
        "any scheme spec.model takes (hf://org/name, s3://bucket/prefix, file:///path, pvc://claim/path).",
    )
    revision: str | None = Field(
        default=None, max_length=255, pattern=r"^[A-Za-z0-9._/-]+$",
        description="hf://: branch, tag or commit sha (unset means main). Other sources: a label you bump when "
        "the files change: the adapter's version is computed before anything is fetched.",
    )
    credentials_secret: str | None = Field(
        default=None, max_length=253, pattern=DNS1123_SUBDOMAIN,
        description="Secret with HF_TOKEN (hf://) or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (s3://) for this "
        "adapter's fetch only; only valid for hf:// and s3:// sources.",
    )

    @field_validator("source")
    @classmethod
    def _check_source(cls, value: str) -> str:
        try:
            ModelSource(source=value)  # spec.model's scheme rules and messages
        except ValidationError as exc:
            raise ValueError(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None
        return value

    @property
    def model_source(self) -> ModelSource:
        """The adapter as a checkpoint source (the builder's fetch, the envelope's normalization)."""
        return ModelSource(source=self.source, revision=self.revision, credentials_secret=self.credentials_secret)


class LoraOptions(_Model):
    max_loras: int = Field(
        default=1, ge=1, le=256,
        description="Adapters on the device at once: the slots one batch mixes (a request whose adapter has no "
        "slot waits). maxLoras x maxLoraRank is bounded by the GPU's memory (docs/lora.md). In the engine version.",
    )
    max_lora_rank: LoraRank = Field(
        default=16,
        description="Largest adapter rank served (a slot's width): 8, 16, 32, 64, 128, 256, 320 or 512. An adapter "
        "of a larger rank fails its build. In the engine version.",
    )
    max_cpu_loras: int | None = Field(
        default=None, ge=1, le=4096,
        description="Adapters kept in host memory (LRU), at least maxLoras; unset means maxLoras. In the engine "
        "version (engine.json records it).",
    )
    adapters: list[LoraAdapter] = Field(
        default_factory=list, max_length=MAX_ADAPTERS, json_schema_extra={
            "default": [], "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="The adapters to serve, each built by its own Job and loaded into running pods without a "
        "restart; not in the engine version (adding or removing one never rebuilds the engine).",
    )

    @property
    def resolved_max_cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


def _budget_cel() -> str:
    """``self.gpu``'s rank-slot budget as a CEL conditional chain, from the same table as :func:`rank_slot_budget`."""
    names = list(GPU_SKUS)
    expr = str(rank_slot_budget(names[-1]))
    for gpu in reversed(names[:-1]):
        expr = f"(self.gpu == '{gpu}' ? {rank_slot_budget(gpu)} : {expr})"
    return expr


# (python check name, CEL rule on spec, message, fieldPath), joined to kiln.api.CROSS_FIELD_RULES.
LORA_RULES: tuple[tuple[str, str, str, str], ...] = (
    ("lora_unique_names",
     "!has(self.lora) || !has(self.lora.adapters) "
     "|| self.lora.adapters.all(a, self.lora.adapters.exists_one(b, b.name == a.name))",
     "spec.lora.adapters names must be unique; rename or remove the duplicate", ".lora.adapters"),
    ("lora_adapter_credentials",
     "!has(self.lora) || !has(self.lora.adapters) || self.lora.adapters.all(a, !has(a.credentialsSecret) "
     "|| a.source.startsWith('hf://') || a.source.startsWith('s3://'))",
     "spec.lora.adapters[].credentialsSecret is only used by hf:// and s3:// sources; remove it", ".lora.adapters"),
    ("lora_cpu_loras",
     "!has(self.lora) || !has(self.lora.maxCpuLoras) || self.lora.maxCpuLoras >= self.lora.maxLoras",
     "spec.lora.maxCpuLoras must be at least maxLoras; raise maxCpuLoras or lower maxLoras", ".lora.maxCpuLoras"),
    ("lora_memory",
     f"!has(self.lora) || self.lora.maxLoras * self.lora.maxLoraRank <= {_budget_cel()}",
     f"spec.lora.maxLoras x maxLoraRank must fit the GPU's memory ({RANK_SLOTS_PER_GIB} rank slots per GiB, "
     f"{CPU_RANK_SLOTS} on cpu; docs/lora.md); lower maxLoras or maxLoraRank", ".lora.maxLoras"),
)

# Root-level rules (self is the LLMEngine): the served name is metadata.name, which spec rules cannot see.
LORA_ROOT_RULES: tuple[tuple[str, str, str, str], ...] = (
    ("lora_served_name",
     "!has(self.spec.lora) || !has(self.spec.lora.adapters) "
     "|| self.spec.lora.adapters.all(a, a.name != self.metadata.name)",
     "spec.lora.adapters[].name must not be the LLMEngine's name (the base model's served name); rename the "
     "adapter", ".spec.lora.adapters"),
)


def lora_problems(lora: LoraOptions | None, gpu: str) -> list[str]:
    """The Python twins of :data:`LORA_RULES`, one ``<field path>: <what + fix>`` line each."""
    if lora is None:
        return []
    problems = []
    names = [a.name for a in lora.adapters]
    if dupes := sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"lora.adapters: names must be unique ({', '.join(dupes)} repeated); rename or remove the "
                        "duplicate")
    for i, adapter in enumerate(lora.adapters):
        for line in scheme_problems(adapter.model_source, f"lora.adapters[{i}]"):  # the CEL rules' field path first
            problems.append(f"lora.adapters: {line.removeprefix('lora.')}")
    if lora.max_cpu_loras is not None and lora.max_cpu_loras < lora.max_loras:
        problems.append(f"lora.maxCpuLoras: must be at least maxLoras ({lora.max_cpu_loras} < {lora.max_loras}); "
                        "raise maxCpuLoras or lower maxLoras")
    budget = rank_slot_budget(gpu)
    if lora.max_loras * lora.max_lora_rank > budget:
        problems.append(f"lora.maxLoras: maxLoras x maxLoraRank ({lora.max_loras} x {lora.max_lora_rank} = "
                        f"{lora.max_loras * lora.max_lora_rank}) must be at most {budget} on {gpu} (docs/lora.md); "
                        "lower maxLoras or maxLoraRank")
    return problems


def served_name_problems(lora: LoraOptions | None, engine_name: str) -> list[str]:
    """The Python twin of :data:`LORA_ROOT_RULES` (field paths from the object's root)."""
    if lora is None:
        return []
    return [f"spec.lora.adapters: adapters[{i}].name {a.name!r} is the LLMEngine's name, the base model's served "
            "name; rename the adapter" for i, a in enumerate(lora.adapters) if a.name == engine_name]
