"""The operator's own client, on what a real apiserver does that the emulator once did not
(docs/local-cluster.md, "What the real apiserver found")."""

from __future__ import annotations

import kopf
from kiln.operator.kube import in_cluster_server


def test_a_pod_reaches_the_apiserver_by_the_kubelets_variables(monkeypatch):
    info = kopf.ConnectionInfo(server="https://kubernetes.default.svc", token="t", ca_path="/ca.crt")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    moved = in_cluster_server(info)
    assert moved.server == "https://10.96.0.1:6443" and (moved.token, moved.ca_path) == ("t", "/ca.crt")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    assert in_cluster_server(info).server == "https://[fd00::1]:6443"
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")  # outside a pod: kopf's own choice stands
    assert in_cluster_server(info) is info and in_cluster_server(None) is None
