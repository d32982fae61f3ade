"""Measure a pool's cold load: from a request for an unloaded engine to its first token, the artifact already in
the local cache (issue 42's figure: SmolLM2 GGUF under 2 s on a small CPU host).

    python -m kiln.serving.pool.cold_load --artifact file:///path/store/engines/<version> [--repeats 3]

Starts ``kiln serve --engine m=<artifact> --idle-unload-after 1`` on a free port, sends one request (which fetches
the artifact into the cache and loads it), then, ``--repeats`` times: waits until the engine is unloaded, and
times a streamed one-token chat request from sending it to its first token. Prints one JSON line: each
time-to-first-token, the pool's own load seconds for each (``kiln:pool_engine_load_seconds``), the median, and the
server's resident memory with the engine loaded and after each unload (an unload that leaked would grow it).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time

import click
from kiln.engine.local_port import free_local_port


def _wait(predicate, what: str, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise click.ClickException(f"kiln serve exited with {proc.returncode} while waiting for {what}")
        try:
            if predicate():
                return
        except Exception:  # not listening yet
            pass
        time.sleep(0.05)
    raise click.ClickException(f"{what} did not happen within {timeout:.0f}s")


def _rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def _load_seconds(base: str) -> float:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "kiln:pool_engine_load_seconds_sum")


def _first_token_seconds(base: str) -> float:
    import httpx

    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0,
            "stream": True}
    started = time.monotonic()
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data:") and '"content"' in line:
                return time.monotonic() - started
    raise click.ClickException("the stream ended without a token")


@click.command()
@click.option("--artifact", required=True, help="The engine artifact URI to measure.")
@click.option("--cache-dir", default=None, help="The local artifact cache (default: a new temporary folder).")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
def main(artifact: str, cache_dir: str | None, repeats: int) -> None:
    import httpx

    port = free_local_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kiln", "serve", "--engine", f"m={artifact}", "--idle-unload-after", "1",
           "--port", str(port), "--cache-dir", cache_dir or tempfile.mkdtemp(prefix="kiln-cold-load-")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait(lambda: httpx.get(f"{base}/ready", timeout=2).status_code == 200, "/ready", 120, proc)
        first = _first_token_seconds(base)  # fetches into the cache, then loads
        ttft, loads, rss_loaded, rss_unloaded = [], [], [_rss_mib(proc.pid)], []
        for _ in range(repeats):
            _wait(lambda: httpx.get(f"{base}/v1/models", timeout=5).json()["data"][0]["state"] == "unloaded",
                  "the idle unload", 60, proc)
            rss_unloaded.append(_rss_mib(proc.pid))
            before = _load_seconds(base)
            ttft.append(_first_token_seconds(base))
            loads.append(_load_seconds(base) - before)
            rss_loaded.append(_rss_mib(proc.pid))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(json.dumps({"artifact": artifact, "first_request_with_fetch_s": round(first, 3),
                      "cold_load_to_first_token_s": [round(t, 3) for t in ttft],
                      "pool_load_seconds": [round(t, 3) for t in loads],
                      "median_cold_load_to_first_token_s": round(statistics.median(ttft), 3),
                      "rss_mib_loaded": rss_loaded, "rss_mib_after_unload": rss_unloaded}))


if __name__ == "__main__":
    main()
