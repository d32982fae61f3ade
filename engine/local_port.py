"""A free TCP port on this host for a server or a rank group that something else will connect to.

Binding port 0 gives a port of the kernel's ephemeral range, the one it also hands out as connections' source
ports. Between choosing that port and listening on it, another connection may take it as its source port, or a
peer that retries connecting before the listener is up can connect to itself (TCP self-connect: source port equal
to the port it dials, which only happens inside that range) and hold it: the listener then fails with EADDRINUSE.
A free port below the ephemeral range has neither race. Plain Python: no torch.
"""

from __future__ import annotations

import random
import socket

_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"  # Linux; elsewhere IANA's dynamic range starts at 49152
_rng = random.Random()  # its own: a caller's random.seed() must not make two processes pick one port


def _ephemeral_low() -> int:
    try:
        with open(_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def free_local_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at ``host``, below the ephemeral range where it can (else the kernel's choice)."""
    low = _ephemeral_low()
    if low > 4096:
        for _ in range(200):
            port = _rng.randrange(max(1024, low - 12000), low)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
