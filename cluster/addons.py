"""What runs beside the core control plane: the third-party CRDs kiln renders against (LeaderWorkerSet,
KEDA's ScaledObject, the Gateway API Inference Extension's InferencePool), LeaderWorkerSet's controller
with its admission webhooks, and the wait until the cluster can run a pod."""

from __future__ import annotations

import base64
import json
import subprocess
import time
from typing import TYPE_CHECKING

import yaml
from kiln_cluster.pki import serving_cert

if TYPE_CHECKING:
    from kiln_cluster.control_plane import Cluster

LWS_NAMESPACE = "lws-system"
# LeaderWorkerSet's webhooks as its config/webhook kustomization renders them, pointed at the controller
# on 127.0.0.1 (no kube-proxy routes a Service here) and trusting the local CA.
LWS_WEBHOOKS = {
    "mutating": [("mleaderworkerset.kb.io", "/mutate-leaderworkerset-x-k8s-io-v1-leaderworkerset", "lws", ["CREATE", "UPDATE"]),
                 ("mpod.kb.io", "/mutate--v1-pod", "pods", ["CREATE"])],
    "validating": [("vleaderworkerset.kb.io", "/validate-leaderworkerset-x-k8s-io-v1-leaderworkerset", "lws", ["CREATE", "UPDATE"]),
                   ("vpod.kb.io", "/validate--v1-pod", "pods", ["CREATE", "UPDATE"])],
}


def kubectl(c: Cluster, *args: str, input: str | None = None) -> str:
    done = subprocess.run([c.bin("kubectl"), f"--kubeconfig={c.kubeconfig}", *args], input=input,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)[:200]}: {done.stderr.strip()[:2000]}")
    return done.stdout


def install(c: Cluster, *, lws: bool) -> None:
    crds = sorted((c.root / "third-party-crds").resolve().glob("*.yaml"))
    kubectl(c, "apply", "--server-side", "--force-conflicts", *(f"--filename={p}" for p in crds))
    wait_established(c)
    if lws:
        _start_lws(c)


def wait_established(c: Cluster, timeout: float = 60) -> None:
    """Until every CRD is Established (right after an apply a CRD may have no conditions yet)."""
    deadline = time.monotonic() + timeout
    while True:
        crds = json.loads(kubectl(c, "get", "crd", "-o", "json"))["items"]
        waiting = [d["metadata"]["name"] for d in crds
                   if not any(x["type"] == "Established" and x["status"] == "True"
                              for x in (d.get("status") or {}).get("conditions") or [])]
        if not waiting:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"CRDs not Established after {timeout:.0f} s: {waiting}")
        time.sleep(0.5)


def _webhook_cert(c: Cluster) -> None:
    """A serving certificate for the LWS webhooks at 127.0.0.1, signed by the cluster's CA."""
    certs = c.root / "lws-certs"
    certs.mkdir(parents=True, exist_ok=True)
    crt, key = serving_cert(c.pki, "lws-webhook", ["127.0.0.1"])
    crt.replace(certs / "tls.crt")
    key.replace(certs / "tls.key")


def _webhook_configs(c: Cluster) -> list[dict]:
    bundle = base64.b64encode(c.pki.ca.read_bytes()).decode()
    base = f"https://127.0.0.1:{c.ports['lws-webhook']}"
    docs = []
    for kind, hooks in LWS_WEBHOOKS.items():
        items = []
        for name, path, target, ops in hooks:
            rule = ({"apiGroups": ["leaderworkerset.x-k8s.io"], "resources": ["leaderworkersets"]} if target == "lws"
                    else {"apiGroups": [""], "resources": ["pods"]})
            hook = {"name": name, "admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": "Fail",
                    "clientConfig": {"url": base + path, "caBundle": bundle},
                    "rules": [{**rule, "apiVersions": ["v1"], "operations": ops}]}
            if target == "pods":
                hook["objectSelector"] = {"matchExpressions": [
                    {"key": "leaderworkerset.sigs.k8s.io/name", "operator": "Exists"}]}
            items.append(hook)
        docs.append({"apiVersion": "admissionregistration.k8s.io/v1",
                     "kind": f"{kind.capitalize()}WebhookConfiguration",
                     "metadata": {"name": f"lws-{kind}-webhook-configuration"}, "webhooks": items})
    return docs


def _start_lws(c: Cluster) -> None:
    from kiln_cluster.control_plane import free_port, http_ok, spawn, wait_for

    _webhook_cert(c)
    c.ports.setdefault("lws-webhook", free_port())
    c.ports.setdefault("lws-health", free_port())
    config = {"apiVersion": "config.lws.x-k8s.io/v1alpha1", "kind": "Configuration",
              "leaderElection": {"leaderElect": False}, "internalCertManagement": {"enable": False},
              "webhook": {"port": c.ports["lws-webhook"], "host": "127.0.0.1", "certDir": str(c.root / "lws-certs")},
              "metrics": {"bindAddress": "0"},
              "health": {"healthProbeBindAddress": f"127.0.0.1:{c.ports['lws-health']}"}}
    (c.root / "lws-config.yaml").write_text(yaml.safe_dump(config))
    kubectl(c, "apply", "-f", "-", input=yaml.safe_dump({"apiVersion": "v1", "kind": "Namespace",
                                                         "metadata": {"name": LWS_NAMESPACE}}))
    lws_kubeconfig = c.component_kubeconfig("lws")
    spawn(c, "lws-controller", [c.bin("lws-controller"), f"--config={c.root / 'lws-config.yaml'}",
                                 f"--kubeconfig={lws_kubeconfig}", "--leader-elect=false"])
    wait_for("LeaderWorkerSet's controller", lambda: http_ok(f"http://127.0.0.1:{c.ports['lws-health']}/readyz"),
          c, "lws-controller")
    kubectl(c, "apply", "--server-side", "--force-conflicts", "-f", "-",
            input=yaml.safe_dump_all(_webhook_configs(c)))


def wait_ready(c: Cluster, timeout: float = 120) -> None:
    """Until the node is Ready and the default ServiceAccount exists: then a pod can run."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            ready = kubectl(c, "get", "node", "-o", "jsonpath={.items[*].status.conditions[?(@.type=='Ready')].status}")
            kubectl(c, "get", "serviceaccount", "default", "-n", "default")
            if "True" in ready:
                return
            last = f"node Ready: {ready or 'no node yet'}"
        except RuntimeError as exc:
            last = str(exc)
        time.sleep(1)
    raise RuntimeError(f"the cluster did not become ready in {timeout:.0f} s: {last}")
