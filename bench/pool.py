"""``kiln bench --pool``: a pool of four engines with memory for two, under a seeded skewed workload (issue 42).

One run, every system up together and measured in turn (the order flips each of ``--repeats`` rounds, medians):

- ``pool``: one ``kiln serve --engine NAME=URI`` x4 with ``--memory-budget`` the sum of the two largest engines'
  counted memory (plus ``--max-loaded-engines 2`` where that budget would also hold three: the document says which);
- ``per-engine``: one ``kiln serve --artifact URI`` per engine, each its own process and memory, the same requests;
- ``llama.cpp`` (not ``--quick``): ``python -m llama_cpp.server --config_file`` listing the GGUF engine(s), against
  ``pool-gguf``, the pool on the same GGUF requests, at the same concurrency.

Checked: (a) greedy answers of the pool equal the engine's served alone (a sample per engine, one at a time, after
the rounds; and how many workload answers agree); (b) the pool's RSS, sampled every 100 ms for the whole run, never
exceeds its budget plus the server's margin; (c) loads and evictions from its /metrics; (d) the cold load of the
first engine from the local cache to its first token (``kiln.serving.pool.cold_load``), beside the 2 s target;
(e) the pool's throughput over the per-engine servers' and their summed peak RSS over the pool's; (f) kiln over
llama.cpp. Every kiln server runs ``OMP_NUM_THREADS=threads`` with the tactic table and thread count pinned.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from kiln_bench import pool_parts as parts

COLD_LOAD_TARGET_S = 2.0  # issue 42: SmolLM2 GGUF under 2 s on this kind of host


def rss_check(peak_bytes: int, budget_bytes: int, margin_bytes: int) -> dict:
    """(b): the pool's sampled peak RSS against its budget plus the server's own margin."""
    return {"max_rss_bytes": peak_bytes, "budget_bytes": budget_bytes, "server_margin_bytes": margin_bytes,
            "limit_bytes": budget_bytes + margin_bytes, "passed": 0 < peak_bytes <= budget_bytes + margin_bytes}


def equality(checks: list[dict]) -> dict:
    """(a): each ``{engine, prompt, pool, alone}`` answer pair equal."""
    bad = [c for c in checks if c["pool"] != c["alone"] or c["pool"] is None]
    return {"checked": len(checks), "passed": bool(checks) and not bad,
            "mismatches": [{"engine": c["engine"], "prompt": c["prompt"], "pool": c["pool"], "alone": c["alone"]}
                           for c in bad]}


def budget_flags(memory: dict[str, int]) -> tuple[int, list[str], str]:
    """(budget, the pool's flags, how the two were chosen): the two largest engines' sum; ``--max-loaded-engines 2``
    beside it when the three smallest would fit that budget too."""
    sizes = sorted(memory.values())
    budget = sum(sizes[-2:])
    flags = ["--memory-budget", str(budget)]
    if sum(sizes[:3]) <= budget:
        return budget, flags + ["--max-loaded-engines", "2"], (
            "--max-loaded-engines 2 with --memory-budget the two largest engines' sum: the engines' sizes differ "
            "so much that any budget holding the two largest would also hold the three smallest")
    return budget, flags, "--memory-budget alone: it holds any two engines and no three"


def _kiln(args: list[str], port: int, serve_flags: list[str]) -> list[str]:
    return [sys.executable, "-P", "-m", "kiln", "serve", *args, "--port", str(port), "--no-tactics-background",
            "--no-thread-governor", *serve_flags]


def start_servers(built: dict, flags: list[str], threads: int, scratch: Path, llamacpp: Path | None, say,
                  serve_flags: list[str]) -> dict:
    """name -> Server: ``pool``, one per engine (``alone:NAME``), and ``llama.cpp`` when its interpreter is given;
    ``serve_flags`` go to every kiln server."""
    from kiln.engine.local_port import free_local_port
    from kiln_bench.server import Server

    taken: set[int] = set()

    def free_port() -> int:  # free now, and not one picked for a server that may not listen yet
        while (port := free_local_port()) in taken:
            pass
        taken.add(port)
        return port

    env = {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    cache = parts.work_dir() / "bench-pool-cache"
    servers = {}
    port = free_port()
    engines = [a for name, e in built.items() for a in ("--engine", f"{name}={e['uri']}")]
    say(f"starting the pool: kiln serve {' '.join(flags)} with {len(built)} engines ...")
    servers["pool"] = Server("pool", _kiln([*engines, *flags, "--cache-dir", str(cache / "pool")], port, serve_flags),
                             env, port, scratch / "pool.log", scratch, "/ready")
    for name, e in built.items():
        port = free_port()
        servers[f"alone:{name}"] = Server(name, _kiln(["--artifact", e["uri"], "--served-model-name", name,
                                                       "--cache-dir", str(cache / name)], port, serve_flags),
                                          env, port, scratch / f"{name}.log", scratch, "/ready")
    ggufs = [(n, e) for n, e in built.items() if e["kind"] == "gguf"]
    if llamacpp is not None and ggufs:
        port = free_port()
        config = {"host": "127.0.0.1", "port": port,
                  "models": [{"model": str(e["gguf"]), "model_alias": n, "n_threads": threads,
                              "n_threads_batch": threads, "n_ctx": 4096} for n, e in ggufs]}
        (scratch / "llamacpp.json").write_text(json.dumps(config))
        servers["llama.cpp"] = Server("llama.cpp", [str(llamacpp), "-P", "-m", "llama_cpp.server", "--config_file",
                                                    str(scratch / "llamacpp.json")], env, port,
                                      scratch / "llamacpp.log", scratch, "/v1/models")
    for s in servers.values():
        s.wait_ready(s.ready_path, 900)
    return servers


def cold_load(uri: str, threads: int, repeats: int) -> dict:
    """(d): ``kiln.serving.pool.cold_load`` on ``uri``, the artifact in a local cache kept between runs."""
    cache = parts.work_dir() / "bench-pool-cache" / "cold-load"
    out = subprocess.run([sys.executable, "-P", "-m", "kiln.serving.pool.cold_load", "--artifact", uri,
                          "--cache-dir", str(cache), "--repeats", str(repeats)], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": str(threads)}, timeout=900)
    if out.returncode != 0:
        return {"error": (out.stdout + out.stderr)[-1500:]}
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    doc["target_s"] = COLD_LOAD_TARGET_S
    doc["under_target"] = doc["median_cold_load_to_first_token_s"] < COLD_LOAD_TARGET_S
    return doc


def _targets(servers: dict, built: dict) -> dict[str, tuple[dict[str, str], str]]:
    """system -> (engine -> base URL, which requests: all / gguf)."""
    pool = servers["pool"].url
    targets = {"pool": ({n: pool for n in built}, "all"),
               "per-engine": ({n: servers[f"alone:{n}"].url for n in built}, "all")}
    if "llama.cpp" in servers:
        gguf = [n for n, e in built.items() if e["kind"] == "gguf"]
        targets["pool-gguf"] = ({n: pool for n in gguf}, "gguf")
        targets["llama.cpp"] = ({n: servers["llama.cpp"].url for n in gguf}, "gguf")
    return targets


def rounds(servers: dict, built: dict, requests: list[dict], concurrency: int, repeats: int, say) -> dict:
    """Every system ``repeats`` times, alternating (the order flips each round): system -> list of runs."""
    targets = _targets(servers, built)
    runs: dict[str, list[dict]] = {s: [] for s in targets}
    for r in range(repeats):
        order = list(targets) if r % 2 == 0 else list(reversed(targets))
        for system in order:
            urls, which = targets[system]
            batch = [q for q in requests if which == "all" or q["engine"] in urls]
            say(f"round {r + 1}/{repeats}: {system}, {len(batch)} requests at concurrency {concurrency} ...")
            runs[system].append(parts.drive(urls, batch, concurrency))
    return runs


def warm_up(servers: dict, built: dict) -> list[str]:
    """One short request per engine, one at a time, to the pool and to each engine's own server (and llama.cpp):
    first imports and first steps out of the rounds. Returns the errors."""
    targets = [(n, servers["pool"].url) for n in built] + [(n, servers[f"alone:{n}"].url) for n in built]
    if "llama.cpp" in servers:
        targets += [(n, servers["llama.cpp"].url) for n, e in built.items() if e["kind"] == "gguf"]
    errors = []
    for name, url in targets:
        got = parts.drive({name: url}, [{"engine": name, "prompt": "Hello", "max_tokens": 2}], 1)
        if got["errors"]:
            errors.append(f"{name} at {url}: {got['answers'][0]}")
    return errors


def sample_checks(servers: dict, built: dict, requests: list[dict], per_engine: int) -> list[dict]:
    """(a)'s sample: up to ``per_engine`` workload prompts of each engine, one at a time, engines interleaved (so the
    pool loads and evicts between them), to the pool and to that engine's own server."""
    picked = {n: [q for q in requests if q["engine"] == n][:per_engine] for n in built}
    order = [picked[n][i] for i in range(per_engine) for n in built if i < len(picked[n])]
    checks = []
    for q in order:
        got = {k: parts.drive({q["engine"]: url}, [q], 1)["answers"][0]
               for k, url in (("pool", servers["pool"].url), ("alone", servers[f"alone:{q['engine']}"].url))}
        checks.append({"engine": q["engine"], "prompt": q["prompt"], **got})
    return checks


def _summary(runs: dict[str, list[dict]]) -> dict:
    return {s: {"tok_s": statistics.median(r["tok_s"] for r in rs),
                "seconds": statistics.median(r["seconds"] for r in rs), "tokens": rs[-1]["tokens"],
                "errors": sum(r["errors"] for r in rs), "runs": [r["tok_s"] for r in rs]}
            for s, rs in runs.items()}


def run(quick: bool, repeats: int, num_requests: int, concurrency: int, max_tokens: int, seed: int, threads: int,
        check_per_engine: int, llamacpp: Path | None, llamacpp_skipped: str | None, say,
        serve_flags: list[str] | None = None) -> dict:
    """The whole measurement; the document ``text`` prints and ``--json`` writes (``serve_flags``: to every kiln
    server)."""
    from kiln_bench.server import _host

    from kiln.memory_budget import SERVER_MARGIN_BYTES

    built = parts.build_engines(parts.QUICK_ENGINES if quick else parts.FULL_ENGINES, say)
    budget, flags, how = budget_flags({n: e["memory_bytes"] for n, e in built.items()})
    first = next(iter(built))
    say(f"cold load of {first} from the local cache to its first token ...")
    cold = cold_load(built[first]["uri"], threads, 1 if quick else 3)
    requests = parts.workload(list(built), num_requests, max_tokens, seed)
    scratch = Path(tempfile.mkdtemp(prefix="kiln-bench-pool-"))
    servers = start_servers(built, flags, threads, scratch, llamacpp, say, list(serve_flags or []))
    try:
        pids = {k: s.proc.pid for k, s in servers.items()}
        with parts.RssSampler(list(pids.values())) as sampler:
            warm_errors = warm_up(servers, built)
            runs = rounds(servers, built, requests, concurrency, repeats, say)
            checks = sample_checks(servers, built, requests, check_per_engine)
        counters = parts.pool_counters(servers["pool"].url)
    finally:
        for s in servers.values():
            s.stop()
    peaks = {k: sampler.peaks[p] for k, p in pids.items()}
    alone_peak = sum(v for k, v in peaks.items() if k.startswith("alone:"))
    table = _summary(runs)
    pool_runs, alone_runs = runs["pool"][-1]["answers"], runs["per-engine"][-1]["answers"]
    agree = sum(a == b for a, b in zip(pool_runs, alone_runs, strict=True))
    doc = {
        "host": _host(), "threads_per_engine": threads, "quick": quick, "repeats": repeats, "seed": seed,
        "concurrency": concurrency, "max_tokens": max_tokens, "num_requests": num_requests, "skew": parts.SKEW,
        "requests_per_engine": {n: sum(q["engine"] == n for q in requests) for n in built},
        "engines": built,
        "pool_flags": flags, "budget_choice": how, "serve_flags": list(serve_flags or []),
        "equality": {**equality(checks), "workload_identical": agree, "workload_requests": len(requests)},
        "rss": {**rss_check(peaks["pool"], budget, SERVER_MARGIN_BYTES), "samples": sampler.samples,
                "per_engine_peak_bytes": {k.removeprefix("alone:"): v for k, v in peaks.items() if k != "pool"}},
        "counters": counters, "cold_load": cold, "systems": table,
        "pool_over_per_engine_tok_s": round(table["pool"]["tok_s"] / table["per-engine"]["tok_s"], 3),
        "per_engine_rss_over_pool": round(alone_peak / peaks["pool"], 3) if peaks["pool"] else None,
        "llamacpp": None if "llama.cpp" not in table else
        {"kiln_over_llamacpp_tok_s": round(table["pool-gguf"]["tok_s"] / table["llama.cpp"]["tok_s"], 3)},
        "llamacpp_skipped": llamacpp_skipped, "warm_up_errors": warm_errors, "checks": checks,
    }
    shutil_rm(scratch, keep=any(t["errors"] for t in table.values()))
    doc["logs"] = str(scratch) if scratch.exists() else None
    return doc


def shutil_rm(path: Path, keep: bool) -> None:
    import shutil

    if not keep:
        shutil.rmtree(path, ignore_errors=True)


def main(opts, say) -> dict:
    """``kiln bench --pool``'s options resolved, llama.cpp's environment found or made (not with ``--quick``)."""
    import click

    if opts.repeats < 1:
        raise click.UsageError(f"--repeats must be >= 1, got {opts.repeats}")
    try:
        levels = [int(c) for c in opts.concurrency.split(",") if c.strip()]
    except ValueError:
        raise click.UsageError(f"--concurrency: comma-separated integers, got {opts.concurrency!r}") from None
    concurrency = max(levels or [16])
    llamacpp, skipped = None, "--quick: no llama.cpp" if opts.quick else None
    if not opts.quick:
        from kiln_bench.llamacpp import default_env, ensure_env

        try:  # made when missing; one that exists is used as it is (a build of it may be under way)
            llamacpp = ensure_env(default_env(), make=not default_env().exists())
        except (click.ClickException, subprocess.CalledProcessError) as exc:
            skipped = (f"llama.cpp's environment {default_env()} has no working llama_cpp ({exc}); remove it to "
                       "have it made anew (it compiles llama.cpp: minutes)")
    num = opts.num_requests if opts.num_requests is not None else (24 if opts.quick else 160)
    return run(opts.quick, opts.repeats, num, concurrency, 6 if opts.quick else 16, opts.seed, opts.threads or 1,
               opts.check_requests if opts.check_requests is not None else 2 if opts.quick else 4, llamacpp, skipped,
               say, ["--batch-invariant"] if opts.batch_invariant else [])


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def text(doc: dict) -> str:
    """The table and the checks, as docs/pools.md shows them."""
    eq, rss, cnt, cold, t = doc["equality"], doc["rss"], doc["counters"], doc["cold_load"], doc["systems"]
    lines = [f"kiln bench --pool{' --quick' if doc['quick'] else ''}: {len(doc['engines'])} engines, "
             f"{doc['num_requests']} requests skewed {'/'.join(f'{100 * s:.0f}' for s in doc['skew'])}% "
             f"({doc['requests_per_engine']}), concurrency {doc['concurrency']}, greedy, "
             f"{doc['max_tokens']} tokens max, "
             f"{doc['threads_per_engine']} thread(s) per engine, medians of {doc['repeats']} round(s)",
             f"host: {doc['host']}", f"pool: {' '.join(doc['pool_flags'])} ({doc['budget_choice']})",
             f"every kiln server: {' '.join(doc.get('serve_flags') or []) or 'no extra flags'}", "",
             "| engine | kind | counts |", "|---|---|---:|"]
    lines += [f"| {n} | {e['kind']} {e['preset']} | {_gib(e['memory_bytes'])} |" for n, e in doc["engines"].items()]
    lines += ["", "| system | out tok/s | seconds | errors | runs |", "|---|---:|---:|---:|---|"]
    lines += [f"| {s} | {r['tok_s']:.1f} | {r['seconds']:.1f} | {r['errors']} | {r['runs']} |" for s, r in t.items()]
    lines += ["", f"(a) greedy equality, pool vs each engine alone: {'PASS' if eq['passed'] else 'FAIL'} "
              f"({eq['checked']} sampled one at a time, {len(eq['mismatches'])} differ); workload answers identical: "
              f"{eq['workload_identical']}/{eq['workload_requests']}",
              f"(b) pool RSS max {_gib(rss['max_rss_bytes'])} vs budget {_gib(rss['budget_bytes'])} + server margin "
              f"{_gib(rss['server_margin_bytes'])} = {_gib(rss['limit_bytes'])}: {'PASS' if rss['passed'] else 'FAIL'} "
              f"({rss['samples']} samples, every 100 ms)",
              f"warm-up (one request per engine and server, one at a time, before the rounds): "
              f"{len(doc['warm_up_errors'])} error(s) {doc['warm_up_errors'][:2]}",
              f"(c) loads {cnt['loads']}, evictions {cnt['evictions']} {cnt['evictions_by_reason']}",
              "(d) cold load to first token: " + (f"error: {cold['error'][-300:]}" if "error" in cold else
              f"median {cold['median_cold_load_to_first_token_s']:.2f} s {cold['cold_load_to_first_token_s']} "
              f"(target < {cold['target_s']:.0f} s: {'met' if cold['under_target'] else 'NOT met'}; pool load seconds "
              f"{cold['pool_load_seconds']})"),
              f"(e) pool / per-engine servers out tok/s = {doc['pool_over_per_engine_tok_s']:.2f}x; per-engine summed "
              f"peak RSS / pool peak RSS = {doc['per_engine_rss_over_pool']}x "
              f"({_gib(sum(rss['per_engine_peak_bytes'].get(n, 0) for n in doc['engines']))} vs "
              f"{_gib(rss['max_rss_bytes'])})",
              "(f) " + (f"kiln pool / llama.cpp multi-model server on the GGUF requests = "
                        f"{doc['llamacpp']['kiln_over_llamacpp_tok_s']:.2f}x" if doc["llamacpp"]
                        else f"llama.cpp not measured: {doc['llamacpp_skipped']}")]
    return "\n".join(lines)
