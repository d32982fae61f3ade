"""The node agent's projected service-account token while the apiserver's node authorizer has not yet seen the pod
bound to the node: the token request is refused (403, "no relationship found between node ... and this object").
That was raised as an agent error, which tore the pod down for good; the operator's pod of one run started 5
minutes late (`make test` 18 min, not 14). The kubelet retries such a mount; so does the agent now (no cluster)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kiln_cluster.node.volumes import VolumeError, Volumes
from kubernetes.client.exceptions import ApiException

POD = {"metadata": {"name": "kiln-1", "namespace": "kiln-system", "uid": "u-1"},
       "spec": {"serviceAccountName": "kiln", "volumes": [
           {"name": "token", "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}}]}}


class Core:
    def __init__(self, refusals: int) -> None:
        self.refusals, self.calls = refusals, 0

    def create_namespaced_service_account_token(self, name, namespace, body):
        self.calls += 1
        if self.calls <= self.refusals:
            raise ApiException(status=403, reason="Forbidden")
        return SimpleNamespace(status=SimpleNamespace(token=f"token-of-{name}"))


def test_a_refused_token_request_is_a_volume_error_the_pod_waits_on_then_retried(tmp_path):
    core = Core(refusals=1)
    volumes = Volumes(SimpleNamespace(core=core), POD, tmp_path / "pod", tmp_path / "node")
    with pytest.raises(VolumeError, match=r"serviceAccountToken of 'kiln' in kiln-system: Forbidden \(403\)"):
        volumes.setup()
    volumes.setup()  # the pod's next try (Pod._prepare, every 2 s)
    assert core.calls == 2
    assert (volumes.paths["token"] / "token").read_text() == "token-of-kiln"
