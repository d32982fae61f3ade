"""EngineConfig: the engine's settings, resolved from the model's config.json and LLM(...) kwargs.

``EngineConfig``'s fields are the one list of engine settings. Each field's metadata says what it is
(``help``), which values it takes (``choices``, ``min``/``max``), whether ``kiln serve`` offers it as a
flag (``flag``) and whether ``/version`` reports it (``reported``): the serve CLI and ``/version`` are
generated from that list, and the builder maps the ``LLMEngine`` spec onto these names in one table. A new
setting is a field here, a row in that table and the CRD field it comes from.

``__post_init__`` reads as three steps: fill defaults, validate (one table of rules, each naming the
keyword argument to change, so a bad setting fails at construction with a message instead of a
traceback deep in a step), then check that the features asked for can run here.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import Field, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from kiln.engine.compile import COMPILE_MODES, check_compile
from kiln.engine.errors import ConfigError
from kiln.engine.generation_config import FILE as GENERATION_FILE
from kiln.engine.generation_config import SOURCES, eos_token_ids
from kiln.engine.kernels import native
from kiln.engine.kernels.candidates import LINEAR, known
from kiln.engine.kernels.formats import BY_QUANTIZATION
from kiln.engine.lora.config import LoRAConfig
from kiln.engine.rope_config import max_positions
from kiln.engine.settings import field_rules, setting
from kiln.engine.spec_decode.config import SpeculativeConfig

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = tuple(BY_QUANTIZATION)  # the format table's (kernels/formats.py)
# "auto": the Triton paged kernels on CUDA when triton is installed, else the torch path (docs/gpu.md).
ATTENTION_BACKENDS = ("auto", "torch", "triton", "native")
PARALLEL_SIZES = (1, 2, 4, 8)
LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's --max-lora-rank choices


def canonical_quantization(value: str | None) -> str | None:
    """The one home of the "none" rule: the CRD and the serve flag spell no quantization "none"; the
    engine and ``engine.json`` spell it None."""
    return None if value in (None, "", "none") else value


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"model directory {model_dir} has no config.json")
    return json.loads(path.read_text())


def max_model_len(hf_config: dict[str, Any]) -> int:
    """Positions the model supports (``rope_config.max_positions``: the builder's check uses it too)."""
    return max_positions(hf_config)


def resolve_attention_backend(backend: str, device: str, dtype: Any = None, kv_dtype: Any = None) -> str | None:
    """What ``attention_backend=backend`` runs on ``device``, or None if it cannot run there: "auto" is
    Triton on CUDA when triton is installed; on CPU kiln's compiled kernels ("native",
    ``kernels/native.py``) when they load on this host for these dtypes, else torch. Triton on CPU
    only under its interpreter."""
    if backend in ("auto", "native") and device == "cpu":
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


def settings() -> tuple[Field, ...]:
    """EngineConfig's fields: the one list of engine settings (the serve CLI and /version read it)."""
    return fields(EngineConfig)


def reported_settings(config: EngineConfig) -> dict[str, Any]:
    """What ``/version`` reports of a loaded engine's settings."""
    return {f.name: getattr(config, f.name, None) for f in settings() if f.metadata.get("reported")}


@dataclass
class EngineConfig:
    """``LLM(...)`` keyword arguments, resolved and checked: every engine setting, each with its help.

    ``max_seq_len`` defaults to the model's positions, ``max_input_len`` to ``max_seq_len - 1``;
    ``num_kv_blocks=None`` sizes the pool from ``kv_memory_fraction`` of the memory free after the
    weights load (RAM on CPU), capped at what ``max_batch_size`` full-length requests could use; the rank
    layout of the parallel sizes is in ``parallel.py``; ``attention_backend`` "auto" becomes "triton",
    "native" or "torch" here (``resolve_attention_backend``).
    """

    model: str = setting(help="The model directory (a Hugging Face checkpoint or an artifact's copy).")
    dtype: str = setting("float32", help="Weights/activations dtype.", flag=True, reported=True, choices=DTYPES)
    max_batch_size: int = setting(64, help="Most requests in one engine step.", flag=True, reported=True, min=1)
    max_num_tokens: int = setting(2048, help="Token budget per step (chunked prefill).", flag=True,
                                  reported=True, min=1)
    max_seq_len: int | None = setting(None, help="Prompt + output limit per request.", flag=True, reported=True,
                                      min=2)
    max_input_len: int | None = setting(None, help="Prompt limit per request.", flag=True, reported=True, min=1)
    block_size: int = setting(16, help="KV-cache block size (power of two).", flag=True, reported=True, min=1)
    num_kv_blocks: int | None = setting(None, help="KV-cache pool size in blocks.", flag=True, min=1)
    kv_memory_fraction: float = setting(0.9, help="Fraction of free device memory for the KV pool.", flag=True,
                                        min=0, max=1, min_open=True)
    enable_prefix_caching: bool = setting(True, help="Reuse KV blocks of shared prompt prefixes.", flag=True,
                                          reported=True)
    tensor_parallel_size: int = setting(1, help="Tensor-parallel ranks.", flag=True, reported=True,
                                        choices=PARALLEL_SIZES)
    pipeline_parallel_size: int = setting(1, help="Pipeline stages (layers split across processes / nodes).",
                                          flag=True, reported=True, choices=PARALLEL_SIZES)
    num_micro_batches: int | None = setting(
        None, help="Micro-batches in flight per step with pipeline stages (default: the stage count; 1 = off).",
        flag=True, reported=True, min=1, max=64)
    micro_batch_min_tokens: int = setting(64, help="A step splits only into micro-batches of at least this "
                                                   "many tokens.", min=1)
    distributed_address: str | None = setting(
        None, help="Ranks started separately (LeaderWorkerSet pods, `kiln serve --rank`): rank 0's HOST:PORT; "
                   "None = every rank spawned here (one machine).")
    rank_offset: int = setting(0, help="The first of the consecutive ranks this process hosts.")
    local_ranks: int | None = setting(None, help="Ranks this process hosts (default: every rank without "
                                                 "distributed_address, else 1).")
    distributed_timeout_s: float = setting(
        120.0, help="Most seconds any rank waits on another once running (default 120) "
                    "[env KILN_DISTRIBUTED_TIMEOUT_SECONDS].",
        flag="--distributed-timeout", envvar="KILN_DISTRIBUTED_TIMEOUT_SECONDS", min=0, min_open=True)
    join_timeout_s: float = setting(
        600.0, help="Most seconds ranks wait for each other at start (default 600) [env KILN_JOIN_TIMEOUT_SECONDS].",
        flag="--join-timeout", envvar="KILN_JOIN_TIMEOUT_SECONDS", min=0, min_open=True)
    heartbeat_interval_s: float | None = setting(None, help="Rank 0 pings idle ranks this often (default: "
                                                            "distributed_timeout_s / 8, at most 5).")
    device: str | None = setting(None, help="Device (default: cuda when visible).", flag=True, reported=True,
                                 choices=("cpu", "cuda"))
    quantization: str | None = setting(None, help="Weight-only quantization.", flag=True, reported=True,
                                       choices=QUANTIZATIONS)
    kv_cache_dtype: str = setting("auto", help="KV-cache dtype.", flag=True, reported=True,
                                  choices=("auto", *DTYPES))
    seed: int = setting(0, help="Engine seed for requests without their own.", flag=True)
    cuda_graph_batch_sizes: list[int] | None = setting(None, help="Decode batch sizes captured as CUDA graphs "
                                                                  "(default: the engine's buckets).")
    enforce_eager: bool = setting(False, help="No CUDA graphs.")
    attention_backend: str = setting("auto", help="The attention implementation.", choices=ATTENTION_BACKENDS)
    weights_dir: str | None = setting(None, help="Per-rank engine weights (set by from_artifact); None = load "
                                                 "the HF checkpoint.")
    compile: str = setting("off", help="'inductor': the CPU forward pass as one compiled graph (engine/compile.py).",
                           choices=COMPILE_MODES)
    compile_cache: str | None = setting(None, help="The artifact's shipped Inductor cache dir, used for compiling.")
    cpu_target: dict[str, Any] | None = setting(
        None, repr=False, help="How an artifact was adapted to this CPU at load (cpu_target.plan_cpu_load).")
    tactics: str = setting("auto", flag=True, reported=True,
                           help="Where a CPU engine's tactic table comes from (tactics.resolve): 'auto', "
                                "a tactics.json or a candidate name (every linear runs it, untimed).")
    tactics_cache: str | None = setting(None, help="Where a table re-timed on another kind of host is cached.")
    tactics_exclude: list[str] | None = setting(
        None, flag=True, reported=True,
        help="Candidates the tactic table may not use: names, or 'w8a8' for every one that quantizes "
             "activations (a build sets it when its quality gate refuses W8A8 for the model).")
    lm_head_int8: str = setting(
        "auto", flag=True, reported=True, choices=("auto", "off"),
        help="An int8 CPU engine's LM head: 'auto' packs an int8 copy where a W8A8 candidate may run (the "
             "build's quality gate measured W8A8 so); 'off' keeps it in the engine's dtype (a build sets it "
             "when W8A8 passes the gate only with the head kept).")
    tactics_info: dict[str, Any] | None = setting(None, repr=False, help="Set at load: where the table came from.")
    batch_invariant: bool = setting(False, flag=True, reported=True, help="A CPU engine runs each linear on one "
                                    "kernel at every row count, so a greedy answer does not depend on its batch, "
                                    "chunks or a prefix-cache hit; slower where the table chose by rows "
                                    "(docs/tactics.md, Batch invariance).")
    tactics_background: bool = setting(False, flag=True, reported=True, help="Time this host's tactic table "
                                       "after load, serving on the default (kiln serve: on; $KILN_TACTICS_AT_LOAD).")
    thread_governor: bool = setting(False, flag=True, reported=True, help="A single-rank CPU engine re-chooses its "
                                    "compute threads from its own steps (engine/thread_governor.py; kiln serve: on; "
                                    "a pinned count turns it off).")
    speculative_config: Any = setting(
        None, flag=True, json=True,
        help="Speculative decoding as vLLM's flag, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' "
             "(docs/speculative.md).")
    enable_lora: bool = setting(False, help="Serve LoRA adapters, mixed with the base in one batch (docs/lora.md).",
                                flag=True, reported=True)
    max_loras: int = setting(1, help="LoRA adapters on the device at once (slots); a request whose adapter "
                                     "gets no slot waits.", flag=True, reported=True, min=1)
    max_lora_rank: int = setting(16, help="Largest LoRA rank served (slots are this wide).", flag=True,
                                 reported=True, choices=LORA_RANKS)
    max_cpu_loras: int | None = setting(None, help="LoRA adapters kept in host memory (LRU; default: max_loras).",
                                        flag=True, reported=True, min=1)
    generation_config: str = setting(
        "auto", flag=True, reported=True, envvar="KILN_GENERATION_CONFIG",
        help="Sampling defaults of requests that do not set their own (vLLM's flag): 'auto' the model's "
             "generation_config.json, 'vllm' none, or a folder with one (engine/generation_config.py).")
    hf_config: dict[str, Any] = setting(default_factory=dict, repr=False, help="The model's config.json.")

    def __post_init__(self) -> None:
        self._fill_defaults()
        self._validate()
        self._check_features()

    def _fill_defaults(self) -> None:
        if not self.hf_config:
            self.hf_config = read_hf_config(Path(self.model))
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.max_seq_len is None:
            self.max_seq_len = max_model_len(self.hf_config)
        if self.max_input_len is None:
            self.max_input_len = self.max_seq_len - 1
        self.quantization = canonical_quantization(self.quantization)
        if isinstance(self.tactics_exclude, str):  # the serve flag's spelling: "w8a8" or "a,b"
            self.tactics_exclude = self.tactics_exclude.replace(",", " ").split()
        if self.num_micro_batches is None:
            self.num_micro_batches = self.pipeline_parallel_size
        if self.local_ranks is None:
            self.local_ranks = self.world_size if self.distributed_address is None else 1
        if self.heartbeat_interval_s is None:
            self.heartbeat_interval_s = min(5.0, self.distributed_timeout_s / 8)
        if self.pipeline_parallel_size > 1 and self.device == "cuda":
            self.enforce_eager = True  # CUDA graphs capture one whole-model decode step; stages run eager

    def _validate(self) -> None:
        for ok, message in self._rules():
            if not ok:
                raise ConfigError(message)

    def _rules(self) -> Iterator[tuple[bool, str]]:
        """The check table: (holds, message naming the setting and the fix), in order; a row is read only
        once the rows above it hold, so each may rely on them."""
        for name, holds, rule in field_rules(self):
            yield holds(), f"{name} {rule}, got {getattr(self, name)!r}"

        def got(name: str, rule: str) -> str:
            return f"{name} {rule}, got {getattr(self, name)!r}"

        model_max, world = max_model_len(self.hf_config), self.world_size
        layers = int(self.hf_config.get("num_hidden_layers", 1))
        heads = self.hf_config.get("num_attention_heads", 1)
        kv_heads = self.hf_config.get("num_key_value_heads") or heads
        window = self.hf_config.get("sliding_window")
        uses_window = self.hf_config.get("use_sliding_window", self.hf_config.get("model_type") == "mistral")
        yield (self.device != "cuda" or torch.cuda.is_available(),
               got("device", "is 'cuda' but no CUDA device is visible"))
        yield (self.max_num_tokens >= self.max_batch_size,
               got("max_num_tokens", f"must be >= max_batch_size ({self.max_batch_size}) so every running "
                                     "request can decode each step"))
        yield (2 <= self.max_seq_len <= model_max,
               got("max_seq_len", f"must be in [2, {model_max}] (the model's max_position_embeddings)"))
        yield (1 <= self.max_input_len < self.max_seq_len,
               got("max_input_len", f"must be >= 1 and < max_seq_len ({self.max_seq_len})"))
        yield self.block_size & (self.block_size - 1) == 0, got("block_size", "must be a power of two")
        yield (0 < self.heartbeat_interval_s < self.distributed_timeout_s,
               got("heartbeat_interval_s", f"must be > 0 and below distributed_timeout_s "
                                           f"({self.distributed_timeout_s})"))
        yield (self.tactics in ("auto", *LINEAR) or Path(self.tactics).is_file(),
               got("tactics", f"must be 'auto', a candidate ({', '.join(LINEAR)}) or a tactics.json file"))
        yield (self.generation_config in SOURCES or (Path(self.generation_config) / GENERATION_FILE).is_file(),
               got("generation_config", "must be 'auto', 'vllm' or a folder with a generation_config.json"))
        yield (not self.batch_invariant or self.device == "cpu",
               got("batch_invariant", "is for CPU engines (kiln's tactic table); a CUDA engine has no such mode "
                                      "yet: set batch_invariant false"))
        yield (known(self.tactics_exclude),
               got("tactics_exclude", f"must list candidates ({', '.join(LINEAR)}) or 'w8a8'"))
        yield (self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
               got("max_cpu_loras", f"must be >= max_loras ({self.max_loras})"))
        yield (not self.enable_lora or self.compile == "off",
               got("compile", "must be 'off' with enable_lora (a compiled graph has no adapter slots)"))
        yield from self._placement_rules(world)
        yield (self.device != "cuda" or torch.cuda.device_count() >= self.local_ranks,
               f"this process hosts {self.local_ranks} rank(s) (tensor_parallel_size {self.tensor_parallel_size} "
               f"x pipeline_parallel_size {self.pipeline_parallel_size}"
               f"{', local_ranks' if self.distributed_address else ''}) and needs as many GPUs; "
               f"{torch.cuda.device_count() if self.device == 'cuda' else 0} visible")
        yield (self.pipeline_parallel_size <= layers,
               f"pipeline_parallel_size {self.pipeline_parallel_size} exceeds the model's num_hidden_layers "
               f"({layers}); every stage needs at least one layer: set pipeline_parallel_size <= {layers}")
        yield (not (window and uses_window and self.max_seq_len > window),
               f"max_seq_len {self.max_seq_len} exceeds the model's sliding_window ({window}); kiln attends the "
               f"full context, which equals the model only up to {window} tokens: set max_seq_len <= {window}")
        yield (not (heads % self.tensor_parallel_size or kv_heads % self.tensor_parallel_size),
               f"tensor_parallel_size {self.tensor_parallel_size} must divide the model's attention heads "
               f"({heads}) and KV heads ({kv_heads})")

    def _placement_rules(self, world: int) -> Iterator[tuple[bool, str]]:
        """Where this process's ranks sit in the world (docs/multi-node.md)."""
        sizes = (f"tensor_parallel_size {self.tensor_parallel_size} x pipeline_parallel_size "
                 f"{self.pipeline_parallel_size}")
        if self.distributed_address is None:
            yield (self.rank_offset == 0 and self.local_ranks == world,
                   f"rank_offset {self.rank_offset} / local_ranks {self.local_ranks} need distributed_address "
                   "(rank 0's HOST:PORT); without it every rank is spawned here")
            return
        host, _, port = self.distributed_address.rpartition(":")
        yield (bool(host) and port.isdigit() and 0 < int(port) < 65536,
               f"distributed_address must be HOST:PORT (rank 0's rendezvous), got {self.distributed_address!r}")
        yield (isinstance(self.local_ranks, int) and self.local_ranks >= 1,
               f"local_ranks must be >= 1, got {self.local_ranks!r}")
        yield (0 <= self.rank_offset and self.rank_offset + self.local_ranks <= world,
               f"ranks {self.rank_offset}..{self.rank_offset + self.local_ranks - 1} (rank_offset, local_ranks) do "
               f"not fit the world of {world} ranks ({sizes}); give every process the same parallel sizes and "
               f"a rank below {world}")

    def _check_features(self) -> None:
        """Can what was asked for run here: speculation, compiling, the attention backend."""
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
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

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def torch_dtype(self):
        return getattr(torch, self.dtype)

    @property
    def lora_config(self) -> LoRAConfig | None:
        """The LoRA view (``lora/config.py``), its defaults resolved here, once; None without enable_lora."""
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras or self.max_loras,
                          self.torch_dtype) if self.enable_lora else None

    @property
    def kv_torch_dtype(self):
        return getattr(torch, self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype)

    def eos_token_ids(self, tokenizer: Any = None) -> list[int]:
        """EOS ids from config.json, generation_config.json and the tokenizer (generation_config.eos_token_ids)."""
        return eos_token_ids(self, tokenizer)
