"""Start-up: ``kiln serve --model <bench model>`` from spawn to ``/ready``, with no tactic table on the host
(a fresh cache) and with the one the previous start left; ``/version``'s ``tactics`` for each, and, when
the table is timed after ``/ready``, how long until it was swapped in.

    python -P bench/startup.py --repeats 3 [--dtype bfloat16] [--json out.json]
    python -P bench/startup.py --artifact file:///path/store/engines/<version> --repeats 3

Runs alternate cold and warm within each repeat (a shared host's noise falls on both); the summary is the
median of each. Run by hand or from ``make bench``-style jobs; it needs the bench model (made here once).

With ``--artifact``: ``kiln serve --artifact`` (issue 41's start-up of a built artifact), "cold" fetching it into
an empty local cache, "warm" loading the copy that start left there (verified by its stamp, kiln.cache_stamp);
``/ready`` comes after the server's one-generation warm-up, so it is ready to the first token.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

try:
    from kiln_bench.model import ensure_model
    from kiln_bench.serve_probe import Served, kiln_exe, loadavg
except ImportError:  # run as a script from the repository
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.model import ensure_model  # type: ignore[no-redef]
    from bench.serve_probe import Served, kiln_exe, loadavg  # type: ignore[no-redef]

class ArtifactServed(Served):
    """``kiln serve --artifact URI``, its local artifact cache under ``$XDG_CACHE_HOME`` (``kiln serve``'s
    default ``--cache-dir``); probed as ``Served`` is."""

    def __init__(self, uri: str, port: int, log: Path, env: dict[str, str], args: list[str]) -> None:
        self.url, self.log, self.ready_s = f"http://127.0.0.1:{port}", log, None
        cmd = [kiln_exe(), "serve", "--artifact", uri, "--port", str(port), *args]
        self.started = time.monotonic()
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT)


def one_start(model_dir: Path | str, cache: Path, port: int, log: Path, extra: list[str]) -> dict:
    env = {"XDG_CACHE_HOME": str(cache)}
    served = ArtifactServed(model_dir, port, log, env, extra) if isinstance(model_dir, str) else \
        Served(model_dir, port, log, env=env, args=extra)
    try:
        ready = served.wait_ready()
        info = served.version().get("tactics") or {}
        row = {"ready_s": round(ready, 2), "source": info.get("source"), "origin": info.get("origin"),
               "why": info.get("why"), "timed_s": info.get("seconds")}
        if info.get("origin") == "default-until-timed":
            final = served.wait_tactics()
            row["table_after_s"] = round(time.monotonic() - served.started, 2) if final else None
            row["final"] = final and {k: final.get(k) for k in ("source", "origin", "why", "seconds")}
        return row
    finally:
        served.stop()


@click.command()
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True)
@click.option("--preset", default="llama-bench", show_default=True)
@click.option("--repeats", type=int, default=3, show_default=True)
@click.option("--port", type=int, default=8731, show_default=True)
@click.option("--arg", "extra", multiple=True, help="An extra `kiln serve` argument (repeatable).")
@click.option("--artifact", default=None, help="Start `kiln serve --artifact` of this URI instead of --model: cold "
              "fetches it into an empty cache, warm loads that copy.")
@click.option("--json", "json_out", default=None, help="Write the rows as JSON here.")
def main(dtype: str, preset: str, repeats: int, port: int, extra: tuple[str, ...], artifact: str | None,
         json_out: str | None) -> None:
    model_dir = artifact or ensure_model(preset, dtype)
    rows: dict[str, list[dict]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="kiln-startup-") as tmp:
        for r in range(repeats):
            cache = Path(tmp) / f"cache-{r}"  # empty: no table on this host (no copy of --artifact)
            for kind in ("cold", "warm"):  # warm: the table (the copy) the cold start left
                row = one_start(model_dir, cache, port, Path(tmp) / f"{kind}-{r}.log", list(extra))
                row["load"] = loadavg()
                rows[kind].append(row)
                print(f"{kind} #{r}: {json.dumps(row)}", flush=True)
    summary = {k: statistics.median(x["ready_s"] for x in v) for k, v in rows.items() if v}
    print("median ready_s: " + ", ".join(f"{k} {v:.2f}" for k, v in summary.items()))
    if json_out:
        Path(json_out).write_text(json.dumps({"rows": rows, "median_ready_s": summary}, indent=1))


if __name__ == "__main__":
    main()
