"""Imported as ``kiln_cluster`` (folder ``cluster/``): a real Kubernetes control plane on 127.0.0.1.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler and LeaderWorkerSet's controller are built
from their Go modules (``build.sh``, pinned in ``versions.env``) and run as they run in a cluster: RBAC,
the default admission plugins, service-account tokens. One stand-in replaces the kubelet and the container
runtime: the node agent (``node/``) runs each pod bound to its Node as local processes. docs/local-cluster.md.
"""
