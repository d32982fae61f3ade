"""`kiln serve` as a real process on 127.0.0.1, plus the offline engine to compare with.

One default server is shared by the whole serving suite (package scope): it
takes seconds to import torch and load even a tiny model on a busy machine.
Suites that need other flags (auth, tiny queue, SIGTERM) start their own.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from netutil import free_port

MODEL_NAME = "tiny"
# Small limits so over-limit inputs are cheap to send.
DEFAULT_FLAGS = ["--max-seq-len", "256", "--max-input-len", "128", "--num-kv-blocks", "256"]



class Server:
    """A `kiln serve` subprocess; its log goes to a file (a full pipe would block it)."""

    def __init__(self, source: list[str], log_path: Path, *flags: str,
                 env: dict[str, str | None] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "kiln", "serve", *source, "--port", str(self.port),
               "--served-model-name", MODEL_NAME, *flags]
        # One torch thread per server: the suite runs on two shared cores. A None value unsets a variable;
        # settings the server reads from the environment are unset unless a test passes them.
        isolated = dict.fromkeys(("KILN_API_KEY", "KILN_CACHE_DIR", "KILN_MAX_QUEUE_LEN",
                                  "KILN_DRAIN_TIMEOUT_SECONDS", "KILN_SERVED_MODEL_NAME", "KILN_EXPECT_ARTIFACT",
                                  "KILN_MAX_CONNECTIONS", "KILN_VERIFY_KEY", "KILN_GRAMMAR_COMPILE_TIMEOUT_S",
                                  "KILN_GRAMMAR_COMPILE_THREADS", "KILN_GRAMMAR_COMPILE_QUEUE"))
        merged = {**os.environ, **isolated, "OMP_NUM_THREADS": "1", **(env or {})}
        full_env = {k: v for k, v in merged.items() if v is not None}
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_listening(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.02)
        raise TimeoutError(f"server not listening after {timeout}s:\n{self.log()}")

    def wait_ready(self, timeout: float = 120.0) -> None:
        self.wait_listening(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            if httpx.get(f"{self.url}/ready", timeout=5).status_code == 200:
                return
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="package")
def model_dir(toy_model: Callable[..., Path]) -> Path:
    return toy_model("llama-tiny")


@pytest.fixture(scope="package")
def start_server(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., Server]]:
    """``start_server(*flags, env=None, source=None)`` -> a started (not ready) server, stopped at the end.

    ``source`` defaults to ``["--model", <llama-tiny>]``; pass ``["--artifact", uri]`` to serve an artifact.
    """
    servers: list[Server] = []

    def start(
        *flags: str, env: dict[str, str | None] | None = None, source: list[str] | None = None
    ) -> Server:
        log_path = tmp_path_factory.mktemp("serve") / "server.log"
        server = Server(source or ["--model", str(model_dir)], log_path, *flags, env=env)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="package")
def server(start_server: Callable[..., Server]) -> Server:
    """The shared default server, ready."""
    srv = start_server(*DEFAULT_FLAGS)
    srv.wait_ready()
    return srv


@pytest.fixture(scope="package")
def offline(model_dir: Path):
    """The offline engine on the same checkpoint and limits: the reference outputs."""
    from kiln.engine import LLM

    llm = LLM(model_dir, max_seq_len=256, max_input_len=128, num_kv_blocks=256)
    yield llm
    llm.shutdown()


def metric_values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus exposition, keyed by (name, sorted labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            values[(sample.name, labels)] = sample.value
    return values


@pytest.fixture(scope="package")
def scrape() -> Callable[[str], dict]:
    """``scrape(url)`` -> {(sample name, labels without model_name): value}, via prometheus' parser."""

    def get(url: str) -> dict:
        response = httpx.get(f"{url}/metrics", timeout=10)
        assert response.status_code == 200
        return metric_values(response.text)

    return get


def engine_stats(**fields: object) -> object:
    """An engine's ``stats()`` (``kiln.engine.outputs.EngineStats``), zero but for ``fields``: what a fake engine
    answers a server's /metrics with."""
    from kiln.engine.outputs import EngineStats

    zero = dict(num_running=0, num_waiting=0, kv_usage=0.0, num_free_blocks=0, num_total_blocks=0,
                prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0, num_steps=0, num_computed_tokens=0,
                num_generated_tokens=0, sum_running=0, sum_kv_usage=0.0)
    return EngineStats(**{**zero, **fields})
