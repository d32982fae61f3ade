"""The engine's NetworkPolicy: a pure function of (engine, spec) -> a networking.k8s.io/v1 NetworkPolicy.

Every serving pod of the engine (Deployment pods, LeaderWorkerSet leaders and workers) admits

- its serving port (``spec.serving.port``: the OpenAI API, ``/metrics``, the probes) from anywhere, as
  before: clients, the gateway, Prometheus;
- the ranks' ports only from the engine's own pods: the rendezvous port (29500, ``KILN_LEADER_PORT``)
  and the ports gloo and NCCL open for collectives, which are ephemeral (the kernel's local port range,
  so 1024-65535 TCP).

Nothing else reaches them. A NetworkPolicy selects by labels and cannot say "the same group index as the
destination", so within one LeaderWorkerSet the groups are told apart by ``$KILN_GROUP_TOKEN``
(:mod:`kiln.operator.keys`), not by the network. Egress is left open: pods fetch from the store.
"""

from __future__ import annotations

from typing import Any

from kiln.operator.naming import engine_pod_labels, object_meta, serving_labels
from kiln.operator.workloads import RENDEZVOUS_PORT

from kiln.api import LLMEngineSpec

COLLECTIVE_PORTS = (1024, 65535)  # gloo / NCCL listen on ephemeral ports


def rank_ports() -> list[dict[str, Any]]:
    low, high = COLLECTIVE_PORTS
    return [{"protocol": "TCP", "port": RENDEZVOUS_PORT}, {"protocol": "TCP", "port": low, "endPort": high}]


def build_network_policy(spec: LLMEngineSpec, name: str, namespace: str,
                         owner: dict[str, Any] | None = None) -> dict[str, Any]:
    group = {"podSelector": {"matchLabels": engine_pod_labels(name)}}
    ingress: list[dict[str, Any]] = [{"ports": [{"protocol": "TCP", "port": spec.serving.port}]}]
    if spec.replica_shape.multi_node:
        ingress.append({"from": [group], "ports": rank_ports()})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(name, namespace, serving_labels(name), owner),
        "spec": {"podSelector": {"matchLabels": engine_pod_labels(name)}, "policyTypes": ["Ingress"],
                 "ingress": ingress},
    }
