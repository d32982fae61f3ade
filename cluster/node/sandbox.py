"""A pod's sandbox: its folder, its loopback IP, and one holder process that owns its namespaces.

The holder runs in the pod's network namespace (network.py) under ``unshare --mount --uts``: in its own
mount namespace it binds each volume at its mount path (and, where every container asks for it, remounts
the root read-only), sets the pod's hostname, then sleeps. Containers join its three namespaces with
``nsenter``, as containers join a pod's pause container.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Mount:
    source: Path
    target: str
    read_only: bool = False
    tmpfs: bool = False


@dataclass
class Sandbox:
    uid: str
    root: Path
    ip: str
    netns: str
    hostname: str
    mounts: list[Mount] = field(default_factory=list)
    read_only_root: bool = False
    # Host paths the pod's programs live in (the checkout, its virtual environment, the Python install): a
    # volume mounted over one of them (a pod's /tmp over a checkout under /tmp) would hide kiln itself, so
    # such a path is bound back on top of the volume, as an image's files would still be there.
    keep_visible: list[str] = field(default_factory=list)
    holder: subprocess.Popen | None = None

    @property
    def holder_pid(self) -> int:
        assert self.holder is not None
        return self.holder.pid

    def nsenter(self) -> list[str]:
        """The argv prefix that runs a command inside this pod."""
        pid = self.holder_pid
        return ["nsenter", f"--mount=/proc/{pid}/ns/mnt", f"--uts=/proc/{pid}/ns/uts", f"--net=/proc/{pid}/ns/net"]

    def start(self) -> None:
        """Start the holder and wait until its mounts are in place (raises with its stderr if they fail)."""
        for m in self.mounts:
            _ensure_mountpoint(m)
        KEEP.mkdir(exist_ok=True)
        script = self.root / "sandbox.sh"
        script.write_text("\n".join(self._script()) + "\n")
        self.holder = subprocess.Popen(
            ["nsenter", f"--net={self.netns}", "unshare", "--mount", "--uts", "--propagation", "private",
             "sh", str(script)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True)
        (self.root / "holder.pid").write_text(str(self.holder.pid))
        first = self.holder.stdout.readline() if self.holder.stdout else b""
        if first.strip() != b"ready":
            err = self.holder.stderr.read().decode(errors="replace") if self.holder.stderr else ""
            self.stop()
            raise RuntimeError(f"pod sandbox failed to mount its volumes: {err.strip() or 'no output'}")

    def _script(self) -> list[str]:
        """The holder's shell script. Every source is first bound under a private tmpfs (KEEP), then onto
        its target, parents before children: a volume mounted at /tmp cannot hide the sources of the
        volumes after it (or the programs) when the cluster's folder is itself under /tmp."""
        q = shlex.quote
        mounts = sorted(self.mounts, key=lambda m: m.target.rstrip("/").count("/"))
        shadowed = [p for p in self.keep_visible if any(_under(p, m.target) for m in mounts)]
        lines = ["set -e", f"hostname {q(self.hostname)}", f"mount -t tmpfs tmpfs {KEEP}"]
        for i, m in enumerate(mounts):
            if not m.tmpfs:
                make = "touch" if m.source.is_file() else "mkdir"
                lines.append(f"{make} {KEEP}/v{i} && mount --rbind {q(str(m.source))} {KEEP}/v{i}")
        lines += [f"mkdir {KEEP}/p{i} && mount --rbind {q(p)} {KEEP}/p{i}" for i, p in enumerate(shadowed)]
        if self.read_only_root:
            lines.append("mount -o remount,bind,ro /")
        for i, m in enumerate(mounts):
            t = q(m.target)
            if m.tmpfs:
                lines.append(f"[ -e {t} ] || mkdir -p {t}; mount -t tmpfs -o mode=1777 tmpfs {t}")
                continue
            make = "touch" if m.source.is_file() else "mkdir -p"
            lines.append(f"[ -e {t} ] || {make} {t}; mount --rbind {KEEP}/v{i} {t}")
            if m.read_only:
                lines.append(f"mount -o remount,bind,ro {t}")
        lines += [f"mkdir -p {q(p)} && mount --rbind {KEEP}/p{i} {q(p)}" for i, p in enumerate(shadowed)]
        return [*lines, "echo ready", "exec sleep infinity"]

    def stop(self) -> None:
        if self.holder is not None and self.holder.poll() is None:
            self.holder.kill()
            self.holder.wait()


KEEP = Path("/.kiln-keep")  # an empty folder on the host; each pod mounts its own tmpfs there


def _under(path: str, mount: str) -> bool:
    mount = mount.rstrip("/") or "/"
    return path == mount or path.startswith(mount + "/") or mount == "/"


def _ensure_mountpoint(m: Mount) -> None:
    """A bind needs its target to exist; the folder (or file) is made on the host, empty, as a mount point."""
    target = Path(m.target)
    if target.exists():
        return
    if m.source.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch()
    else:
        target.mkdir(parents=True, exist_ok=True)


class IpPool:
    """Pod numbers (network.py turns one into an IP and a namespace), lowest free first."""

    def __init__(self) -> None:
        self._used: set[int] = set()

    def take(self) -> int:
        n = next(n for n in range(1, 65000) if n not in self._used)
        self._used.add(n)
        return n

    def give_back(self, n: int) -> None:
        self._used.discard(n)


def record_process(pod_root: Path, name: str, pid: int) -> None:
    """Remember a container's process group, so a later agent (or `make cluster-down`) can end it."""
    path = pod_root / "pids.json"
    pids = json.loads(path.read_text()) if path.exists() else {}
    pids[name] = pid
    path.write_text(json.dumps(pids))


def kill_leftover_pods(node_root: Path) -> None:
    """End every process a previous agent left under ``node_root`` (containers, then holders)."""
    if not node_root.is_dir():
        return
    groups: list[int] = []
    for pod in node_root.glob("pods/*"):
        pids = pod / "pids.json"
        if pids.exists():
            groups += [int(p) for p in json.loads(pids.read_text()).values()]
        holder = pod / "holder.pid"
        if holder.exists():
            groups.append(int(holder.read_text()))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pgid in groups:
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        if sig == signal.SIGTERM and groups:
            time.sleep(2)
    for pod in node_root.glob("pods/*"):
        for name in ("pids.json", "holder.pid"):
            (pod / name).unlink(missing_ok=True)
