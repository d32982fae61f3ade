"""A port for a local server or rank group comes from below the kernel's ephemeral range, so no connection's source
port, and no peer dialling it before it listens (TCP self-connect), can take it first (a clean run's rank-0
rendezvous once failed with EADDRINUSE on a port of that range)."""

from __future__ import annotations

import socket

from kiln.engine import local_port


def test_ports_come_from_below_the_ephemeral_range_and_are_free(monkeypatch, tmp_path):
    low = local_port._ephemeral_low()
    ports = {local_port.free_local_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports) and len(ports) > 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))  # free when handed out
    with monkeypatch.context() as m:  # an unreadable range: IANA's dynamic range
        (tmp_path / "range").write_text("not numbers")
        m.setattr(local_port, "_RANGE_FILE", str(tmp_path / "range"))
        assert local_port._ephemeral_low() == 49152
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(local_port, "_rng", _Fixed(busy))
        monkeypatch.setattr(local_port, "_ephemeral_low", lambda: busy + 1)
        assert local_port.free_local_port() != busy  # every try taken: the kernel's choice


class _Fixed:
    def __init__(self, port: int) -> None:
        self.port = port

    def randrange(self, start: int, stop: int) -> int:
        return self.port
