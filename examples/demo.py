"""`make demo`: build and serve a small model on this CPU, talk to it, and show the build cache.

1. generate the random-weight demo model into .kiln-work/models/llama-demo (no hub);
2. `kiln up -f examples/cpu-small.yaml --store file://<repo>/.kiln-work/store --port <free>`:
   builds the engine (or finds it cached) and serves it;
3. once /ready: one completion and one chat request with the official openai client;
4. print them with the build report summary from the artifact's engine.json, stop the server;
5. `kiln build` the same manifest again: "cache hit: <version>".

Run from anywhere; paths are relative to the repository root. Exits non-zero if any step fails.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / ".kiln-work"
MODEL_DIR = WORK / "models" / "llama-demo"
STORE_DIR = WORK / "store"
MANIFEST = "examples/cpu-small.yaml"
READY_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def banner(text: str) -> None:
    print(f"\n=== {text}", flush=True)


def wait_ready(base: str, proc: subprocess.Popen) -> None:
    import httpx

    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"demo: `kiln up` exited with {proc.returncode} before the server was ready")
        try:
            if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"demo: server not ready after {READY_TIMEOUT_S}s")


def build_summary(version: str) -> list[str]:
    from kiln.builder.report import summary_lines

    doc = json.loads((STORE_DIR / "engines" / version / "engine.json").read_text())
    lines = summary_lines(doc["build_report"])
    tuning = doc.get("tuning", {})
    best = tuning.get("measurement")
    if best:
        top = best["decode"][-1]
        lines.append(f"  tuned on {tuning.get('measured_on')}: torch threads {tuning.get('torch_num_threads')}, "
                     f"prefill {best['prefill_tokens_per_s']:.0f} tok/s, decode {top['decode_tokens_per_s']:.0f} "
                     f"tok/s at batch {top['batch_size']}")
    return lines


def main() -> int:
    os.chdir(REPO)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from kiln.envelope import engine_version
    from kiln.manifest import load_manifest

    started = time.monotonic()
    if not (MODEL_DIR / "config.json").is_file():
        banner(f"generating the demo model into {MODEL_DIR.relative_to(REPO)}")
        from kiln.engine.toy import make_random_model

        make_random_model(MODEL_DIR, "llama-demo")
    version = engine_version(load_manifest(REPO / MANIFEST))
    store = f"file://{STORE_DIR}"
    port = free_port()
    base = f"http://127.0.0.1:{port}"

    banner(f"kiln up -f {MANIFEST} --store {store} --port {port}")
    proc = subprocess.Popen([sys.executable, "-m", "kiln", "up", "-f", MANIFEST, "--store", store,
                             "--port", str(port)])
    try:
        wait_ready(base, proc)
        from openai import OpenAI

        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        model = client.models.list().data[0].id
        banner(f"server ready after {time.monotonic() - started:.1f}s; model {model!r}")
        completion = client.completions.create(model=model, prompt="The kiln engine", max_tokens=16, temperature=0)
        print(f"completion: {'The kiln engine'!r} -> {completion.choices[0].text!r} "
              f"({completion.usage.completion_tokens} tokens, finish {completion.choices[0].finish_reason})")
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hello to the cluster."}], max_tokens=16,
            temperature=0,
        )
        print(f"chat: 'Say hello to the cluster.' -> {chat.choices[0].message.content!r} "
              f"({chat.usage.completion_tokens} tokens, finish {chat.choices[0].finish_reason})")
        banner("build report (engine.json)")
        for line in build_summary(version):
            print(line)
    finally:
        banner("stopping the server")
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        print(f"kiln up exited with {proc.returncode}")

    banner(f"kiln build -f {MANIFEST} --store {store}   (again)")
    again = subprocess.run([sys.executable, "-m", "kiln", "build", "-f", MANIFEST, "--store", store],
                           capture_output=True, text=True)
    print(again.stdout.strip())
    if again.returncode != 0 or f"cache hit: {version}" not in again.stdout:
        print(again.stderr, file=sys.stderr)
        return 1
    banner(f"demo done in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
