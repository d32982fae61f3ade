"""Threads under contention: ``kiln serve`` output tok/s at its default thread count against fixed ones, on a
quiet host and with busy lowest-priority neighbours (``nice -n 19`` Python loops) beside it.

    python -P bench/contention.py --repeats 3 [--dtype float32] [--configs default,1,2] [--json out.json]

A config is ``default`` (what ``kiln serve`` chooses), or a thread count ``N`` (``$OMP_NUM_THREADS=N``), with an
optional ``+ENV=VALUE`` suffix (``2+OMP_WAIT_POLICY=ACTIVE``). In each round every config's server is started,
warmed up, driven quiet, then with the neighbours (the order of configs flips each round, so a shared host's
noise falls on all); the summary is the median per cell and the ratio neighbours / quiet. The workload is the
issue's: 8 streaming completions at concurrency 4, 96 output tokens each (ignore_eos).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

import click

try:
    from kiln_bench.model import ensure_model
    from kiln_bench.serve_probe import Served, drive, loadavg, neighbours
except ImportError:  # run as a script from the repository
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.model import ensure_model  # type: ignore[no-redef]
    from bench.serve_probe import Served, drive, loadavg, neighbours  # type: ignore[no-redef]


def config_env(config: str) -> dict[str, str]:
    name, *extra = config.split("+")
    env = dict(e.split("=", 1) for e in extra)
    if name != "default":
        env["OMP_NUM_THREADS"] = str(int(name))
    return env


def one_round(model_dir: Path, config: str, port: int, log: Path, busy: int, workload: dict) -> dict:
    served = Served(model_dir, port, log, env=config_env(config))
    try:
        served.wait_ready()
        info = served.version()
        drive(served.url, requests=2, concurrency=2, max_tokens=8)  # warm-up
        quiet = drive(served.url, **workload)
        with neighbours(busy):
            loaded = drive(served.url, **workload)
        target = info.get("cpu_target") or {}
        return {"threads": info.get("torch_num_threads"), "threads_from": target.get("threads_from"),
                "quiet": quiet["out_tok_s"], "neighbours": loaded["out_tok_s"], "cut": loaded["cut_at_deadline"],
                "load": loadavg()}
    finally:
        served.stop()


@click.command()
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="float32", show_default=True)
@click.option("--preset", default="llama-bench", show_default=True)
@click.option("--configs", default="default,1", show_default=True)
@click.option("--repeats", type=int, default=3, show_default=True)
@click.option("--neighbours", "busy", type=int, default=2, show_default=True)
@click.option("--deadline", type=float, default=60.0, show_default=True,
              help="Seconds one drive may take; past it the rate so far is the figure.")
@click.option("--port", type=int, default=8741, show_default=True)
@click.option("--json", "json_out", default=None)
def main(dtype: str, preset: str, configs: str, repeats: int, busy: int, deadline: float, port: int,
         json_out: str | None) -> None:
    model_dir = ensure_model(preset, dtype)
    names = [c.strip() for c in configs.split(",") if c.strip()]
    workload = {"requests": 8, "concurrency": 4, "max_tokens": 96, "deadline_s": deadline}
    rows: dict[str, list[dict]] = {c: [] for c in names}
    with tempfile.TemporaryDirectory(prefix="kiln-contention-") as tmp:
        for r in range(repeats):
            for c in names if r % 2 == 0 else names[::-1]:
                row = one_round(model_dir, c, port, Path(tmp) / f"{r}-{c}.log", busy, workload)
                rows[c].append(row)
                print(f"#{r} {c}: {json.dumps(row)}", flush=True)
    summary = {}
    for c, rs in rows.items():
        q, n = statistics.median(x["quiet"] for x in rs), statistics.median(x["neighbours"] for x in rs)
        summary[c] = {"quiet": q, "neighbours": n, "ratio": round(n / q, 3) if q else None,
                      "threads": rs[0]["threads"]}
        print(f"{c:>12}: threads {rs[0]['threads']}, quiet {q:.1f} tok/s, {busy} neighbours {n:.1f} tok/s "
              f"({summary[c]['ratio']}x)")
    if json_out:
        Path(json_out).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
