"""Fixtures every suite shares: a moto S3 server over HTTP and small local models.

Component suites put their own fixtures in their folder's conftest.py; only
what several suites need lives here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from netutil import free_port, wait_for_port

# Keep torch to the machine's 2 cores and quiet; tests spawn servers too.
if os.environ.get("PYTEST_XDIST_WORKER"):  # make test: two workers share the cores, one OpenMP thread each
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # (set before torch loads; children inherit it)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Without a CUDA device the Triton kernels run under Triton's interpreter, and it must be on before any module
# defines a @triton.jit function (a kernel module imported earlier would compile-mode its helpers, and the
# interpreted kernels calling them fail), whichever test file a worker happens to import first.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The longest modules, run first: under pytest-xdist (make test) whole files go to the workers in collection
# order, so a long file collected late would be the suite's tail while the other worker idles.
LONG_MODULES = ("tests/engine/test_aot_compile.py", "tests/serving/test_fuzz.py", "tests/bench/test_bench.py")


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {name: i for i, name in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep order


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server as a real process on 127.0.0.1; AWS variables point at it.

    boto3 reads AWS_ENDPOINT_URL_S3, so every client in this process and in any
    subprocess a test starts (builder, server) talks to this endpoint.
    """
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, proc=proc)
        url = f"http://127.0.0.1:{port}"
        env = {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL_S3": url,
        }
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        yield url
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """A fresh, empty bucket on the moto server."""
    import boto3

    name = f"kiln-test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def toy_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``toy_model("llama-tiny", seed=0, **overrides)`` -> a checkpoint dir, made once per session."""
    made: dict[tuple, Path] = {}

    def make(preset: str = "llama-tiny", seed: int = 0, dtype: str = "float32", **overrides) -> Path:
        from kiln.engine.random_checkpoint import make_random_model

        key = (preset, seed, dtype, tuple(sorted(overrides.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"model-{preset}")
            made[key] = make_random_model(out, preset, seed=seed, dtype=dtype, **overrides)
        return made[key]

    return make
