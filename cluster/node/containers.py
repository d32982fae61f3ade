"""One container of a pod: its process, its restarts and back-off, its probes, its reported state."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from kiln_cluster.node.fields import expand
from kiln_cluster.node.probes import ProbeState, run_probe
from kiln_cluster.node.sandbox import Sandbox, record_process

BACKOFF_START_S, BACKOFF_MAX_S = 10.0, 300.0  # the kubelet's crash-loop back-off


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _exit_code(returncode: int) -> int:
    return returncode if returncode >= 0 else 128 - returncode


@dataclass
class Container:
    spec: dict
    log_path: Path
    is_init: bool = False
    proc: subprocess.Popen | None = None
    restarts: int = 0
    state: dict = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: dict = field(default_factory=dict)
    backoff_until: float = 0.0
    backoff: float = BACKOFF_START_S
    started_mono: float = 0.0
    startup: ProbeState | None = None
    liveness: ProbeState | None = None
    readiness: ProbeState | None = None
    _reaped: subprocess.Popen | None = None  # the process whose exit is recorded

    @property
    def name(self) -> str:
        return self.spec["name"]

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def started(self) -> bool:
        return self.running and (self.startup is None or self.startup.result is True)

    @property
    def ready(self) -> bool:
        if not self.started:
            return False
        return self.readiness is None or self.readiness.result is True

    @property
    def terminated(self) -> dict | None:
        return self.state.get("terminated")

    def wait_with(self, reason: str, message: str) -> None:
        self.state = {"waiting": {"reason": reason, "message": message}}

    def start(self, sandbox: Sandbox, env: dict[str, str]) -> None:
        argv = [expand(a, env) for a in (self.spec.get("command") or []) + (self.spec.get("args") or [])]
        if not self.spec.get("command"):
            raise ValueError(f"container {self.name}: the node agent needs `command` (it has no image CMD)")
        prefix = sandbox.nsenter() + [f"--wd={self.spec.get('workingDir') or '/'}"]
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen([*prefix, "--", *argv], env=env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        record_process(sandbox.root, self.name, self.proc.pid)
        self.started_mono = time.monotonic()
        self.state = {"running": {"startedAt": now_rfc3339()}}
        if not self.is_init:
            self.startup, self.liveness, self.readiness = (
                ProbeState(p) if (p := self.spec.get(k)) else None
                for k in ("startupProbe", "livenessProbe", "readinessProbe"))

    def reap(self) -> bool:
        """Record the exit of a process that ended; True when it just ended."""
        if self.proc is None or self.proc.poll() is None or self.proc is self._reaped:
            return False
        self._reaped = self.proc
        code = _exit_code(self.proc.returncode)
        self.state = {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                     "startedAt": self.state.get("running", {}).get("startedAt"),
                                     "finishedAt": now_rfc3339(), "containerID": self.container_id}}
        return True

    @property
    def container_id(self) -> str:
        return f"kiln://{self.proc.pid}" if self.proc else ""

    def should_restart(self, policy: str) -> bool:
        term = self.terminated
        if term is None:
            return False
        return policy == "Always" or (policy == "OnFailure" and term["exitCode"] != 0)

    def schedule_restart(self) -> None:
        """Crash-loop back-off: the next start waits 10 s, doubling to 5 min (reset after 10 min running)."""
        ran = time.monotonic() - self.started_mono
        if ran > 600:
            self.backoff = BACKOFF_START_S
        self.last_state, self.restarts = self.state, self.restarts + 1
        self.backoff_until = time.monotonic() + self.backoff
        self.state = {"waiting": {"reason": "CrashLoopBackOff",
                                  "message": f"back-off {self.backoff:.0f}s restarting failed container"}}
        self.backoff = min(self.backoff * 2, BACKOFF_MAX_S)

    def run_probes(self, ip: str, nsenter: list[str]) -> str | None:
        """Run the probes that are due; returns why the container must be killed (a failed liveness or
        startup probe), else None."""
        now = time.monotonic()
        if self.startup and self.startup.result is not True:
            if self.startup.due(now):
                self.startup.record(run_probe(self.startup.probe, self.spec, ip, nsenter), now)
                if self.startup.result is False:
                    return "startup probe failed"
            return None
        for state in (self.liveness, self.readiness):
            if state and state.due(now):
                state.record(run_probe(state.probe, self.spec, ip, nsenter), now)
        if self.liveness and self.liveness.result is False:
            return "liveness probe failed"
        return None

    def stop(self, grace: float) -> None:
        if not self.running:
            return
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=max(grace, 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass
        try:  # whatever the main process left behind in its group goes with it
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def status(self, image_id: str) -> dict:
        return {"name": self.name, "image": self.spec.get("image", ""), "imageID": image_id,
                "containerID": self.container_id, "ready": self.ready, "started": self.started,
                "restartCount": self.restarts, "state": self.state, "lastState": self.last_state}
