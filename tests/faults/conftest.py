"""The fault suite's tools: a TCP proxy in front of moto that can cut the store off, and kiln processes
stopped at exact points (faulty_kiln.py) so that a test can SIGKILL them there.

Every fault test measures three things and prints them (``-s`` shows them; the report is in the test's
docstring): what the user saw (exit code, HTTP status, message), the seconds from the fault's removal to
working again, and what was lost (must be nothing).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FAULTY_KILN = HERE / "faulty_kiln.py"


def measured(fault: str, **facts) -> None:
    """One line per fault on stdout (``pytest -s``): what the user saw, time to recover, what was lost."""
    print(f"\nFAULT {fault}: " + json.dumps(facts, default=str))


# -- a store that can be cut off ----------------------------------------------------------------------------
class TcpProxy:
    """Forwards 127.0.0.1:<port> to ``upstream``; ``cut()`` makes the port refuse connections and resets every
    open one (the store unreachable: a partition, the store's node gone), ``restore()`` listens again on the
    same port. ``arm(up=N)`` / ``arm(down=N)``: cut by itself once N bytes went to / came from the upstream
    (mid-upload, mid-download); ``arm(down=N, stall=True)``: stop forwarding there instead (a hung store)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self.up = self.down = 0
        self.cut_after_up: int | None = None
        self.cut_after_down: int | None = None
        self.cut_at: float | None = None
        self.stall = False
        self.stalled = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.restore()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def arm(self, up: int | None = None, down: int | None = None, stall: bool = False) -> None:
        with self._lock:
            self.up = self.down = 0
            self.cut_after_up, self.cut_after_down, self.stall = up, down, stall

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        self.cut_at = None
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            if self._listener is None:
                return
            self.cut_at = time.monotonic()
            self.cut_after_up = self.cut_after_down = None
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, set()
        _close(listener)
        for conn in conns:
            try:  # a reset, not a clean close: what a client sees when the store's node vanishes
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            except OSError:
                pass  # that connection had already ended
            _close(conn)

    @property
    def is_cut(self) -> bool:
        return self._listener is None

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                _close(client)
                continue
            with self._lock:
                if self._listener is not listener:
                    _close(client)
                    _close(upstream)
                    return
                self._conns.update((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream, "up"), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, "down"), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        while True:
            try:
                data = src.recv(16384)
            except OSError:
                data = b""
            if not data:
                _close(dst)
                _close(src)
                return
            with self._lock:
                if direction == "up":
                    self.up += len(data)
                    trip = self.cut_after_up is not None and self.up >= self.cut_after_up
                else:
                    self.down += len(data)
                    trip = self.cut_after_down is not None and self.down >= self.cut_after_down
            if trip and self.stall:
                self.stalled.set()
                return  # nothing more is forwarded on this connection: the client waits until it is killed
            if trip:
                self.cut()
                return
            try:
                dst.sendall(data)
            except OSError:
                _close(src)
                return


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


@dataclass
class ProxiedStore:
    """An S3 store on moto reached through a proxy (``uri``) and directly (``direct``, for the checks)."""

    bucket: str
    proxy: TcpProxy
    direct_uri: str

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/kiln?endpoint_url={self.proxy.url}"

    @property
    def direct(self):
        from kiln.artifacts import ArtifactStore

        return ArtifactStore.from_uri(self.direct_uri)

    def keys(self) -> list[str]:
        import boto3

        client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL_S3"])
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


@pytest.fixture
def proxied_store(s3_bucket: str, s3_endpoint: str) -> Iterator[ProxiedStore]:
    proxy = TcpProxy(int(s3_endpoint.rpartition(":")[2]))
    yield ProxiedStore(s3_bucket, proxy, f"s3://{s3_bucket}/kiln")
    proxy.cut()


# -- manifests and kiln processes ----------------------------------------------------------------------------
def manifest_dict(source: str, name: str = "tiny", **spec) -> dict:
    base = {"model": {"source": source}, "gpu": "cpu", "dtype": "float32", "quantization": "none",
            "maxBatchSize": 4, "maxInputLen": 128, "maxSeqLen": 256, "maxNumTokens": 128, **spec}
    return {"apiVersion": "serving.kiln.dev/v1alpha1", "kind": "LLMEngine", "metadata": {"name": name},
            "spec": base}


@pytest.fixture
def toy_manifest(toy_model, tmp_path: Path) -> tuple[Path, str]:
    """A small CPU build of llama-tiny: (manifest path, its engine version)."""
    from kiln.envelope import engine_version
    from kiln.manifest import load_manifest

    path = tmp_path / "manifest.yaml"
    path.write_text(yaml.safe_dump(manifest_dict(f"file://{toy_model('llama-tiny')}")))
    return path, engine_version(load_manifest(path))


def child_env(**extra: str | None) -> dict[str, str]:
    merged = {**os.environ, "OMP_NUM_THREADS": "1", "KILN_TERMINATION_LOG": os.devnull, **extra}
    return {k: v for k, v in merged.items() if v is not None}


@dataclass
class Finished:
    code: int
    seconds: float
    log: str


def kiln(*args: str, log: Path, env: dict[str, str | None] | None = None, timeout: float = 300) -> Finished:
    """``python -m kiln ARGS`` to the end; its output in ``log`` (and returned)."""
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.run([sys.executable, "-P", "-m", "kiln", *args], stdout=out, stderr=subprocess.STDOUT,
                              env=child_env(**(env or {})), cwd=REPO, timeout=timeout)
    return Finished(proc.returncode, time.monotonic() - started, log.read_text(errors="replace"))


class Paused:
    """``faulty_kiln.py ARGS`` run until it reaches ``point`` (then it waits there to be killed)."""

    def __init__(self, point: str, *args: str, folder: Path, env: dict[str, str | None] | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("paused", "resume"):
            (folder / name).unlink(missing_ok=True)
        self.folder, self.point, self.log_path = folder, point, folder / "kiln.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(
            [sys.executable, "-P", str(FAULTY_KILN), *args], stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO,
            env=child_env(KILN_FAULT_PAUSE=point, KILN_FAULT_DIR=str(folder), **(env or {})))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_paused(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not (self.folder / "paused").exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"exited {self.proc.returncode} before {self.point}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"never reached {self.point} in {timeout}s:\n{self.log()}")
            time.sleep(0.05)

    def resume(self) -> None:
        (self.folder / "resume").write_text("")

    def kill9(self) -> int:
        self.proc.send_signal(signal.SIGKILL)
        return self.wait(30)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
            self._log.close()


# -- a small artifact made without a build (seconds, not a build's tens of seconds) ----------------------------
def make_artifact_dir(model_dir: Path, dest: Path, version: str, padding_bytes: int = 0) -> Path:
    """An engine directory ``kiln serve --artifact`` loads: llama-tiny's files, its rank file, engine.json;
    ``padding_bytes`` of extra data make the download long enough to cut in the middle."""
    from kiln.engine.artifact import FORMAT_VERSION, save_rank_weights, shard_checkpoint

    dest.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dest / f.name)
    save_rank_weights(shard_checkpoint(model_dir, 1, "float32", None), dest / "weights")
    if padding_bytes:
        (dest / "padding.bin").write_bytes(os.urandom(padding_bytes))
    (dest / "engine.json").write_text(json.dumps({
        "format_version": FORMAT_VERSION, "engine_version": version, "kiln_version": "0.1.0",
        "gpu": {"sku": "cpu", "arch": "cpu"},
        "engine_config": {"dtype": "float32", "quantization": "none", "tensor_parallel_size": 1,
                          "max_batch_size": 4, "max_num_tokens": 64, "max_seq_len": 256, "max_input_len": 128,
                          "block_size": 16, "num_kv_blocks": 64},
        "tuning": {"torch_num_threads": 1},
    }))
    return dest


def fresh_version(prefix: str = "tiny") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def wait_until(predicate: Callable[[], bool], timeout: float, step: float = 0.05) -> float:
    """Seconds until ``predicate()`` held; raises after ``timeout``."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"not true after {timeout}s")
        time.sleep(step)
    return time.monotonic() - started
