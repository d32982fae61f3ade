"""The node agent: registers a Node, keeps its Lease, and runs the pods bound to it (one PodWorker each).

It speaks to the apiserver as the kubelet does, as ``system:node:<name>`` (the Node authorizer and the
NodeRestriction admission plugin apply to it), from a list-then-watch of the pods whose
``spec.nodeName`` is its own.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import kubernetes
from kiln_cluster.network import Network
from kiln_cluster.node.containers import now_rfc3339
from kiln_cluster.node.hosts import HostsBook
from kiln_cluster.node.images import image_env
from kiln_cluster.node.pod import PodWorker
from kiln_cluster.node.sandbox import IpPool, kill_leftover_pods
from kubernetes.client.exceptions import ApiException

log = logging.getLogger("node-agent")
MERGE = "application/merge-patch+json"  # the client would send a dict as a JSON patch otherwise
LEASE_S = 10
NODE_STATUS_S = 60


class Api:
    def __init__(self, kubeconfig: Path) -> None:
        self.client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        self.core = kubernetes.client.CoreV1Api(self.client)
        self.coordination = kubernetes.client.CoordinationV1Api(self.client)

    def to_dict(self, obj: Any) -> dict:
        return self.client.sanitize_for_serialization(obj)


class Agent:
    def __init__(self, cluster_root: Path, node: str, cpu: str) -> None:
        self.cluster_root, self.node, self.cpu = cluster_root, node, cpu
        self.root = cluster_root / "node"
        self.root.mkdir(parents=True, exist_ok=True)
        self.api = Api(cluster_root / "kubeconfigs" / "node.kubeconfig")
        self.workers: dict[str, PodWorker] = {}
        self.lock = threading.Lock()
        self.ips = IpPool()
        self.hosts = HostsBook(self.root, self._pods_with_ips)
        state = json.loads((cluster_root / "state.json").read_text())
        self.network = Network(state["network"])
        self.host_ip = self.network.gateway
        api_port = str(state["ports"]["kube-apiserver"])
        repo = Path(__import__("kiln").__file__).resolve().parents[1]
        self.program_paths = sorted({str(repo), sys.prefix, sys.base_prefix})
        self.base_env = image_env(repo / "serving_image" / "Dockerfile") | {
            "KUBERNETES_SERVICE_HOST": self.host_ip, "KUBERNETES_SERVICE_PORT": api_port,
            "KUBERNETES_SERVICE_PORT_HTTPS": api_port, "KUBERNETES_PORT": f"tcp://{self.host_ip}:{api_port}"}

    # --- the Node and its heartbeat ---------------------------------------------------------------
    def _node_status(self) -> dict:
        mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
        res = {"cpu": self.cpu, "memory": f"{mem_kib}Ki", "pods": "110", "ephemeral-storage": "100Gi"}
        stamp = now_rfc3339()
        conds = [("Ready", "True", "KubeletReady"), ("MemoryPressure", "False", "KubeletHasSufficientMemory"),
                 ("DiskPressure", "False", "KubeletHasNoDiskPressure"), ("PIDPressure", "False", "KubeletHasSufficientPID")]
        return {"capacity": res, "allocatable": res,
                "conditions": [{"type": t, "status": s, "reason": r, "lastHeartbeatTime": stamp,
                                "lastTransitionTime": stamp, "message": "kiln node agent"} for t, s, r in conds],
                "addresses": [{"type": "InternalIP", "address": self.host_ip}, {"type": "Hostname", "address": self.node}],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
                "nodeInfo": {"machineID": "kiln", "systemUUID": "kiln", "bootID": "kiln",
                             "kernelVersion": platform.release(), "osImage": "kiln node agent",
                             "containerRuntimeVersion": "kiln-processes://0.1",
                             "kubeletVersion": os.environ.get("KILN_KUBE_VERSION", "v1.35.4"),
                             "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64"}}

    def register(self) -> None:
        labels = {"kubernetes.io/hostname": self.node, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}
        try:
            self.api.core.create_node({"metadata": {"name": self.node, "labels": labels}})
        except ApiException as exc:
            if exc.status != 409:
                raise
        self.api.core.patch_node_status(self.node, {"status": self._node_status()}, _content_type=MERGE)

    def heartbeat(self) -> None:
        last_status = time.monotonic()
        while True:
            try:
                self._renew_lease()
                if time.monotonic() - last_status > NODE_STATUS_S:
                    self.api.core.patch_node_status(self.node, {"status": self._node_status()}, _content_type=MERGE)
                    last_status = time.monotonic()
            except (ApiException, OSError) as exc:
                log.warning("heartbeat: %s", exc)
            time.sleep(LEASE_S)

    def _renew_lease(self) -> None:
        body = {"metadata": {"name": self.node, "namespace": "kube-node-lease"},
                "spec": {"holderIdentity": self.node, "leaseDurationSeconds": 40,
                         "renewTime": time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())}}
        try:
            self.api.coordination.patch_namespaced_lease(self.node, "kube-node-lease", body, _content_type=MERGE)
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.api.coordination.create_namespaced_lease("kube-node-lease", body)

    # --- pods ----------------------------------------------------------------------------------
    def _pods_with_ips(self) -> list[tuple[dict, str]]:
        with self.lock:
            return [(w.pod, w.ip) for w in self.workers.values() if w.ip]

    def sync(self, pod: dict, deleted: bool = False) -> None:
        uid = pod["metadata"]["uid"]
        with self.lock:
            worker = self.workers.get(uid)
            if worker is not None:
                worker.pod = pod
                if deleted:
                    worker.gone.set()
                return
        if deleted:
            return
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            if pod["metadata"].get("deletionTimestamp"):
                self._confirm_delete(pod)
            return
        worker = PodWorker(self, pod)
        with self.lock:
            self.workers[uid] = worker
        worker.start()

    def finished(self, worker: PodWorker) -> None:
        with self.lock:
            self.workers.pop(worker.uid, None)
        if worker.deleting and not worker.gone.is_set():
            self._confirm_delete(worker.pod)
        shutil.rmtree(worker.root / "volumes", ignore_errors=True)
        self.hosts.changed()

    def _confirm_delete(self, pod: dict) -> None:
        meta = pod["metadata"]
        try:
            # the grace period in the body: with a body, the apiserver does not read it from the query
            self.api.core.delete_namespaced_pod(meta["name"], meta["namespace"], body={
                "gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}})
        except ApiException as exc:
            if exc.status not in (404, 409):
                log.warning("delete %s: %s", meta["name"], exc.reason)

    def patch_status(self, pod: dict, status: dict) -> None:
        meta = pod["metadata"]
        try:
            self.api.core.patch_namespaced_pod_status(meta["name"], meta["namespace"], {"status": status},
                                                      _content_type=MERGE)
        except ApiException as exc:
            if exc.status != 404:
                log.warning("status of %s/%s: %s %s", meta["namespace"], meta["name"], exc.status, exc.reason)

    def run(self) -> None:
        kill_leftover_pods(self.root)
        shutil.rmtree(self.root / "pods", ignore_errors=True)
        self.register()
        threading.Thread(target=self.heartbeat, daemon=True, name="heartbeat").start()
        selector = f"spec.nodeName={self.node}"
        while True:
            try:
                listed = self.api.core.list_pod_for_all_namespaces(field_selector=selector)
                for pod in listed.items:
                    self.sync(self.api.to_dict(pod))
                stream = kubernetes.watch.Watch().stream(
                    self.api.core.list_pod_for_all_namespaces, field_selector=selector,
                    resource_version=listed.metadata.resource_version, timeout_seconds=300)
                for event in stream:
                    self.sync(self.api.to_dict(event["object"]), deleted=event["type"] == "DELETED")
            except (ApiException, OSError, kubernetes.client.exceptions.ApiValueError) as exc:
                log.warning("pod watch: %s; listing again", exc)
                time.sleep(1)

    def shutdown(self) -> None:
        with self.lock:
            workers = list(self.workers.values())
        for w in workers:
            w.gone.set()
        for w in workers:
            w.join(timeout=40)
