"""``LLMEngine.status``: what the operator reports (phase, conditions, versions, history, replicas)."""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any, Literal

from pydantic import ConfigDict, Field

from kiln.api_base import APIModel as _Model


class Phase(enum.StrEnum):
    PENDING = "Pending"
    BUILDING = "Building"
    DEPLOYING = "Deploying"
    READY = "Ready"
    FAILED = "Failed"


class Condition(_Model):
    type: str = Field(max_length=316, description="CamelCase condition type, e.g. Ready, Built.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str | None = Field(default=None, max_length=1024, description="CamelCase machine-readable reason.")
    message: str | None = Field(default=None, max_length=32768, description="Human-readable detail.")
    last_transition_time: datetime | None = Field(
        default=None, description="When status last changed (RFC 3339)."
    )
    observed_generation: int | None = Field(
        default=None, ge=0, description="metadata.generation the condition was computed for."
    )


class HistoryEntry(_Model):
    engine_version: str = Field(description="A built engine version.")
    artifact_uri: str = Field(alias="artifactURI", description="Where that version's artifact lives.")
    built_at: datetime | None = Field(default=None, description="When it was published (RFC 3339).")
    content_digest: str | None = Field(
        default=None, description="The manifest content digest the operator pinned for that version.")


HISTORY_LIMIT = 10


def add_to_history(history: list[dict[str, Any]], entry: dict[str, Any]) -> list[dict[str, Any]]:
    """``status.history`` (as stored: camelCase dicts) after ``entry`` was built or served: a new version
    goes first; a version already listed keeps its place (the list is ordered by build, and a GitOps
    revert rebuilds nothing) and takes ``entry``'s fields (a version removed from the store and rebuilt
    has a new pin); at most ``HISTORY_LIMIT`` entries."""
    if any(e.get("engineVersion") == entry.get("engineVersion") for e in history):
        return [{**e, **entry} if e.get("engineVersion") == entry.get("engineVersion") else e
                for e in history][:HISTORY_LIMIT]
    return [entry, *history][:HISTORY_LIMIT]


class ArtifactPin(_Model):
    """``status.artifact``: the build of ``engineVersion`` the operator serves, pinned by its content digest."""

    engine_version: str = Field(description="The engine version this pin is for (status.engineVersion).")
    content_digest: str | None = Field(
        default=None,
        description="The manifest content digest the operator recorded when the build finished (or when it "
        "first served a version it found in the store). Serving pods refuse any other; a store whose manifest "
        "later differs makes the engine ArtifactUntrusted. Absent while the version is being built.",
    )


class BuildStatus(_Model):
    """``status.build``: the build Jobs of ``engineVersion``, and whether another is due."""

    engine_version: str = Field(description="The engine version these attempts build.")
    attempts: int = Field(default=0, ge=0, description="Build Jobs run for this version, the current one included.")
    job_uid: str | None = Field(default=None, alias="jobUID", description="uid of the current attempt's Job.")
    failure: str | None = Field(
        default=None, description="Why the current attempt failed: StorageError (retried) or the builder's or "
        "the Job's reason.")
    message: str | None = Field(default=None, max_length=32768, description="The failure, as the Built condition says.")
    retry_at: datetime | None = Field(
        default=None, description="A storage error with attempts left: when the next build Job starts.")
    failed_generation: int | None = Field(
        default=None, ge=0, description="A failure that is not retried: the metadata.generation it failed at. No "
        "new build starts until the spec changes.")


class ReplicaStatus(_Model):
    """``status.replicas`` (scale out): the autoscaler writes desired, the Deployment controller the rest."""

    desired: int = Field(default=0, ge=0, description="Pods wanted now (the Deployment's spec.replicas).")
    current: int = Field(default=0, ge=0, description="Pods that exist, of any version.")
    ready: int = Field(default=0, ge=0, description="Pods that are Ready.")
    updated: int = Field(default=0, ge=0, description="Pods of the current template (the wanted version).")
    owner: str = Field(
        default="operator",
        description="Who sets desired: operator (spec.serving.replicas), ScaledObject/<name> (KEDA) or "
        "HorizontalPodAutoscaler/<name>.",
    )


class AdapterStatus(_Model):
    """One entry of ``status.adapters``: a LoRA adapter of ``spec.lora.adapters`` for ``status.engineVersion``."""

    name: str = Field(description="The adapter's name (spec.lora.adapters[].name).")
    phase: Literal["Building", "Ready", "Failed"] = Field(
        description="Building (its build Job runs), Ready (built and listed in the <engine>-adapters ConfigMap, "
        "which serving pods load without a restart) or Failed (message says why; the base keeps serving).")
    version: str | None = Field(default=None, description="The adapter's artifact version.")
    artifact_uri: str | None = Field(default=None, alias="artifactURI", description="Where that artifact lives.")
    job_name: str | None = Field(default=None, description="The adapter's build Job.")
    message: str | None = Field(default=None, max_length=4096, description="Why it failed; or, Ready in a pool "
                                "that does not serve it (its name clashes there), why (spec.serving.pool).")


PoolMemberState = Literal["Building", "Listed", "Refused"]  # an engine in its pool's status.engines


class PoolMembership(_Model):
    """``status.pool``: how the LLMEnginePool of ``spec.serving.pool`` lists this engine (docs/pools.md)."""

    name: str = Field(description="The LLMEnginePool (spec.serving.pool).")
    state: PoolMemberState | None = Field(
        default=None, description="The pool's entry for this engine (its status.engines): Building, Listed (in "
        "the engine list its pods follow) or Refused (message says why). Absent while the pool has no entry for "
        "it, or there is no such pool (the Ready condition says which).")
    message: str | None = Field(default=None, max_length=32768, description="The pool's message: why it is refused.")


class LLMEngineStatus(_Model):
    # The operator writes status, not users; keys another writer left (e.g. kopf's own
    # `status.kopf` on a cluster that kept it) must not make the object unreadable.
    model_config = ConfigDict(extra="ignore")

    phase: Phase | None = Field(default=None, description="Pending, Building, Deploying, Ready or Failed.")
    conditions: list[Condition] = Field(
        default_factory=list, description="Kubernetes-style conditions; Ready means the engine serves.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    engine_version: str | None = Field(default=None, description="Version the current spec builds to.")
    serving_version: str | None = Field(default=None, description="Version the ready pods serve.")
    artifact_uri: str | None = Field(
        default=None, alias="artifactURI", description="Artifact of engineVersion in the store."
    )
    endpoint: str | None = Field(default=None, description="In-cluster URL of the OpenAI-compatible API.")
    observed_generation: int | None = Field(
        default=None, ge=0, description="metadata.generation the status was computed for."
    )
    history: list[HistoryEntry] = Field(
        default_factory=list, max_length=HISTORY_LIMIT,
        description=f"Most recent built versions, newest first (at most {HISTORY_LIMIT}).",
    )

    artifact: ArtifactPin | None = Field(
        default=None, description="The build the operator pinned for engineVersion (docs/operator-trust.md).")
    build: BuildStatus | None = Field(default=None, description="Build attempts of engineVersion.")

    adapters: list[AdapterStatus] | None = Field(
        default=None, description="LoRA adapters of spec.lora, one entry each (docs/lora.md).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )

    pool: PoolMembership | None = Field(
        default=None, description="The engine pool that serves it (spec.serving.pool), once it is built.")

    # -- scale out (docs/scale-out.md) --
    replicas: ReplicaStatus | None = Field(
        default=None, description="Serving pods: what the replica count's owner wants against what runs.",
    )
