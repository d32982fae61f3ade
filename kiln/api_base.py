"""The base of every ``LLMEngine`` API type: camelCase in YAML, snake_case in Python, and the
Kubernetes name patterns its fields share (:mod:`kiln.manifest` words its messages by them)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"  # Service names: a letter first
MAX_POOL_NAME = 63 - len("-pool")  # an LLMEnginePool's name: <pool>-pool names its Deployment and Service
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


class APIModel(BaseModel):
    """camelCase in YAML, snake_case in Python, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel, validate_by_name=True, validate_by_alias=True, extra="forbid",
    )

    def to_k8s(self) -> dict[str, Any]:
        """The camelCase dict the API server stores (None fields left out)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)
