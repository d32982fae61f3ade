"""EngineConfig: the engine's limits, resolved from the model's config.json and LLM(...) kwargs.

Every check names the keyword argument to change, so a bad setting fails at
construction with a message instead of a traceback deep in a step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.engine.errors import ConfigError

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = (None, "int8", "fp8")
# "auto": the Triton paged kernels on CUDA when triton is installed, else the torch path (docs/gpu.md).
ATTENTION_BACKENDS = ("auto", "torch", "triton", "native")


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"model directory {model_dir} has no config.json")
    return json.loads(path.read_text())


def max_model_len(hf_config: dict[str, Any]) -> int:
    """Positions the model supports (``rope_config.max_positions``: the builder's check uses it too)."""
    from kiln.engine.rope_config import max_positions

    return max_positions(hf_config)


def resolve_attention_backend(backend: str, device: str, dtype: Any = None, kv_dtype: Any = None) -> str | None:
    """What ``attention_backend=backend`` runs on ``device``, or None if it cannot run there: "auto" is
    Triton on CUDA when triton is installed; on CPU kiln's compiled kernels ("native",
    ``kernels/native.py``) when they load on this host for these dtypes, else torch. Triton on CPU
    only under its interpreter."""
    import importlib.util
    import os

    if backend in ("auto", "native") and device == "cpu":
        from kiln.engine.kernels import native

        ok = native.supports(dtype, kv_dtype) and native.kernels() is not None
        return "native" if ok else ("torch" if backend == "auto" else None)
    if backend == "native":
        return None
    has_triton = importlib.util.find_spec("triton") is not None
    if backend == "auto":
        return "triton" if device == "cuda" and has_triton else "torch"
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if backend == "triton" and (not has_triton or (device != "cuda" and not interpreted)):
        return None
    return backend


@dataclass
class EngineConfig:
    """``LLM(...)`` keyword arguments, resolved and checked.

    ``max_seq_len`` defaults to the model's positions, ``max_input_len`` to ``max_seq_len - 1``.
    ``num_kv_blocks=None`` sizes the pool from ``kv_memory_fraction`` of the memory free after the
    weights load (RAM on CPU), capped at what ``max_batch_size`` full-length requests could use.
    ``max_num_tokens`` is the per-step token budget (chunked prefill); ``enforce_eager`` turns off
    CUDA graphs; ``pipeline_parallel_size`` splits the layers into stages (rank layout in
    ``parallel.py``) and ``num_micro_batches`` splits each step's batch so the stages overlap;
    ``distributed_address``/``rank_offset``/``local_ranks`` place ranks started separately
    (docs/multi-node.md); ``weights_dir`` is set by ``from_artifact`` (per-rank engine weights);
    ``attention_backend`` picks the attention implementation and is resolved here ("auto" becomes
    "triton", "native" or "torch"; ``resolve_attention_backend``).
    """

    model: str
    dtype: str = "float32"
    max_batch_size: int = 64
    max_num_tokens: int = 2048
    max_seq_len: int | None = None
    max_input_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_memory_fraction: float = 0.9
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    num_micro_batches: int | None = None  # per step with pipeline parallelism; None = pipeline_parallel_size
    micro_batch_min_tokens: int = 64  # a step splits only into micro-batches of at least this many tokens
    # Ranks started separately (LeaderWorkerSet pods, `kiln serve --rank`): rank 0's HOST:PORT, and which
    # consecutive ranks this process hosts. None = every rank spawned here (one machine).
    distributed_address: str | None = None
    rank_offset: int = 0
    local_ranks: int | None = None  # None: every rank without distributed_address, else 1
    distributed_timeout_s: float = 120.0  # most any collective waits for another rank
    join_timeout_s: float = 600.0  # most a rank waits for the others to join at start
    heartbeat_interval_s: float | None = None  # rank 0 pings idle ranks this often; None = timeout / 8
    device: str | None = None
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    seed: int = 0
    cuda_graph_batch_sizes: list[int] | None = None
    enforce_eager: bool = False
    attention_backend: str = "auto"
    weights_dir: str | None = None  # per-rank engine weights (artifact); None = load the HF checkpoint
    compile: str = "off"  # "inductor": the CPU forward pass as one compiled graph (engine/compile.py)
    compile_cache: str | None = None  # the artifact's shipped Inductor cache dir, used for compiling
    # How an artifact was adapted to this CPU at load (kiln.engine.cpu_target.plan_cpu_load); None otherwise.
    cpu_target: dict[str, Any] | None = field(default=None, repr=False)
    # Where a CPU engine's tactic table comes from (kiln.engine.tactics.resolve): "auto", a tactics.json, or a
    # candidate name; a table re-timed on another kind of host is cached in tactics_cache.
    tactics: str = "auto"
    tactics_cache: str | None = None
    tactics_info: dict[str, Any] | None = field(default=None, repr=False)  # set at load: where the table came from
    # Speculative decoding (spec_decode.config.SpeculativeConfig or a dict of its fields, vLLM's names); None = off.
    speculative_config: Any = None
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        import torch

        if not self.hf_config:
            self.hf_config = read_hf_config(Path(self.model))
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        model_max = max_model_len(self.hf_config)
        if self.max_seq_len is None:
            self.max_seq_len = model_max
        if self.max_input_len is None:
            self.max_input_len = self.max_seq_len - 1
        if self.quantization in ("none", ""):
            self.quantization = None
        if self.num_micro_batches is None:
            self.num_micro_batches = self.pipeline_parallel_size
        if self.local_ranks is None:
            self.local_ranks = self.world_size if self.distributed_address is None else 1
        if self.heartbeat_interval_s is None:
            self.heartbeat_interval_s = min(5.0, self.distributed_timeout_s / 8)
        checks = [
            ("dtype", self.dtype in DTYPES, f"must be one of {', '.join(DTYPES)}"),
            ("quantization", self.quantization in QUANTIZATIONS, "must be None, 'int8' or 'fp8'"),
            ("kv_cache_dtype", self.kv_cache_dtype in ("auto", *DTYPES), f"must be 'auto' or one of {', '.join(DTYPES)}"),
            ("device", self.device in ("cpu", "cuda"), "must be 'cpu' or 'cuda'"),
            ("device", self.device != "cuda" or torch.cuda.is_available(), "is 'cuda' but no CUDA device is visible"),
            ("attention_backend", self.attention_backend in ATTENTION_BACKENDS,
             f"must be one of {', '.join(ATTENTION_BACKENDS)}"),
            ("max_batch_size", self.max_batch_size >= 1, "must be >= 1"),
            ("max_num_tokens", self.max_num_tokens >= self.max_batch_size,
             f"must be >= max_batch_size ({self.max_batch_size}) so every running request can decode each step"),
            ("max_seq_len", 2 <= self.max_seq_len <= model_max,
             f"must be in [2, {model_max}] (the model's max_position_embeddings)"),
            ("max_input_len", 1 <= self.max_input_len < self.max_seq_len,
             f"must be >= 1 and < max_seq_len ({self.max_seq_len})"),
            ("block_size", self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
             "must be a power of two"),
            ("num_kv_blocks", self.num_kv_blocks is None or self.num_kv_blocks >= 1, "must be >= 1"),
            ("kv_memory_fraction", 0 < self.kv_memory_fraction <= 1, "must be in (0, 1]"),
            ("tensor_parallel_size", self.tensor_parallel_size in (1, 2, 4, 8), "must be 1, 2, 4 or 8"),
            ("pipeline_parallel_size", self.pipeline_parallel_size in (1, 2, 4, 8), "must be 1, 2, 4 or 8"),
            ("num_micro_batches", isinstance(self.num_micro_batches, int) and 1 <= self.num_micro_batches <= 64,
             "must be in [1, 64] (1 = no micro-batching)"),
            ("micro_batch_min_tokens", self.micro_batch_min_tokens >= 1, "must be >= 1"),
            ("distributed_timeout_s", self.distributed_timeout_s > 0, "must be > 0 seconds"),
            ("join_timeout_s", self.join_timeout_s > 0, "must be > 0 seconds"),
            ("heartbeat_interval_s", 0 < self.heartbeat_interval_s < self.distributed_timeout_s,
             f"must be > 0 and below distributed_timeout_s ({self.distributed_timeout_s})"),
        ]
        from kiln.engine.tactics.candidates import LINEAR

        checks.append(("tactics", self.tactics in ("auto", *LINEAR) or Path(self.tactics).is_file(),
                       f"must be 'auto', a candidate ({', '.join(LINEAR)}) or a tactics.json file"))
        for name, ok, rule in checks:
            if not ok:
                raise ConfigError(f"{name} {rule}, got {getattr(self, name)!r}")
        self._check_placement()
        from kiln.engine.spec_decode.config import SpeculativeConfig

        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        from kiln.engine.compile import check_compile

        why = check_compile(self.compile, self.device, self.world_size)
        if why:
            raise ConfigError(why)
        backend = resolve_attention_backend(self.attention_backend, self.device, self.torch_dtype, self.kv_torch_dtype)
        if backend is None and self.attention_backend == "native":
            raise ConfigError("attention_backend 'native' (kiln's CPU kernels) needs the CPU device, float32 or "
                              "bfloat16 weights and KV cache of the same dtype, and a C compiler or an artifact "
                              "that ships the kernels for this CPU (the log says which is missing): use 'auto' "
                              "or 'torch'")
        if backend is None:
            raise ConfigError("attention_backend 'triton' needs the triton package (pip install 'kiln[gpu]') and a "
                              "CUDA device, or on CPU Triton's interpreter (TRITON_INTERPRET=1, for tests): "
                              "use 'auto' or 'torch'")
        self.attention_backend = backend
        if self.device == "cuda" and torch.cuda.device_count() < self.local_ranks:
            raise ConfigError(f"this process hosts {self.local_ranks} rank(s) (tensor_parallel_size "
                              f"{self.tensor_parallel_size} x pipeline_parallel_size {self.pipeline_parallel_size}"
                              f"{', local_ranks' if self.distributed_address else ''}) and needs as many GPUs; "
                              f"{torch.cuda.device_count()} visible")
        if self.pipeline_parallel_size > 1 and self.device == "cuda":
            self.enforce_eager = True  # CUDA graphs capture one whole-model decode step; stages run eager
        layers = int(self.hf_config.get("num_hidden_layers", 1))
        if self.pipeline_parallel_size > layers:
            raise ConfigError(f"pipeline_parallel_size {self.pipeline_parallel_size} exceeds the model's "
                              f"num_hidden_layers ({layers}); every stage needs at least one layer: "
                              f"set pipeline_parallel_size <= {layers}")
        window = self.hf_config.get("sliding_window")
        uses_window = self.hf_config.get("use_sliding_window", self.hf_config.get("model_type") == "mistral")
        if window and uses_window and self.max_seq_len > window:
            raise ConfigError(f"max_seq_len {self.max_seq_len} exceeds the model's sliding_window ({window}); kiln "
                              f"attends the full context, which equals the model only up to {window} tokens: "
                              f"set max_seq_len <= {window}")
        heads = self.hf_config.get("num_attention_heads", 1)
        kv_heads = self.hf_config.get("num_key_value_heads") or heads
        tp = self.tensor_parallel_size
        if heads % tp or kv_heads % tp:
            raise ConfigError(f"tensor_parallel_size {tp} must divide the model's attention heads ({heads}) "
                              f"and KV heads ({kv_heads})")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _check_placement(self) -> None:
        world = self.world_size
        if self.distributed_address is None:
            if self.rank_offset != 0 or self.local_ranks != world:
                raise ConfigError(f"rank_offset {self.rank_offset} / local_ranks {self.local_ranks} need "
                                  "distributed_address (rank 0's HOST:PORT); without it every rank is spawned here")
            return
        host, _, port = self.distributed_address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"distributed_address must be HOST:PORT (rank 0's rendezvous), "
                              f"got {self.distributed_address!r}")
        if not isinstance(self.local_ranks, int) or self.local_ranks < 1:
            raise ConfigError(f"local_ranks must be >= 1, got {self.local_ranks!r}")
        if not 0 <= self.rank_offset or self.rank_offset + self.local_ranks > world:
            raise ConfigError(f"ranks {self.rank_offset}..{self.rank_offset + self.local_ranks - 1} (rank_offset, "
                              f"local_ranks) do not fit the world of {world} ranks (tensor_parallel_size "
                              f"{self.tensor_parallel_size} x pipeline_parallel_size {self.pipeline_parallel_size}); "
                              f"give every process the same parallel sizes and a rank below {world}")

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    @property
    def kv_torch_dtype(self):
        import torch

        return getattr(torch, self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype)

    def eos_token_ids(self, tokenizer: Any = None) -> list[int]:
        """EOS ids from config.json, generation_config.json and the tokenizer, deduplicated."""
        ids: list[int] = []

        def add(v: Any) -> None:
            for x in v if isinstance(v, list) else [v]:
                if isinstance(x, int) and x not in ids:
                    ids.append(x)

        add(self.hf_config.get("eos_token_id"))
        gen = Path(self.model) / "generation_config.json"
        if gen.is_file():
            add(json.loads(gen.read_text()).get("eos_token_id"))
        if tokenizer is not None:
            add(getattr(tokenizer, "eos_token_id", None))
        return ids
