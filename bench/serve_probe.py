"""A ``kiln serve`` process for the start-up and contention benchmarks: start it, time it to ``/ready``,
read ``/version``, drive it with a small streaming completions load, and run busy neighbours beside it.

No aiperf here (``server.py`` uses it for the peer comparison): these runs need only output tokens per
second of one server at a time, on hosts with no network, so the client is a few lines of httpx.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

NEIGHBOUR = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


def kiln_exe() -> str:
    return str(Path(sys.executable).with_name("kiln"))


class Served:
    """One ``kiln serve --model`` process; ``ready_s`` is the time from spawn to ``/ready`` 200."""

    def __init__(self, model_dir: Path, port: int, log: Path, env: dict[str, str] | None = None,
                 args: list[str] | None = None) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        cmd = [kiln_exe(), "serve", "--model", str(model_dir), "--port", str(port), *(args or [])]
        self.started = time.monotonic()
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=out,
                                         stderr=subprocess.STDOUT)
        self.ready_s: float | None = None

    def wait_ready(self, timeout: float = 300.0) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kiln serve exited with {self.proc.returncode}: {self.log.read_text()[-1500:]}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    self.ready_s = time.monotonic() - self.started
                    return self.ready_s
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"kiln serve was not ready after {timeout:.0f}s (log: {self.log})")

    def version(self) -> dict:
        return httpx.get(self.url + "/version", timeout=10).json()

    def wait_tactics(self, timeout: float = 180.0) -> dict | None:
        """/version's tactics once the table timed after /ready is swapped in (the engine loop ticks while idle)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.version().get("tactics") or {}
            if info.get("origin") != "default-until-timed":
                return info
            time.sleep(0.2)
        return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
               streamed: list[int]) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:]).get("choices"):
                streamed[0] += 1  # one chunk per token (ignore_eos, no stop strings)


async def _load(url: str, requests: int, concurrency: int, max_tokens: int, prompt_words: int,
                deadline_s: float) -> dict:
    streamed = [0]
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        sem = asyncio.Semaphore(concurrency)

        async def run(i: int) -> None:
            async with sem:
                prompt = " ".join(f"word{(i * 7 + j) % 97}" for j in range(prompt_words))
                await _one(client, url, model, prompt, max_tokens, streamed)

        t0 = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.gather(*(run(i) for i in range(requests))), deadline_s)
            cut = False
        except TimeoutError:  # a pathological case: its rate so far is the figure
            cut = True
        wall = time.monotonic() - t0
    return {"out_tokens": streamed[0], "seconds": round(wall, 3), "out_tok_s": round(streamed[0] / wall, 2),
            "cut_at_deadline": cut}


def drive(url: str, requests: int = 8, concurrency: int = 4, max_tokens: int = 96, prompt_words: int = 32,
          deadline_s: float = 60.0) -> dict:
    """``requests`` streaming completions, ``concurrency`` at a time: output tokens per second (tokens streamed
    by ``deadline_s`` when it takes longer)."""
    return asyncio.run(_load(url, requests, concurrency, max_tokens, prompt_words, deadline_s))


@contextmanager
def neighbours(count: int, seconds: float = 600.0):
    """``count`` busy lowest-priority (nice 19) Python loops beside the server; killed on exit (and each
    ends by itself after ``seconds``)."""
    procs = [subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", NEIGHBOUR.format(seconds=seconds)])
             for _ in range(count)]
    try:
        time.sleep(0.5 if count else 0)
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"
