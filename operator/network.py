"""The engine's NetworkPolicy: a pure function of (engine, spec) -> a networking.k8s.io/v1 NetworkPolicy.

Every serving pod of the engine (Deployment pods, LeaderWorkerSet leaders and workers) admits

- its serving port (``spec.serving.port``: the OpenAI API, ``/metrics``, the probes) from anywhere, as
  before: clients, the gateway, Prometheus;
- the ranks' ports only from the engine's own pods: the rendezvous port (29500, ``KILN_LEADER_PORT``)
  and the ports gloo and NCCL open for collectives, which are ephemeral (the kernel's local port range,
  so 1024-65535 TCP).

"The engine's own pods" are not those with the engine's label, which any pod of the namespace can set on itself,
but those with ``LABEL_RANK_GROUP`` set to the engine's rank group value: an HMAC keyed by the group token
(:func:`kiln.operator.keys.rank_group_label`), which the operator puts on the LeaderWorkerSet's pods. A pod whose
creator cannot read the token Secret cannot compute it (one who can read the engine's pods or this policy can
copy it: what stops that one is the token the ranks check, docs/operator-trust.md). Without the value (None) no
pod is admitted to the rank ports. A NetworkPolicy cannot say "the same group index as the destination", so
within one LeaderWorkerSet the groups are told apart by ``$KILN_GROUP_TOKEN``, not by the network. Egress is left
open: pods fetch from the store. A pool's pods run no ranks: theirs admits the serving port alone
(``pools.build_pool_network_policy``).
"""

from __future__ import annotations

from typing import Any

from kiln.operator.keys import LABEL_RANK_GROUP
from kiln.operator.naming import engine_pod_labels, object_meta, serving_labels
from kiln.operator.workloads import RENDEZVOUS_PORT

from kiln.api import LLMEngineSpec

COLLECTIVE_PORTS = (1024, 65535)  # gloo / NCCL listen on ephemeral ports


def rank_ports() -> list[dict[str, Any]]:
    low, high = COLLECTIVE_PORTS
    return [{"protocol": "TCP", "port": RENDEZVOUS_PORT}, {"protocol": "TCP", "port": low, "endPort": high}]


def build_network_policy(spec: LLMEngineSpec, name: str, namespace: str, owner: dict[str, Any] | None = None,
                         rank_group: str | None = None) -> dict[str, Any]:
    ingress = serving_port_only(spec.serving.port)
    if spec.replica_shape.multi_node and rank_group:
        group = {"podSelector": {"matchLabels": {**engine_pod_labels(name), LABEL_RANK_GROUP: rank_group}}}
        ingress.append({"from": [group], "ports": rank_ports()})
    return network_policy(object_meta(name, namespace, serving_labels(name), owner), engine_pod_labels(name), ingress)


def serving_port_only(port: int) -> list[dict[str, Any]]:
    """Ingress to the serving port alone (from anywhere): what a pod that runs no ranks admits."""
    return [{"ports": [{"protocol": "TCP", "port": port}]}]


def network_policy(metadata: dict[str, Any], selector: dict[str, str], ingress: list[dict[str, Any]]
                   ) -> dict[str, Any]:
    """A NetworkPolicy over the pods ``selector`` matches, admitting ``ingress`` alone; egress left open."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata,
        "spec": {"podSelector": {"matchLabels": selector}, "policyTypes": ["Ingress"], "ingress": ingress},
    }
