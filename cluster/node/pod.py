"""One pod on the node: a thread that sets up its sandbox and volumes, runs its init containers in order,
then its containers, supervises them (restarts, probes, volume refresh) and tears it all down on delete."""

from __future__ import annotations

import logging
import threading
import time
import traceback
from typing import TYPE_CHECKING

from kiln_cluster.node.containers import Container, now_rfc3339
from kiln_cluster.node.fields import EnvError, container_env
from kiln_cluster.node.images import pull_error
from kiln_cluster.node.sandbox import Mount, Sandbox
from kiln_cluster.node.status import pod_status
from kiln_cluster.node.volumes import VolumeError, Volumes

if TYPE_CHECKING:
    from kiln_cluster.node.agent import Agent

log = logging.getLogger("node-agent")
TICK_S = 0.5
REFRESH_S = 3.0  # configMap/secret/projected volumes are re-read this often


class PodWorker(threading.Thread):
    def __init__(self, agent: Agent, pod: dict) -> None:
        super().__init__(daemon=True, name=f"pod-{pod['metadata']['name']}")
        self.agent, self.pod = agent, pod
        self.uid = pod["metadata"]["uid"]
        self.root = agent.root / "pods" / self.uid
        self.gone = threading.Event()  # removed from the API: stop now
        spec = pod["spec"]
        logs = self.root / "logs"
        self.init = [Container(c, logs / f"{c['name']}.log", is_init=True) for c in spec.get("initContainers") or []]
        self.main = [Container(c, logs / f"{c['name']}.log") for c in spec["containers"]]
        self.policy = spec.get("restartPolicy", "Always")
        self.sandbox: Sandbox | None = None
        self.volumes: Volumes | None = None
        self.start_time = now_rfc3339()
        self.message = ""
        self._sent: dict | None = None

    @property
    def name(self) -> str:
        return f"{self.pod['metadata']['namespace']}/{self.pod['metadata']['name']}"

    @property
    def deleting(self) -> bool:
        return bool(self.pod["metadata"].get("deletionTimestamp")) or self.gone.is_set()

    @property
    def ip(self) -> str | None:
        return self.sandbox.ip if self.sandbox else None

    def run(self) -> None:
        try:
            if self._prepare():
                self._supervise()
        except Exception:  # a bug of the agent's: report it on the pod, as a runtime error would be
            log.error("pod %s: %s", self.name, traceback.format_exc())
            self.message = "node agent error: " + traceback.format_exc(limit=1).strip().splitlines()[-1]
            self._report()
        finally:
            self._teardown()

    # --- set-up: images, volumes, sandbox -------------------------------------------------------------
    def _prepare(self) -> bool:
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        while not self.deleting:
            problem = self._try_prepare()
            if problem is None:
                return True
            self._report()
            time.sleep(2.0)
        return False

    def _try_prepare(self) -> str | None:
        bad = [(c, pull_error(c.spec.get("image", ""))) for c in self.init + self.main]
        if any(err for _, err in bad):
            for c, err in bad:
                if err:
                    c.wait_with("ErrImagePull", err)
            return "image"
        if self.volumes is None:
            self.volumes = Volumes(self.agent.api, self.pod, self.root, self.agent.root)
        try:
            self.volumes.setup()
        except VolumeError as exc:
            for c in self.init + self.main:
                c.wait_with("ContainerCreating", f"MountVolume.SetUp failed: {exc}")
            return "volume"
        self.sandbox = self._sandbox()
        self.sandbox.start()
        self.agent.hosts.changed()
        return None

    def _sandbox(self) -> Sandbox:
        spec, meta = self.pod["spec"], self.pod["metadata"]
        assert self.volumes is not None
        mounts: dict[str, Mount] = {"/etc/hosts": Mount(self.agent.hosts.file_for(self.uid), "/etc/hosts")}
        read_only_root = True
        for c in self.init + self.main:
            ctx = c.spec.get("securityContext") or {}
            read_only_root = read_only_root and bool(ctx.get("readOnlyRootFilesystem"))
            for vm in c.spec.get("volumeMounts") or []:
                src = self.volumes.paths[vm["name"]]
                if vm.get("subPath"):
                    src = src / vm["subPath"]
                mounts.setdefault(vm["mountPath"], Mount(src, vm["mountPath"], bool(vm.get("readOnly")),
                                                         vm["name"] in self.volumes.tmpfs))
        self.number = self.agent.ips.take()
        netns, ip = self.agent.network.add_pod(self.number)
        return Sandbox(uid=self.uid, root=self.root, ip=ip, netns=netns, hostname=spec.get("hostname") or meta["name"],
                       mounts=list(mounts.values()), read_only_root=read_only_root,
                       keep_visible=self.agent.program_paths)

    # --- running -----------------------------------------------------------------------------------
    def _start(self, c: Container) -> bool:
        assert self.sandbox is not None
        try:
            env = container_env(self.agent.api, self.pod_with_ip(), c.spec, self.agent.base_env)
            c.start(self.sandbox, env)
            return True
        except (EnvError, ValueError) as exc:
            c.wait_with("CreateContainerConfigError", str(exc))
            return False

    def pod_with_ip(self) -> dict:
        status = dict(self.pod.get("status") or {}, podIP=self.ip, hostIP=self.agent.host_ip)
        return dict(self.pod, status=status)

    def _step_init(self) -> bool:
        """Advance the init containers; True once all have succeeded."""
        for c in self.init:
            if c.terminated and c.terminated["exitCode"] == 0:
                continue
            self._step_container(c)
            return False
        return True

    def _step_container(self, c: Container) -> None:
        """Start a container whose wait is over, restart one that ended (restartPolicy, with back-off),
        probe one that runs."""
        assert self.sandbox is not None
        if c.reap() and c.should_restart(self.policy):
            c.schedule_restart()
        if "waiting" in c.state:
            if time.monotonic() >= c.backoff_until and not self._start(c):
                c.backoff_until = time.monotonic() + 2.0
            return
        if c.running and not c.is_init:
            why = c.run_probes(self.sandbox.ip, self.sandbox.nsenter())
            if why:
                log.info("pod %s container %s: %s, killing it", self.name, c.name, why)
                c.stop(float(self.pod["spec"].get("terminationGracePeriodSeconds", 30)))

    def _supervise(self) -> None:
        last_refresh = time.monotonic()
        while not self.deleting:
            if self._step_init():
                for c in self.main:
                    self._step_container(c)
            if time.monotonic() - last_refresh > REFRESH_S and self.volumes:
                self._refresh_volumes()
                last_refresh = time.monotonic()
            self._report()
            if self._sent and self._sent["phase"] in ("Succeeded", "Failed"):
                self._stop_all(0)
                self._wait_for_delete()
                return
            time.sleep(TICK_S)
        grace = self.pod["metadata"].get("deletionGracePeriodSeconds")
        self._stop_all(30.0 if grace is None else float(grace))
        self._report()

    def _refresh_volumes(self) -> None:
        assert self.volumes is not None
        self.volumes.pod = self.pod
        try:
            self.volumes.refresh()
        except VolumeError as exc:
            log.warning("pod %s: volume refresh failed: %s", self.name, exc)

    def _wait_for_delete(self) -> None:
        while not self.deleting:
            time.sleep(TICK_S)

    def _stop_all(self, grace: float) -> None:
        threads = [threading.Thread(target=c.stop, args=(grace,)) for c in self.init + self.main]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for c in self.init + self.main:
            c.reap()

    # --- reporting and teardown ---------------------------------------------------------------------
    def _report(self) -> None:
        if self.gone.is_set():
            return
        seen = self._sent or self.pod.get("status") or {}
        status = pod_status(seen.get("conditions") or [], ip=self.ip, host_ip=self.agent.host_ip, policy=self.policy, init=self.init,
                            main=self.main, sandbox_ready=self.sandbox is not None, start_time=self.start_time,
                            message=self.message)
        if status != self._sent:
            self.agent.patch_status(self.pod, status)
            self._sent = status

    def _teardown(self) -> None:
        self._stop_all(0)
        if self.sandbox is not None:
            self.sandbox.stop()
            self.agent.network.remove_pod(self.number)
            self.agent.ips.give_back(self.number)
        self.agent.finished(self)

