"""llama.cpp as the baseline of GGUF models: the same file, one request (``decode``) and many (``serve``).

llama.cpp runs from its own environment (``<work>/llamacpp-venv``: ``python3 -m venv`` and ``pip install
llama-cpp-python[server]``, which compiles llama.cpp from the registry's source package: minutes, on
``$CMAKE_BUILD_PARALLEL_LEVEL`` cores), made only when asked (``--make-env``; never in ``make test``). Its
runner (``peer_llamacpp.py``) imports nothing of kiln. kiln runs the same GGUF as a ``quantization: gguf``
engine (the checkpoint directory and per-rank weights a build's fetch and shard stages write).

    python -P -m kiln_bench.llamacpp decode --gguf F.gguf --kiln-ckpt DIR --kiln-weights DIR [--make-env]
    python -P -m kiln_bench.llamacpp serve --gguf F.gguf --artifact URI [--concurrency 16]

One compute thread each; kiln and llama.cpp alternate, the medians are reported. ``serve`` runs
``kiln serve --artifact`` (a ``quantization: gguf`` engine of the same file, whose default threads leave the
server one core) and ``python -m llama_cpp.server --n_threads 1`` in turn, each under the same requests
(greedy, EOS masked by ``logit_bias`` so every request makes its tokens), many at once and one at a time.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click

RUNNER = Path(__file__).with_name("peer_llamacpp.py")
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. Once upon a time"


def default_env() -> Path:
    return (Path(os.environ.get("KILN_WORK", ".kiln-work")) / "llamacpp-venv").absolute()  # servers run elsewhere


def ensure_env(env: Path, make: bool) -> Path:
    """The environment's interpreter; created (llama.cpp compiled) when ``make`` and missing."""
    python = env / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-P", "-c", "import llama_cpp"], capture_output=True).returncode == 0:
        return python
    if not make:
        raise click.ClickException(f"no llama.cpp environment at {env}; pass --make-env to build it (minutes)")
    # -P: run from the repository, the working directory's packages (kiln's operator/) would shadow the stdlib's
    subprocess.run([sys.executable, "-P", "-m", "venv", str(env)], check=True)
    subprocess.run([str(python), "-P", "-m", "pip", "install", "llama-cpp-python[server]"], check=True,
                   env={**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL",
                                                                                     str(os.cpu_count() or 2))})
    return python


def llamacpp_decode(python: Path, gguf: Path, tokens: int, threads: int) -> float:
    cfg = {"mode": "decode", "model": str(gguf), "threads": threads, "prompt": PROMPT, "tokens": tokens, "repeats": 3}
    out = subprocess.run([str(python), str(RUNNER), json.dumps(cfg)], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return json.loads(out.stdout.strip().splitlines()[-1])["decode_tok_s"]


def kiln_decode(llm, tokens: int) -> float:
    from kiln.engine import SamplingParams

    def run(n: int) -> float:
        t0 = time.perf_counter()
        llm.generate([PROMPT], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - t0

    run(4)
    rates = sorted(tokens / (run(tokens + 1) - run(1)) for _ in range(3))
    return rates[1]


@click.group()
def main() -> None:
    """llama.cpp vs kiln on one GGUF file."""


@main.command()
@click.option("--gguf", type=click.Path(exists=True, path_type=Path), required=True)
@click.option("--kiln-ckpt", type=click.Path(exists=True, path_type=Path), required=True)
@click.option("--kiln-weights", type=click.Path(exists=True, path_type=Path), required=True)
@click.option("--tokens", default=64, show_default=True)
@click.option("--rounds", default=3, show_default=True)
@click.option("--env", type=click.Path(path_type=Path), default=None, help="llama.cpp's environment")
@click.option("--make-env", is_flag=True, help="create the llama.cpp environment if missing (compiles llama.cpp)")
def decode(gguf, kiln_ckpt, kiln_weights, tokens, rounds, env, make_env) -> None:
    """One request, one thread: decode tokens/s of each, interleaved rounds, medians."""
    import torch
    from kiln.engine import LLM

    python = ensure_env(env or default_env(), make_env)
    torch.set_num_threads(1)
    llm = LLM(str(kiln_ckpt), weights_dir=str(kiln_weights), quantization="gguf", dtype="float32",
              max_num_tokens=512, max_batch_size=16, max_seq_len=1024)
    click.echo(json.dumps(decode_rounds(python, llm, gguf, tokens, rounds, click.echo), indent=1))


def decode_rounds(python: Path, llm, gguf: Path, tokens: int, rounds: int, say) -> dict:
    """One request, one thread, kiln's ``llm`` and llama.cpp alternating ``rounds`` times: medians."""
    kiln, peer = [], []
    for _ in range(rounds):
        kiln.append(kiln_decode(llm, tokens))
        peer.append(llamacpp_decode(python, gguf, tokens, 1))
        say(f"round: kiln {kiln[-1]:.1f} tok/s, llama.cpp {peer[-1]:.1f} tok/s")
    doc = {"gguf": str(gguf), "kiln_decode_tok_s": statistics.median(kiln),
           "llamacpp_decode_tok_s": statistics.median(peer), "kiln_rounds": kiln, "llamacpp_rounds": peer}
    doc["ratio"] = doc["kiln_decode_tok_s"] / doc["llamacpp_decode_tok_s"]
    return doc


def _wait(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise click.ClickException(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise click.ClickException(f"{url} was not ready in {timeout:.0f}s")


def _load(url: str, requests: int, concurrency: int, tokens: int) -> float:
    """Output tokens/s of ``requests`` completions of ``tokens`` each, ``concurrency`` at a time."""
    import asyncio

    import httpx

    body = {"model": "model", "max_tokens": tokens, "temperature": 0,
            "logit_bias": {str(t): -100 for t in (0, 1, 2)}}  # no end of text: every request makes its tokens

    async def run() -> float:
        sem = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(timeout=600) as client:
            async def one(i: int) -> int:
                async with sem:
                    r = await client.post(f"{url}/v1/completions", json={**body, "prompt": f"{PROMPT} ({i})"})
                    r.raise_for_status()
                    return r.json()["usage"]["completion_tokens"]
            await one(-1)  # warm up
            t0 = time.perf_counter()
            made = await asyncio.gather(*(one(i) for i in range(requests)))
            return sum(made) / (time.perf_counter() - t0)

    return asyncio.run(run())


@main.command()
@click.option("--gguf", type=click.Path(exists=True, path_type=Path), required=True)
@click.option("--artifact", required=True, help="the kiln engine of the same file (quantization: gguf)")
@click.option("--concurrency", default=16, show_default=True)
@click.option("--tokens", default=64, show_default=True)
@click.option("--rounds", default=2, show_default=True)
@click.option("--env", type=click.Path(path_type=Path), default=None, help="llama.cpp's environment")
@click.option("--make-env", is_flag=True, help="create the llama.cpp environment if missing (compiles llama.cpp)")
def serve(gguf, artifact, concurrency, tokens, rounds, env, make_env) -> None:
    """Both servers over HTTP, in turn: out tok/s at --concurrency and at 1, medians of the rounds."""
    python = ensure_env(env or default_env(), make_env)
    click.echo(json.dumps(serve_rounds(python, gguf, artifact, concurrency, tokens, rounds, click.echo), indent=1))


def serve_rounds(python: Path, gguf: Path, artifact: str, concurrency: int, tokens: int, rounds: int, say) -> dict:
    """``kiln serve --artifact`` and ``llama_cpp.server`` on the same file, in turn ``rounds`` times: output
    tok/s at ``concurrency`` and at 1, medians."""
    servers = {
        "kiln": ([sys.executable, "-P", "-m", "kiln", "serve", "--artifact", artifact, "--port", "18801",
                  "--served-model-name", "model"], "http://127.0.0.1:18801", "/ready", None),
        "llama.cpp": ([str(python), "-P", "-m", "llama_cpp.server", "--model", str(gguf.absolute()), "--n_threads",
                       "1", "--n_ctx", "4096", "--port", "18802"], "http://127.0.0.1:18802", "/v1/models", "/tmp"),
    }
    rates: dict[str, dict[int, list[float]]] = {name: {concurrency: [], 1: []} for name in servers}
    for _ in range(rounds):
        for name, (cmd, url, probe, cwd) in servers.items():
            proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                _wait(url + probe, proc)
                for c in (concurrency, 1):
                    rates[name][c].append(_load(url, concurrency if c > 1 else 4, c, tokens))
                say(f"round: {name} {rates[name][concurrency][-1]:.1f} tok/s at {concurrency}, "
                    f"{rates[name][1][-1]:.1f} at 1")
            finally:
                proc.terminate()
                proc.wait(60)
    doc = {name: {f"c{c}": statistics.median(v) for c, v in by_c.items()} for name, by_c in rates.items()}
    for c in (concurrency, 1):
        doc[f"ratio_c{c}"] = doc["kiln"][f"c{c}"] / doc["llama.cpp"][f"c{c}"]
    return doc


MANIFEST = """apiVersion: serving.kiln.dev/v1alpha1
kind: LLMEngine
metadata: {{name: bench-gguf}}
spec:
  model: {{source: "file://{path}", revision: "{sha}"}}
  gpu: cpu
  dtype: float32
  quantization: gguf
  maxBatchSize: 16
  maxInputLen: 1024
  maxSeqLen: 2048
  maxNumTokens: 1024
"""


def write_manifest(gguf: Path, dest: Path) -> Path:
    """The LLMEngine manifest of ``gguf`` as a ``quantization: gguf`` CPU engine (its sha256 pinned, as the
    build checks it)."""
    from kiln.artifact_manifest import file_sha256

    dest.write_text(MANIFEST.format(path=gguf.resolve(), sha=file_sha256(gguf)))
    return dest


def build_artifact(gguf: Path, store: Path, say) -> Path:
    """The ``quantization: gguf`` engine of ``gguf``, built by ``kiln build`` into the local ``store`` (a cache
    hit when built before): its directory."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kiln-bench-gguf-") as work:
        manifest = write_manifest(gguf, Path(work) / "engine.yaml")
        say(f"building {gguf.name} as a quantization: gguf engine into {store} ...")
        out = subprocess.run([sys.executable, "-P", "-m", "kiln", "build", "-f", str(manifest), "--store",
                              f"file://{store.resolve()}"], capture_output=True, text=True)
    if out.returncode != 0:
        raise click.ClickException(f"kiln build of {gguf} failed:\n{(out.stdout + out.stderr)[-2000:]}")
    uri = next(line.split(":", 1)[1].strip() for line in out.stdout.splitlines() if line.startswith("artifact:"))
    return Path(uri.removeprefix("file://"))


def compare(gguf: Path, concurrency: int, tokens: int, repeats: int, say) -> dict:
    """``kiln bench --gguf``: kiln against llama.cpp on the same GGUF file, one request (decode tok/s, one
    thread each, interleaved) and ``concurrency`` over HTTP (each server in turn); llama.cpp's environment is
    made on first use (it compiles llama.cpp: minutes)."""
    import torch
    from kiln.engine import LLM

    python = ensure_env(default_env(), make=True)
    artifact = build_artifact(gguf, default_env().parent / "bench-store", say)
    torch.set_num_threads(1)
    llm = LLM.from_artifact(artifact)
    try:
        one = decode_rounds(python, llm, gguf, tokens, repeats, say)
    finally:
        llm.shutdown()
    many = serve_rounds(python, gguf, f"file://{artifact}", concurrency, tokens, repeats, say)
    return {"gguf": str(gguf), "artifact": str(artifact), "one_request": one, "served": many}


def text(doc: dict) -> str:
    one, many = doc["one_request"], doc["served"]
    c = next(k for k in many["kiln"] if k != "c1")
    rows = [f"kiln vs llama.cpp on {Path(doc['gguf']).name} (one thread each; medians of interleaved rounds)",
            "| case | kiln | llama.cpp | kiln / llama.cpp |", "|---|---:|---:|---:|",
            f"| one request, decode tok/s | {one['kiln_decode_tok_s']:.1f} | {one['llamacpp_decode_tok_s']:.1f} | "
            f"{one['ratio']:.2f} |"]
    for key in (c, "c1"):
        rows.append(f"| served, {key[1:]} concurrent, out tok/s | {many['kiln'][key]:.1f} | "
                    f"{many['llama.cpp'][key]:.1f} | {many[f'ratio_{key}']:.2f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
