"""The pod network after a run killed without its teardown: a pod's veth pair outlives the namespace's name while
that run's sandbox process is still in the namespace, and the next run's pod of the same number must still get
its network (it found the name taken: "RTNETLINK answers: File exists", and no pod of kiln ever started)."""

from __future__ import annotations

import shutil
import subprocess
from functools import partial

import pytest
from kiln_cluster import network
from kiln_cluster.network import MAX_CLUSTERS, Network

_ip: partial[subprocess.CompletedProcess] = partial(network._ip, check=False)  # the cluster's own, not raising


@pytest.fixture
def spare() -> Network:
    """The last bridge index, which a cluster takes only when every other one is up."""
    if shutil.which("ip") is None or _ip("netns", "list").returncode != 0:
        pytest.skip("needs iproute2 and the right to make network namespaces")
    net = Network(MAX_CLUSTERS - 1)
    if network._exists(net.bridge):
        pytest.skip(f"{net.bridge} is in use")
    net.up()
    yield net
    net.down()
    _ip("link", "delete", net.veth(1))


def test_a_pod_gets_its_network_where_a_killed_run_left_its_veth_pair(spare):
    # what a killed run leaves: the host end of pod 1's pair, its peer in a namespace no longer named
    assert _ip("link", "add", spare.veth(1), "type", "veth", "peer", "name", "stale1").returncode == 0
    netns, ip = spare.add_pod(1)
    assert netns.endswith(f"{spare.bridge}-1") and ip == spare.pod_ip(1)
    shown = _ip("-n", f"{spare.bridge}-1", "-o", "addr", "show", "dev", "eth0")
    assert f"{ip}/16" in shown.stdout, shown
    assert not network._exists("stale1")  # the stale pair is gone with its host end
    spare.remove_pod(1)
    assert not network._exists(spare.veth(1))
