"""``kiln bench``: kiln against transformers' static and continuous batching, one workload, one run.

Exit codes: 0 done (the equality check's result is in the output, not the
exit code, unless ``--strict``), 1 a system failed or ``--strict`` and the
equality check failed, 2 usage errors.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from kiln_bench import modes
from kiln_bench.options import BenchOptions, click_options
from kiln_bench.suite import ALL_SYSTEMS, ISA_CAPS


def _default_threads() -> int:
    import torch

    return torch.get_num_threads()


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise click.UsageError("--device cuda: no CUDA device is visible to torch here; use --device cpu")
    return device


@click.command("bench")
@click_options
def bench(**options) -> None:
    """Benchmark kiln against transformers on one deterministic workload and print the table."""
    opts = BenchOptions(**options)
    if opts.max_isa:
        _cap_isa(opts.max_isa)
    chosen = [s.strip() for s in opts.systems.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in ALL_SYSTEMS]
    if unknown or not chosen:
        raise click.UsageError(f"--systems: unknown {', '.join(unknown) or '(none given)'}; "
                               f"choose from {', '.join(ALL_SYSTEMS)}")
    peer_names = opts.peer_names
    if opts.batch_invariant and not opts.pool:  # the suite's systems say it by name: kiln-batch-invariant
        raise click.UsageError("--batch-invariant goes with --pool (the suite runs it as --systems "
                               "kiln-batch-invariant)")
    if opts.gguf is not None or "llamacpp" in peer_names:  # bench/llamacpp.py: the GGUF baseline, on the same file
        modes.gguf(opts, peer_names)
        return
    if opts.pool:  # bench/pool.py: an engine pool against one server per engine and llama.cpp's (issue 42)
        from kiln_bench import pool

        modes.emit(pool.main(opts, modes.log), pool.text, opts)
        return
    chosen, spec = _resolve(opts, chosen, peer_names)
    model_dir = _model(opts)
    if opts.structured:  # bench/structured.py: what constrained decoding costs
        modes.structured(opts, model_dir)
    elif opts.lora is not None:  # bench/lora.py: what serving N adapters in mixed batches costs
        modes.lora(opts, model_dir)
    elif opts.server:  # bench/server.py: the serving path under an external client
        modes.server(opts, model_dir, peer_names)
    elif opts.speculative:  # bench/speculative.py: what prompt-lookup speculation gains, and where it stops
        modes.speculative(opts, model_dir)
    elif opts.profile:  # bench/profile.py: where a decode step and a prefill chunk go
        from kiln_bench import profile

        modes.emit(profile.main(opts, model_dir, modes.log), profile.text, opts)
    elif opts.draft_model is not None or opts.draft_layers is not None or opts.pair_scale is not None:
        raise click.UsageError("--draft-model / --draft-layers / --pair-scale go with --speculative")
    else:
        _suite(opts, chosen, peer_names, spec, model_dir)


def _cap_isa(max_isa: str) -> None:
    import os
    import platform

    if platform.machine() != "x86_64":
        raise click.UsageError(f"--max-isa {max_isa}: an x86-64 cap, and this host is {platform.machine()}")
    # Before any torch op: ATen, oneDNN and MKL read these once, at their first kernel dispatch. The
    # systems' processes inherit them.
    os.environ.update(ISA_CAPS[max_isa])


def _resolve(opts: BenchOptions, chosen: list[str], peer_names: list[str]):
    """Check the options and resolve their defaults in ``opts`` (device, preset, threads, check requests):
    (the systems to run, the workload's spec)."""
    from kiln.engine.random_checkpoint import PRESETS
    from kiln_bench import peers
    from kiln_bench.model import DEFAULT_GPU_PRESET, DEFAULT_PRESET, QUICK_PRESET
    from kiln_bench.workload import WorkloadSpec

    bad = [b for b in peer_names if b not in peers.PEERS]
    if bad:
        raise click.UsageError(f"--baselines: unknown {', '.join(bad)}; choose from {', '.join(peers.PEERS)}")
    opts.device = _resolve_device(opts.device)  # auto -> cuda on a GPU host: the peers would not share kiln's device
    if peer_names and opts.device != "cpu":
        raise click.UsageError("--baselines: the peer baselines run on CPU only; use --device cpu")
    chosen = chosen + [b for b in peer_names if b not in chosen]
    opts.preset = opts.preset or (QUICK_PRESET if opts.quick else DEFAULT_GPU_PRESET if opts.device == "cuda"
                                  else DEFAULT_PRESET)
    if opts.preset not in PRESETS:
        raise click.UsageError(f"--preset {opts.preset!r} is unknown; choose from {', '.join(sorted(PRESETS))}")
    for name, value, low in (("--repeats", opts.repeats, 1), ("--max-batch-size", opts.max_batch_size, 1),
                             ("--max-num-tokens", opts.max_num_tokens, 1)):
        if value < low:
            raise click.UsageError(f"{name} must be >= {low}, got {value}")
    if opts.threads is not None and opts.threads < 1:
        raise click.UsageError(f"--threads must be >= 1, got {opts.threads}")
    opts.threads = opts.threads or _default_threads()
    spec_kw = {}
    if opts.quick:
        spec_kw = dict(prompt_len_min=8, prompt_len_max=48, short_output=(4, 12), long_output=(24, 40))
    num_requests = opts.num_requests if opts.num_requests is not None else (6 if opts.quick else 64)
    spec = WorkloadSpec(num_requests=num_requests, seed=opts.seed, arrival_rate=opts.arrival_rate,
                        shared_prefix_len=opts.shared_prefix, **spec_kw)
    try:
        spec.check()
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if opts.check_requests is None:
        opts.check_requests = 4 if opts.quick else 8
    return chosen, spec


def _model(opts: BenchOptions) -> Path:
    """The checkpoint every system runs: ``--model-dir``'s, or the preset's toy model written there."""
    from kiln_bench.model import ensure_model

    model_dir = opts.model_dir
    modes.log(f"model: {model_dir if model_dir and (model_dir / 'config.json').is_file() else opts.preset} "
         f"({opts.dtype}) ...")
    try:
        # Absolute: every system runs in its own process from a scratch directory.
        return ensure_model(opts.preset, opts.dtype, seed=0, model_dir=model_dir.resolve() if model_dir else None)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def _suite(opts: BenchOptions, chosen: list[str], peer_names: list[str], spec, model_dir: Path) -> None:
    """The suite: every chosen system on one workload, the table, the equality check (exit 1 per --strict)."""
    from kiln_bench import peers, report
    from kiln_bench.model import model_facts
    from kiln_bench.suite import SuiteConfig, run_suite
    from kiln_bench.workload import make_workload

    facts = model_facts(model_dir)
    peer_models = {}
    for name in peer_names:
        try:
            peer_models[name] = str(peers.ensure_model(name, model_dir, opts.dtype, say=modes.log))
        except RuntimeError as exc:
            click.echo(f"kiln bench: the {name} baseline: {exc}", err=True)
            sys.exit(1)
    workload = make_workload(spec, facts["vocab_size"], set(facts["special_ids"]))
    cfg = SuiteConfig(model_dir=model_dir, dtype=opts.dtype, threads=opts.threads, device=opts.device,
                      systems=chosen, repeats=opts.repeats, max_batch_size=opts.max_batch_size,
                      max_num_tokens=opts.max_num_tokens, check_requests=opts.check_requests,
                      check_max_tokens=16 if opts.quick else 32, ceiling_buffer_mib=64 if opts.quick else 512,
                      log=modes.log, partial_json=opts.json_file, peer_models=peer_models)
    machine = report.machine_info(opts.threads)  # before the run: the commit benchmarked, not the one after
    try:
        results = run_suite(cfg, workload, facts)
    except RuntimeError as exc:
        click.echo(f"kiln bench: {exc}", err=True)
        sys.exit(1)
    doc = {
        "config": {"preset": opts.preset, "model_dir": str(model_dir), "dtype": opts.dtype, "threads": opts.threads,
                   "device": opts.device, "repeats": opts.repeats, "systems": chosen,
                   "max_batch_size": opts.max_batch_size, "max_num_tokens": opts.max_num_tokens,
                   "max_isa": opts.max_isa, "quick": opts.quick, "workload_spec": workload.to_json()["spec"]},
        "machine": machine,
        "model": facts,
        "workload": workload.summary(),
        **results,
    }
    if opts.json_out == "-":
        click.echo(json.dumps(doc, indent=2))
    else:
        click.echo(_text(doc))
        if opts.json_out:
            Path(opts.json_out).write_text(json.dumps(doc, indent=2))
            click.echo(f"\nJSON written to {opts.json_out}")
    eq = results.get("equality")
    if results.get("failed") or (opts.strict and eq is not None and not eq["passed"]):
        sys.exit(1)


def _text(doc: dict) -> str:
    from kiln_bench import report

    m, w, c = doc["machine"], doc["workload"], doc["config"]
    lines = [
        f"kiln bench — {m['cpu']} ({m['cpu_count']} cores), torch {m['torch']} with {c['threads']} threads, "
        f"transformers {m['transformers']}" + (f", device {m['cuda']}" if c.get("device") == "cuda" else "")
        + (f", ISA capped at {c['max_isa']} (emulated on this host; see --max-isa in kiln bench --help)"
           if c.get("max_isa") else ""),
        f"model: {c['preset']}, {doc['model']['total_params'] / 1e6:.3g}M params, {c['dtype']}",
        f"workload: {w['num_requests']} requests ({w['arrival']}), prompts {w['prompt_len_min']}..{w['prompt_len_max']}"
        f" ({w['num_prompt_tokens']} tokens), outputs {w['output_len_min']}..{w['output_len_max']}"
        f" ({w['num_output_tokens']} tokens, {w['num_long_outputs']} long), ignore_eos, greedy"
        + (f", shared prefix {w['shared_prefix_len']}" if w["shared_prefix_len"] else ""),
        f"medians of {c['repeats']} run(s) per system; kiln x = kiln output tok/s / system output tok/s",
        "",
        report.table(doc["systems"], doc["ratios"]),
        "",
    ]
    for name, failures in (doc.get("failed") or {}).items():
        lines += [f"{name}: failed in all {len(failures)} run(s); the last:", *[f"  {x}" for x in failures[-1].splitlines()], ""]
    eq = doc.get("equality")
    if eq is not None:
        verdict = "PASS" if eq["passed"] else "FAIL"
        detail = "" if eq["passed"] else f" ({len(eq['mismatches'])} differ: {eq['mismatches'][:4]})"
        lines.append(f"greedy equality (kiln vs transformers generate, {eq['dtype']}, first {eq['num_requests']} "
                     f"requests, {eq['max_tokens']} tokens max): {verdict}{detail}")
    for name, a in doc.get("agreement", {}).items():
        lines.append(f"{c['dtype']} agreement with {name}: {a['identical_requests']}/{a['num_requests']} requests "
                     f"identical, {100 * a['prefix_token_share']:.0f}% of tokens before the first difference")
    if doc.get("ceiling"):
        lines += report.ceiling_lines(doc["ceiling"])
    return "\n".join(lines)
