"""Start and stop the local control plane: each component a process on this machine, as a cluster runs it.

The cluster's folder (``.kiln-work/cluster`` for ``make cluster``) holds everything: ``bin/`` (from
build.sh), ``pki/``, ``etcd/``, ``logs/``, ``state.json`` (ports and pids), ``kubeconfig`` (admin) and
``s3-endpoint``. ``up`` is idempotent: a cluster whose processes all live and whose apiserver answers is
left as it is; a half-dead one is stopped and started again over the same etcd data.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kiln_cluster.network import Network
from kiln_cluster.pki import Pki, ensure_pki, kubeconfig

NODE_NAME = "kiln-node-0"
SERVICE_RANGE = "10.96.0.0/16"
ISSUER = "https://kubernetes.default.svc.cluster.local"
# The controllers kiln relies on, and the ones those need to behave as in a cluster.
CONTROLLERS = [
    "job-controller", "deployment-controller", "replicaset-controller", "statefulset-controller",
    "garbage-collector-controller", "endpointslice-controller", "endpoints-controller",
    "namespace-controller", "serviceaccount-controller", "serviceaccount-token-controller",
    "root-ca-certificate-publisher-controller", "ttl-after-finished-controller",
    "node-lifecycle-controller", "pod-garbage-collector-controller", "clusterrole-aggregation-controller",
    "disruption-controller", "resourcequota-controller",
]
ORDER = ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "s3", "lws-controller",
         "node-agent"]


@dataclass
class Cluster:
    root: Path
    network: Network = field(default_factory=lambda: Network(0))
    ports: dict[str, int] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)

    @property
    def pki(self) -> Pki:
        return Pki(self.root / "pki")

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def host_ip(self) -> str:
        """The host's address on the pod network: the apiserver and S3 listen there, for pods and host alike."""
        return self.network.gateway

    @property
    def server(self) -> str:
        return f"https://{self.host_ip}:{self.ports['kube-apiserver']}"

    @property
    def s3_endpoint(self) -> str:
        return f"http://{self.host_ip}:{self.ports['s3']}"

    def bin(self, name: str) -> str:
        return str(self.root / "bin" / name)

    def log(self, name: str) -> Path:
        return self.root / "logs" / f"{name}.log"

    def component_kubeconfig(self, who: str) -> Path:
        path = self.root / "kubeconfigs" / f"{who}.kubeconfig"
        path.parent.mkdir(exist_ok=True)
        path.write_text(kubeconfig(self.pki, who, self.server))
        return path

    def save(self) -> None:
        tmp = self.root / "state.json.tmp"
        tmp.write_text(json.dumps({"network": self.network.index, "ports": self.ports, "pids": self.pids},
                                  indent=1))
        tmp.replace(self.root / "state.json")

    @classmethod
    def load(cls, root: Path) -> Cluster:
        state = root / "state.json"
        data = json.loads(state.read_text()) if state.exists() else {}
        return cls(root=root, network=Network(data.get("network", 0)), ports=data.get("ports", {}),
                   pids=data.get("pids", {}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
        return True


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:  # a zombie of ours counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def spawn(cluster: Cluster, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
    log = cluster.log(name).open("ab")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, **(env or {})}, cwd=cluster.root)
    cluster.pids[name] = proc.pid
    cluster.save()


def _api_ready(cluster: Cluster, path: str = "/readyz") -> bool:
    ctx = ssl.create_default_context(cafile=str(cluster.pki.ca))
    ctx.load_cert_chain(*map(str, cluster.pki.client("admin")))
    try:
        with urllib.request.urlopen(cluster.server + path, context=ctx, timeout=3) as resp:
            return resp.status == 200
    except OSError:
        return False


def wait_for(what: str, check, cluster: Cluster, name: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if name in cluster.pids and not alive(cluster.pids[name]):
            tail = cluster.log(name).read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{name} exited while waiting for {what}; its log ends:\n{tail}")
        time.sleep(0.5)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what} (log: {cluster.log(name)})")


def _start_etcd(c: Cluster) -> None:
    client, peer = f"http://127.0.0.1:{c.ports['etcd']}", f"http://127.0.0.1:{c.ports['etcd-peer']}"
    spawn(c, "etcd", [c.bin("etcd"), "--name", "kiln", "--data-dir", str(c.root / "etcd"),
                       "--listen-client-urls", client, "--advertise-client-urls", client,
                       "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                       "--initial-cluster", f"kiln={peer}", "--unsafe-no-fsync",
                       "--listen-metrics-urls", f"http://127.0.0.1:{c.ports['etcd-metrics']}"])
    wait_for("etcd", lambda: http_ok(f"http://127.0.0.1:{c.ports['etcd-metrics']}/health"), c, "etcd")


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _start_apiserver(c: Cluster) -> None:
    p = c.pki
    spawn(c, "kube-apiserver", [
        c.bin("kube-apiserver"), f"--etcd-servers=http://127.0.0.1:{c.ports['etcd']}",
        f"--bind-address={c.host_ip}", f"--advertise-address={c.host_ip}", f"--secure-port={c.ports['kube-apiserver']}",
        f"--tls-cert-file={p.path('apiserver.crt')}", f"--tls-private-key-file={p.path('apiserver.key')}",
        f"--client-ca-file={p.ca}", f"--service-account-issuer={ISSUER}",
        f"--service-account-key-file={p.path('sa.pub')}", f"--service-account-signing-key-file={p.path('sa.key')}",
        f"--api-audiences={ISSUER}", "--authorization-mode=Node,RBAC",
        "--enable-admission-plugins=NodeRestriction", f"--service-cluster-ip-range={SERVICE_RANGE}",
        "--allow-privileged=true", f"--cert-dir={c.root / 'pki' / 'generated'}", "--profiling=false",
        "--event-ttl=30m"])
    wait_for("kube-apiserver /readyz", lambda: _api_ready(c), c, "kube-apiserver", timeout=180)


def _start_controllers(c: Cluster) -> None:
    kcm, sched = c.component_kubeconfig("controller-manager"), c.component_kubeconfig("scheduler")
    spawn(c, "kube-controller-manager", [
        c.bin("kube-controller-manager"), f"--kubeconfig={kcm}", f"--authentication-kubeconfig={kcm}",
        f"--authorization-kubeconfig={kcm}", "--bind-address=127.0.0.1",
        f"--secure-port={c.ports['kube-controller-manager']}", "--leader-elect=false",
        f"--service-account-private-key-file={c.pki.path('sa.key')}", f"--root-ca-file={c.pki.ca}",
        "--use-service-account-credentials=true", f"--controllers={','.join(CONTROLLERS)}",
        f"--service-cluster-ip-range={SERVICE_RANGE}", "--concurrent-gc-syncs=5"])
    spawn(c, "kube-scheduler", [
        c.bin("kube-scheduler"), f"--kubeconfig={sched}", f"--authentication-kubeconfig={sched}",
        f"--authorization-kubeconfig={sched}", "--bind-address=127.0.0.1",
        f"--secure-port={c.ports['kube-scheduler']}", "--leader-elect=false"])


def _start_s3(c: Cluster) -> None:
    moto = Path(sys.executable).with_name("moto_server")
    spawn(c, "s3", [str(moto), "-H", c.host_ip, "-p", str(c.ports["s3"])])
    wait_for("the S3 server", lambda: http_ok(c.s3_endpoint + "/moto-api/"), c, "s3")
    (c.root / "s3-endpoint").write_text(c.s3_endpoint + "\n")


def _start_node_agent(c: Cluster) -> None:
    c.component_kubeconfig("node")
    spawn(c, "node-agent", [sys.executable, "-P", "-m", "kiln_cluster.node", "--cluster", str(c.root),
                             "--node", NODE_NAME])


def running(c: Cluster) -> bool:
    core = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "s3", "node-agent")
    return all(n in c.pids for n in core) and all(map(alive, c.pids.values())) and _api_ready(c)


def up(root: Path, *, lws: bool = True) -> Cluster:
    """Start the control plane under ``root`` (``bin/`` must hold build.sh's binaries)."""
    root = root.resolve()
    c = Cluster.load(root)
    if running(c):
        print(f"cluster: already running at {c.server} (kubeconfig {c.kubeconfig})")
        return c
    down(root, quiet=True)
    (root / "logs").mkdir(parents=True, exist_ok=True)
    network = Network.free()
    network.up()
    ensure_pki(root / "pki", NODE_NAME, network.gateway)
    # The same ports as last time where they are free: a restarted cluster keeps its kubeconfig and S3 URL.
    ports = {n: p if _port_free(p) else free_port() for n, p in c.ports.items()}
    ports |= {n: free_port() for n in [*ORDER, "etcd-peer", "etcd-metrics"] if n not in ports}
    c = Cluster(root=root, network=network, ports=ports)
    c.save()
    try:
        _start_all(c, lws)
    except BaseException:
        down(root, quiet=True)  # nothing half-started is left behind
        raise
    print(f"cluster: up at {c.server}; export KUBECONFIG={c.kubeconfig}; S3 at {c.s3_endpoint}")
    return c


def _start_all(c: Cluster, lws: bool) -> None:
    _start_etcd(c)
    _start_apiserver(c)
    c.kubeconfig.write_text(kubeconfig(c.pki, "admin", c.server))
    _start_controllers(c)
    _start_s3(c)
    from kiln_cluster import addons  # the LWS controller and third-party CRDs need the apiserver up

    addons.install(c, lws=lws)
    _start_node_agent(c)
    addons.wait_ready(c)


def stop_pid(pid: int, grace: float = 10.0) -> None:
    """SIGTERM a process group, then SIGKILL it after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and alive(pid):
            time.sleep(0.1)
        if not alive(pid):
            return


def down(root: Path, *, quiet: bool = False) -> None:
    """Stop everything ``up`` started under ``root`` (the node agent stops its pods first)."""
    c = Cluster.load(root.resolve())
    for name in reversed(ORDER):
        if name in c.pids and alive(c.pids[name]):
            stop_pid(c.pids[name], grace=30.0 if name == "node-agent" else 10.0)
    from kiln_cluster.node.sandbox import kill_leftover_pods

    kill_leftover_pods(c.root / "node")
    c.network.down()
    if c.pids:
        c.pids = {}
        c.save()
        if not quiet:
            print(f"cluster: stopped (data kept under {c.root}; rm -rf it for a fresh cluster)")
    elif not quiet:
        print("cluster: nothing running")

