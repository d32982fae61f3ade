"""The server's settings, as resolved from ``kiln serve`` flags and the environment."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class ServeConfig:
    model: Path | None = None  # a Hugging Face checkpoint directory ...
    artifact: str | None = None  # ... or an engine artifact URI (<store>/engines/<version>)
    cache_dir: Path | None = None  # where artifacts are fetched to
    verify_key: Path | None = None  # the public key an artifact's manifest must be signed by (kiln.signing)
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = field(default=None, repr=False)  # never printed, never logged
    max_queue_len: int = 256
    drain_timeout: float = 30.0
    engine_kwargs: dict[str, Any] = field(
        default_factory=dict
    )  # LLM(...) overrides: dtype, max_batch_size ...
    log_level: str = "info"
    access_log: bool = False
    # HTTP limits (docs/serving-limits.md): open connections, and how long a client may take
    # to send its request headers and its body.
    max_connections: int = 1024
    header_read_timeout: float = 10.0
    body_read_timeout: float = 30.0
    # Ranks started separately (kiln.serving.ranks.Placement): --rank/--world-size/--leader-address or a
    # LeaderWorkerSet's environment; None = every rank of the engine runs on this machine.
    placement: Any = None
    # LoRA (docs/lora.md): adapters served from the start ({"name", "path", "base_model_name"}), and whether
    # /v1/load_lora_adapter and /v1/unload_lora_adapter exist.
    lora_modules: list[dict[str, Any]] = field(default_factory=list)
    allow_runtime_lora_updating: bool = False
    # Thinking kept apart from the answer (kiln.serving.reasoning: deepseek_r1, qwen3), None: off; and the
    # Responses API's stored responses (kiln.serving.responses_store): how many, and for how long.
    reasoning_parser: str | None = None
    responses_store_size: int = 1000
    responses_store_ttl: float = 3600.0
    # Chat template variables every chat request gets under its own chat_template_kwargs (kiln.serving.chat).
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        """The name clients put in ``model``: the flag, else the artifact version, else the folder name."""
        if self.served_model_name:
            return self.served_model_name
        if self.artifact:
            return self.artifact.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]
        assert self.model is not None
        return Path(self.model).name
