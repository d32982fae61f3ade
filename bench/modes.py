"""The modes ``kiln bench`` runs instead of its suite (``--structured``, ``--lora``, ``--speculative``,
``--gguf``, ``--server``): each checks its own options, runs its module and prints its document."""

from __future__ import annotations

import json
from pathlib import Path

import click
from kiln_bench.options import BenchOptions


def log(msg: str) -> None:
    click.echo(msg, err=True)


def emit(doc: dict, text, opts: BenchOptions) -> None:
    """A mode's document: JSON on stdout for ``--json -``, else its text, and the JSON file if asked."""
    click.echo(json.dumps(doc, indent=2) if opts.json_out == "-" else text(doc))
    if opts.json_file:
        opts.json_file.write_text(json.dumps(doc, indent=2))


def structured(opts: BenchOptions, model_dir: Path) -> None:
    from kiln_bench.structured import run as run_structured
    from kiln_bench.structured import text as structured_text

    doc = run_structured(model_dir, opts.dtype, opts.threads, opts.device, batch=opts.num_requests or 32,
                         max_tokens=16 if opts.quick else 128, repeats=opts.repeats, log=log)
    emit(doc, structured_text, opts)


def lora(opts: BenchOptions, model_dir: Path) -> None:
    import tempfile

    from kiln_bench.lora import run as run_lora
    from kiln_bench.lora import text as lora_text

    with tempfile.TemporaryDirectory(prefix="kiln-bench-lora-") as work:
        doc = run_lora(model_dir, opts.dtype, opts.threads, opts.device, opts.lora, Path(work),
                       max_tokens=8 if opts.quick else 64, repeats=opts.repeats, log=log)
    emit(doc, lora_text, opts)


def speculative(opts: BenchOptions, model_dir: Path) -> None:
    from kiln_bench.speculative import damped_pair, draft_for
    from kiln_bench.speculative import main as run_speculative

    if opts.draft_model is not None and opts.draft_layers is not None:
        raise click.UsageError("--draft-model and --draft-layers each name the draft; give one")
    if opts.pair_scale is not None and opts.draft_layers is None:
        raise click.UsageError("--pair-scale goes with --draft-layers (the draft's layers)")
    try:
        if opts.pair_scale is not None:
            model_dir, draft_dir = damped_pair(model_dir, opts.draft_layers, opts.pair_scale)
        else:
            draft_dir = draft_for(model_dir, opts.draft_model, opts.draft_layers)
    except ValueError as exc:
        raise click.UsageError(f"--draft-layers: {exc}") from None
    run_speculative(model_dir, opts.dtype, opts.threads, opts.device, opts.quick, opts.repeats, opts.json_out,
                    click.echo, log, draft_dir)


def gguf(opts: BenchOptions, peer_names: list[str]) -> None:
    gguf, concurrency, repeats, json_out = opts.gguf, opts.concurrency, opts.repeats, opts.json_out
    from kiln_bench import llamacpp

    if gguf is None:
        raise click.UsageError("--baselines llamacpp runs on a GGUF file: give --gguf FILE")
    if set(peer_names) - {"llamacpp"}:
        raise click.UsageError(f"--gguf compares with llama.cpp only (--baselines llamacpp), not "
                               f"{', '.join(sorted(set(peer_names) - {'llamacpp'}))}")
    try:
        levels = [int(c) for c in concurrency.split(",") if c.strip()]
    except ValueError:
        raise click.UsageError(f"--concurrency: comma-separated integers, got {concurrency!r}") from None
    doc = llamacpp.compare(gguf, max(levels or [16]), 64, repeats, lambda m: click.echo(m, err=True))
    click.echo(json.dumps(doc, indent=2) if json_out == "-" else llamacpp.text(doc))
    if json_out and json_out != "-":
        Path(json_out).write_text(json.dumps(doc, indent=2))


def server(opts: BenchOptions, model_dir: Path, peer_names: list[str]) -> None:
    from kiln_bench import server as serving

    concurrency, device, endpoints, json_out = opts.concurrency, opts.device, opts.endpoints, opts.json_out

    try:
        levels = sorted({int(c) for c in concurrency.split(",") if c.strip()})
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise click.UsageError(f"--concurrency {concurrency!r}: give positive integers, e.g. 1,4,16")
    if device != "cpu" or set(peer_names) - {"vllm"}:
        raise click.UsageError("--server runs on CPU against vLLM's OpenAI server only: --device cpu, "
                               "--baselines vllm (or none, for kiln alone)")
    dialects = [e.strip() for e in endpoints.split(",") if e.strip()]
    if not dialects or set(dialects) - {"completions", "chat", "messages", "responses"}:
        raise click.UsageError(f"--endpoints {endpoints!r}: choose among completions, chat, messages, responses")
    doc = serving.run(model_dir, opts.dtype, opts.threads, levels, "vllm" if peer_names else None, opts.repeats,
                      opts.isl, opts.osl, opts.seed, opts.max_batch_size, opts.max_num_tokens, log,
                      endpoints=dialects)
    click.echo(json.dumps(doc, indent=2) if json_out == "-" else serving.text(doc))
    if json_out and json_out != "-":
        Path(json_out).write_text(json.dumps(doc, indent=2))
    for name, why in doc["failed"].items():
        click.echo(f"kiln bench --server: {name} failed: {' | '.join(why)} (logs in {doc['logs']})", err=True)
    if doc["failed"]:
        raise SystemExit(1)
