"""``kiln bench``'s options as one settings object, declared once.

Each field of :class:`BenchOptions` is one ``kiln bench`` option: :func:`option` gives its flag and click's
keywords (type, default, help), and :func:`click_options` makes the command's options from the fields in their
order, as ``kiln serve``'s engine flags come from ``EngineConfig``'s fields (kiln.engine.settings), so no option
is spelled twice. The click options fill the object once and every mode reads it: a mode's function takes the
settings and what was resolved from them, not thirty parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import click
from kiln_bench.suite import ISA_CAPS, SYSTEMS


def option(*decls: str, **click_kwargs: Any) -> Any:
    """A field of BenchOptions that is the option ``decls`` (its flags; the field's name is click's name for
    it), with click's keywords; the field's default is the option's (``False`` for a flag)."""
    default = click_kwargs.get("default", False if click_kwargs.get("is_flag") else None)
    return field(default=default, metadata={"decls": decls, "click": click_kwargs})


@dataclass
class BenchOptions:
    """One field per ``kiln bench`` option, named as click names it (``--json`` is ``json_out``)."""

    num_requests: int | None = option("--num-requests", type=int, default=None,
        help="Requests in the workload [default: 64; --quick: 6].")
    seed: int = option("--seed", type=int, default=0, show_default=True, help="Workload seed.")
    arrival_rate: float | None = option("--arrival-rate", type=float, default=None,
        help="Poisson arrivals at this many requests/s [default: all arrive at t=0].")
    shared_prefix: int = option("--shared-prefix", type=int, default=0, show_default=True,
        help="Tokens of one shared prefix in front of every prompt (prefix-cache variant).")
    preset: str | None = option("--preset", default=None,
        help="toy model preset [default: llama-bench; on CUDA llama-1b; --quick: llama-tiny].")
    model_dir: Path | None = option("--model-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
        help="A checkpoint directory to benchmark (any: config.json + *.safetensors), or where the --preset "
        "toy model is written [default: ~/.cache/kiln/bench-models/<preset>-...].")
    dtype: str = option("--dtype", type=click.Choice(["bfloat16", "float32", "float16"]), default="bfloat16",
        show_default=True)
    threads: int | None = option("--threads", type=int, default=None,
        help="torch threads for every system [default: torch's].")
    device: str = option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
        help="Where every system runs; auto = cuda when available (kiln then uses CUDA graphs).")
    repeats: int = option("--repeats", type=int, default=1, show_default=True,
        help="Run every system N times round-robin; the table shows medians.")
    systems: str = option("--systems", default=",".join(SYSTEMS), show_default=True,
        help="Comma-separated systems to run; also kiln-pp2 / kiln-pp2-nomb: two pipeline stages "
        "in two processes with / without micro-batches in flight (--threads each); kiln-batch-invariant: kiln "
        "with batch_invariant (one kernel per linear at every row count).")
    baselines: str = option("--baselines", default="",
        help="Comma-separated peer engines to add as systems, each in its own "
        "environment under .kiln-work/baselines (created on first use): openvino (OpenVINO GenAI "
        "ContinuousBatchingPipeline), vllm (vLLM's CPU backend); llamacpp (llama.cpp, with --gguf). Not "
        "part of make test.")
    max_batch_size: int = option("--max-batch-size", type=int, default=64, show_default=True,
        help="kiln max_batch_size and transformers' max_requests_per_batch.")
    max_num_tokens: int = option("--max-num-tokens", type=int, default=2048, show_default=True,
        help="Tokens per forward step, kiln and transformers' continuous batching alike.")
    check_requests: int | None = option("--check-requests", type=int, default=None,
        help="Requests in the float32 greedy equality check (0 skips it) [default: 8; --quick: 4].")
    max_isa: str | None = option("--max-isa", type=click.Choice(sorted(ISA_CAPS)), default=None,
        help="Keep every system (and the ceiling) at or below this x86 ISA, as a host without AVX-512 "
        "would run them: oneDNN, ATen, MKL and kiln's kernels are capped; OpenVINO's own kernels "
        "are not (its release wheels ignore OV_CPU_MAX_ISA). An emulation, not that host.")
    json_out: str | None = option("--json", default=None,
        help="Write the full results as JSON to this file ('-': stdout).")
    quick: bool = option("--quick", is_flag=True,
        help="A small run on a tiny model, for smoke tests (seconds, not minutes).")
    strict: bool = option("--strict", is_flag=True, help="Exit 1 if the equality check fails.")
    structured: bool = option("--structured", is_flag=True,
        help="Instead of the suite: kiln's throughput on one batch (--num-requests, default 32) with half of "
        "it JSON-schema constrained against the same batch free, interleaved --repeats times.")
    lora: int | None = option("--lora", type=click.IntRange(1, 16), default=None,
        help="Instead of the suite: greedy throughput at batch 1/4/16 with requests spread over N LoRA "
        "adapters (rank 16, every projection) against all on the base, interleaved --repeats times.")
    gguf: Path | None = option("--gguf", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
        help="Instead of the suite: kiln against llama.cpp (--baselines llamacpp, the default here) on this GGUF "
        "file: kiln builds it as a quantization: gguf engine; one request at one thread (decode tok/s) and "
        "the largest --concurrency over HTTP (kiln serve vs llama_cpp.server), --repeats interleaved "
        "rounds. llama.cpp's environment (.kiln-work/llamacpp-venv) compiles on first use: minutes.")
    server: bool = option("--server", is_flag=True,
        help="Instead of the suite: kiln serve against vLLM's OpenAI server (--baselines vllm), both driven "
        "over HTTP by NVIDIA's aiperf with the same seeded synthetic prompts, --repeats interleaved runs.")
    concurrency: str = option("--concurrency", default="1,4,16", show_default=True,
        help="--server: concurrent requests swept.")
    isl: int = option("--isl", type=click.IntRange(min=1), default=128, show_default=True,
        help="--server: prompt tokens.")
    osl: int = option("--osl", type=click.IntRange(min=1), default=64, show_default=True,
        help="--server: output tokens.")
    endpoints: str = option("--endpoints", default="completions", show_default=True,
        help="--server: the kiln endpoints aiperf drives, among completions, chat, messages (Anthropic's) and "
        "responses (OpenAI's), each a system of the table; with several, all run greedy (temperature 0, "
        "no ignore_eos) and the table gives each one's throughput over the first's (translation overhead).")
    speculative: bool = option("--speculative", is_flag=True,
        help="Instead of the suite: kiln greedy with prompt-lookup speculation (on with the load rule, and "
        "always on) against without, at batch 1 and 32, on rewrite-this-text prompts, --repeats rotated "
        "runs (docs/speculative.md).")
    profile: bool = option("--profile", is_flag=True,
        help="Instead of the suite: where a decode step and a prefill chunk of kiln's go, at batch 1, 16 and 64 "
        "(GEMMs, attention, norms / RoPE / activations, sampling, scheduling, output processing; the kernels' and "
        "the engine's opt-in timers), means over --repeats rounds, as a table (and --json).")
    pool: bool = option("--pool", is_flag=True,
        help="Instead of the suite: an engine pool of four engines with memory for two (SmolLM2 GGUF and float32, "
        "two random-weight models; --quick: four tiny ones) under a seeded skewed workload at the largest "
        "--concurrency, against one kiln serve per engine and (not --quick) llama.cpp's multi-model server: "
        "greedy equality, sampled RSS against the budget, loads/evictions, cold load, throughput (docs/pools.md).")
    batch_invariant: bool = option("--batch-invariant", is_flag=True,
        help="--pool: every kiln server (the pool and each one per engine) runs with --batch-invariant, so the "
        "workload's answers are compared on kernels that do not depend on the batch (docs/tactics.md).")
    draft_model: Path | None = option("--draft-model", type=click.Path(file_okay=False, exists=True, path_type=Path),
        default=None,
        help="--speculative: drafts from this checkpoint (same tokenizer) instead of prompt lookup.")
    draft_layers: int | None = option("--draft-layers", type=click.IntRange(min=1), default=None,
        help="--speculative: drafts from the model's own first N layers under its head (an untrained "
        "early exit) instead of prompt lookup.")
    pair_scale: float | None = option("--pair-scale", type=click.FloatRange(min=0, min_open=True), default=None,
        help="--draft-layers on a random-weight model: benchmark a copy whose layers past N add this times "
        "their output to the residual stream, so the N-layer draft agrees with it as a trained "
        "same-family draft would (smaller: more agreement).")

    @property
    def peer_names(self) -> list[str]:
        return [b.strip() for b in self.baselines.split(",") if b.strip()]

    @property
    def json_file(self) -> Path | None:
        """Where ``--json`` writes a file (None for stdout, ``-``, or no JSON)."""
        return Path(self.json_out) if self.json_out and self.json_out != "-" else None


def click_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``command`` with one click option per field of BenchOptions, in the fields' order."""
    for f in reversed(fields(BenchOptions)):
        command = click.option(*f.metadata["decls"], f.name, **f.metadata["click"])(command)
    return command
