"""A request's adapter, as vLLM names it: ``LoRARequest(lora_name, lora_int_id, lora_path)``. No torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs under. ``lora_name`` is its identity (served as ``model`` and mixed into
    the prefix-cache keys); ``lora_path`` a PEFT adapter directory; ``lora_int_id`` is kept for vLLM's
    signature (kiln numbers each load itself); ``base_model_name`` what ``/v1/models`` lists as parent."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path must be a non-empty path to a PEFT adapter directory")
