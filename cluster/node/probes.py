"""Readiness, liveness and startup probes, run on the kubelet's schedule: httpGet and tcpSocket against
the pod's IP, exec inside the pod's namespaces."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field


def _port(probe_action: dict, container: dict) -> int:
    port = probe_action["port"]
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"probe port {port!r} names no port of container {container['name']}")


def run_probe(probe: dict, container: dict, ip: str, nsenter: list[str]) -> bool:
    timeout = probe.get("timeoutSeconds", 1)
    try:
        if "httpGet" in probe:
            h = probe["httpGet"]
            host = h.get("host") or ip
            url = f"{h.get('scheme', 'HTTP').lower()}://{host}:{_port(h, container)}{h.get('path', '/')}"
            req = urllib.request.Request(url, headers={x["name"]: x["value"] for x in h.get("httpHeaders") or []})
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return 200 <= resp.status < 400
        if "tcpSocket" in probe:
            with socket.create_connection((ip, _port(probe["tcpSocket"], container)), timeout=timeout):
                return True
        if "exec" in probe:
            done = subprocess.run([*nsenter, *probe["exec"]["command"]], capture_output=True, timeout=timeout)
            return done.returncode == 0
    except (OSError, urllib.error.URLError, subprocess.TimeoutExpired, ValueError):
        return False
    return False


@dataclass
class ProbeState:
    """One probe of one container: when it runs next and its consecutive results."""

    probe: dict
    started_at: float = field(default_factory=time.monotonic)
    next_at: float = 0.0
    successes: int = 0
    failures: int = 0
    result: bool | None = None

    def __post_init__(self) -> None:
        self.next_at = self.started_at + self.probe.get("initialDelaySeconds", 0)

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def record(self, ok: bool, now: float) -> None:
        self.next_at = now + self.probe.get("periodSeconds", 10)
        if ok:
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= self.probe.get("successThreshold", 1):
                self.result = True
        else:
            self.successes, self.failures = 0, self.failures + 1
            if self.failures >= self.probe.get("failureThreshold", 3):
                self.result = False
