"""The pod network: a bridge on the host and a network namespace per pod, joined to it by a veth pair.

Pod IPs cannot be loopback addresses: the apiserver refuses 127.0.0.0/8 in EndpointSlices and Endpoints
("may not be in the loopback range"). So each pod gets a namespace of its own, with ``eth0`` at
``10.<244+index>.x.y/16``, and the host is the bridge's gateway, ``10.<244+index>.0.1``: the apiserver and
the S3 server listen there, so the same address works from this machine and from pods. Nothing is routed
or NATed beyond the bridge: pods reach the host and each other, and nothing else.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

MAX_CLUSTERS = 8


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _exists(link: str) -> bool:
    return _ip("link", "show", link, check=False).returncode == 0


@dataclass(frozen=True)
class Network:
    index: int

    @property
    def bridge(self) -> str:
        return f"kiln{self.index}"

    @property
    def prefix(self) -> str:
        return f"10.{244 + self.index}"

    @property
    def gateway(self) -> str:
        return f"{self.prefix}.0.1"

    @classmethod
    def free(cls) -> Network:
        for i in range(MAX_CLUSTERS):
            if not _exists(f"kiln{i}"):
                return cls(i)
        raise RuntimeError(f"{MAX_CLUSTERS} kiln bridges exist (kiln0..): stop a cluster (make cluster-down)")

    def up(self) -> None:
        if not _exists(self.bridge):
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/16", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def down(self) -> None:
        for ns in self.namespaces():
            _ip("netns", "delete", ns, check=False)
        if _exists(self.bridge):
            _ip("link", "delete", self.bridge, check=False)

    def namespaces(self) -> list[str]:
        return [p.name for p in Path("/var/run/netns").glob(f"{self.bridge}-*")]

    def veth(self, n: int) -> str:
        """The host end of pod ``n``'s veth pair (its other end is the pod's eth0)."""
        return f"k{self.index}v{n}"

    def pod_ip(self, n: int) -> str:
        return f"{self.prefix}.{n // 254}.{n % 254 + 1}"

    def add_pod(self, n: int) -> tuple[str, str]:
        """A namespace with eth0 on the bridge for pod number ``n`` (>= 1): (its netns path, its IP)."""
        ns, veth, ip = f"{self.bridge}-{n}", self.veth(n), self.pod_ip(n)
        self.remove_pod(n)
        _ip("netns", "add", ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", veth, "master", self.bridge)
        _ip("link", "set", veth, "up")
        _ip("-n", ns, "addr", "add", f"{ip}/16", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "route", "add", "default", "via", self.gateway)
        return f"/var/run/netns/{ns}", ip

    def remove_pod(self, n: int) -> None:
        """Pod ``n``'s namespace and its veth pair. The pair goes by its host end: a namespace whose name is
        deleted lives on while a process of a run killed without its teardown (its sandbox) is still in it,
        and with it the pair, whose name the next run's pod ``n`` would then find taken."""
        _ip("netns", "delete", f"{self.bridge}-{n}", check=False)
        _ip("link", "delete", self.veth(n), check=False)
