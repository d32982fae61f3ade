"""`kiln serve`, as `kiln up` starts it (``--verify-key``, ``--api-key-file``): a key file it cannot use is refused
before anything binds, in one line naming the flag and the fix, not by a server that opened its port first (and
answered /health) only to fail every load."""

from __future__ import annotations

import subprocess
import sys

import pytest
from netutil import free_port


def serve(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    uri = f"file://{tmp_path / 'store'}/engines/never-built"
    return subprocess.run([sys.executable, "-m", "kiln", "serve", "--artifact", uri, "--port", str(free_port()),
                           "--cache-dir", str(tmp_path / "cache"), *flags],
                          capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize(("content", "said"), [
    (None, "cannot read the public key (No such file or directory)"),
    (b"not a key\n", "not a PEM public key"),
])
def test_a_verify_key_it_cannot_use_is_refused_before_the_port_opens(tmp_path, content, said):
    key = tmp_path / "verify.pem"
    if content is not None:
        key.write_bytes(content)
    proc = serve(tmp_path, "--verify-key", str(key))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    assert f"--verify-key {key}: {said}" in proc.stderr
    assert "Uvicorn running" not in output and "startup" not in output.lower()  # nothing bound, nothing served
    assert "Traceback" not in output


def test_an_api_key_file_it_cannot_read_is_a_usage_error(tmp_path):
    key = tmp_path / "api-key"
    key.write_bytes(b"\xff\xfe\x00not text")
    proc = serve(tmp_path, "--api-key-file", str(key))
    assert proc.returncode == 2, proc.stderr
    assert f"--api-key-file {key}: cannot read it" in proc.stderr and "Traceback" not in proc.stderr
