"""Each pod's /etc/hosts, as the kubelet writes it, plus the names cluster DNS would give its peers.

A pod with ``hostname`` and ``subdomain`` (a StatefulSet's or a LeaderWorkerSet's, under a headless
Service) is reachable as ``hostname.subdomain.namespace.svc.cluster.local``; there is no cluster DNS here,
so every pod's hosts file lists its namespace's such names. The files are rewritten in place (their bind
mounts hold the inode), whenever a pod comes or goes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from pathlib import Path

DOMAIN = "svc.cluster.local"
HEADER = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"


def names(pod: dict) -> list[str]:
    """The names a pod answers to, most qualified first."""
    meta, spec = pod["metadata"], pod["spec"]
    host, sub, ns = spec.get("hostname") or meta["name"], spec.get("subdomain"), meta["namespace"]
    if not sub:
        return [host]
    return [f"{host}.{sub}.{ns}.{DOMAIN}", f"{host}.{sub}.{ns}.svc", f"{host}.{sub}.{ns}", f"{host}.{sub}", host]


def hosts_text(own: dict, own_ip: str, peers: Iterable[tuple[dict, str]]) -> str:
    lines = [HEADER, f"{own_ip}\t{' '.join(names(own))}\n"]
    ns = own["metadata"]["namespace"]
    for pod, ip in peers:
        if pod["metadata"]["uid"] != own["metadata"]["uid"] and pod["metadata"]["namespace"] == ns \
                and pod["spec"].get("subdomain"):
            lines.append(f"{ip}\t{' '.join(names(pod)[:-1])}\n")
    return "".join(lines)


class HostsBook:
    """Keeps every pod's hosts file current; ``pods`` lists (pod, ip) for the pods with an IP."""

    def __init__(self, root: Path, pods: Callable[[], list[tuple[dict, str]]]) -> None:
        self.root, self.pods = root, pods
        self._lock = threading.Lock()

    def file_for(self, uid: str) -> Path:
        path = self.root / "pods" / uid / "hosts"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
        return path

    def changed(self) -> None:
        with self._lock:
            pods = self.pods()
            for pod, ip in pods:
                path = self.file_for(pod["metadata"]["uid"])
                text = hosts_text(pod, ip, pods)
                if path.read_text() != text:
                    with path.open("r+") as f:  # in place: the pod's bind mount holds this inode
                        f.write(text)
                        f.truncate()
