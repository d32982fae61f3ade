"""Whether a server can listen on ``--host``/``--port`` now: asked before ``kiln serve`` loads a model and before
``kiln up`` builds one, so a busy port is one line naming the flag within a second, not a bind error after
minutes of loading. Binds as uvicorn does (``uvicorn.Config.bind_socket``: IPv6 where the host has a ':',
SO_REUSEADDR) and lets go at once. Plain Python: no torch."""

from __future__ import annotations

import errno
import socket


def listen_problem(host: str, port: int) -> str | None:
    """None where ``host:port`` can be listened on now (port 0: where the host is this host's, the kernel picks a
    port); else one line that names the flag at fault and the fix."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host.strip("[]"), port))
    except socket.gaierror as exc:
        return f"--host {host}: not an address this host resolves ({exc.strerror}); use an IP of this host or 0.0.0.0"
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return (f"--port {port}: {host}:{port} is already in use by another process; stop it or pick another "
                    "--port (0 takes a free one)")
        if exc.errno == errno.EACCES:
            return f"--port {port}: ports below 1024 need privileges here; pick one from 1024 up"
        if exc.errno == errno.EADDRNOTAVAIL:
            return f"--host {host}: not an address of this host; use one of its IPs, 127.0.0.1 or 0.0.0.0"
        return f"--host {host} --port {port}: cannot listen there ({exc.strerror})"
    return None
