"""Ports and readiness for tests that start real servers on 127.0.0.1.

``tests/`` is on sys.path (its conftest.py is there), so any suite can
``from netutil import free_port, wait_for_port``.
"""

from __future__ import annotations

import socket
import subprocess
import time

from kiln.engine.local_port import free_local_port


def free_port() -> int:
    """A free port for a server the test starts (kiln.engine.local_port: below the ephemeral range)."""
    return free_local_port()


def wait_for_port(port: int, timeout: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")
