"""The cluster with Redis and each node in its own network namespace (veth pairs on a
bridge in a switch namespace, addresses chosen here), and real link faults: a silent
partition (iptables DROP inside the node's namespace) and a link taken down.

Needs root and iproute2/iptables (CI runs as root). Everything is torn down at the end."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from affinity import Keys
from tests.procs import Node, RedisServer, wait_until
from tests.test_cluster import Cluster, Episode, assert_matches, drive, episodes, running

pytestmark = [
    pytest.mark.netns,
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
]

LEASE = 2.0
KEYS = Keys()
SUBNET = "10.213.{tag}"


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=30)


@dataclass
class Net:
    tag: int
    names: list[str]

    def ns(self, name: str) -> str:
        return f"aff{self.tag}-{name}"

    def ip(self, host: int) -> str:
        return f"10.213.{self.tag}.{host}"

    def exec(self, name: str, *cmd: str, check: bool = True) -> None:
        sh("ip", "netns", "exec", self.ns(name), *cmd, check=check)


@pytest.fixture
def net() -> Iterator[Net]:
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is missing (Debian: iproute2, iptables)", pytrace=False)
    tag = os.getpid() % 200 + 20
    n = Net(tag, ["redis", "n0", "n1", "n2"])
    sw, br, root_if = n.ns("sw"), "br0", f"aff{tag}r"
    try:
        sh("ip", "netns", "add", sw)
        sh("ip", "netns", "exec", sw, "ip", "link", "add", br, "type", "bridge")
        sh("ip", "netns", "exec", sw, "ip", "link", "set", br, "up")
        for i, name in enumerate(n.names, start=1):
            ns = n.ns(name)
            sh("ip", "netns", "add", ns)
            sh(
                "ip",
                "link",
                "add",
                f"aff{tag}h{i}",
                "type",
                "veth",
                "peer",
                "name",
                f"aff{tag}s{i}",
            )
            sh("ip", "link", "set", f"aff{tag}h{i}", "netns", ns, "name", "eth0")
            sh("ip", "link", "set", f"aff{tag}s{i}", "netns", sw)
            sh("ip", "netns", "exec", sw, "ip", "link", "set", f"aff{tag}s{i}", "master", br, "up")
            n.exec(name, "ip", "addr", "add", f"{n.ip(i)}/24", "dev", "eth0")
            n.exec(name, "ip", "link", "set", "eth0", "up")
            n.exec(name, "ip", "link", "set", "lo", "up")
        # the test process (root namespace) joins the bridge to talk to the nodes
        sh("ip", "link", "add", root_if, "type", "veth", "peer", "name", f"aff{tag}sr")
        sh("ip", "link", "set", f"aff{tag}sr", "netns", sw)
        sh("ip", "netns", "exec", sw, "ip", "link", "set", f"aff{tag}sr", "master", br, "up")
        sh("ip", "addr", "add", f"{n.ip(254)}/24", "dev", root_if)
        sh("ip", "link", "set", root_if, "up")
        yield n
    finally:
        sh("ip", "link", "del", root_if, check=False)
        for name in [*n.names, "sw"]:
            sh("ip", "netns", "del", n.ns(name), check=False)


@pytest.fixture
def cluster(net: Net, tmp_path: Path) -> Iterator[Cluster]:
    redis = RedisServer(tmp_path, host=net.ip(1), netns=net.ns("redis"))
    nodes = [
        Node(
            tmp_path,
            f"n{i}",
            redis.url,
            devices="cpu:2",
            host=net.ip(i + 2),
            netns=net.ns(f"n{i}"),
            env={"AFFINITY_CLUSTER_SECRET": "netns"},
            extra=["--lease-ttl", str(LEASE), "--capacity", "200", "--act-deadline", "3"],
        )
        for i in range(3)
    ]
    with running(redis, nodes) as c:
        yield c


def check_moved(eps: list[Episode], moved: set[str], cut_devices: set[str]) -> None:
    """Episodes of the cut node stay on it while its lease is current, then move once, with
    state_reset, and never come back; every other episode never notices anything."""
    for ep in eps:
        devices = [x["device"] for x in ep.replies]
        if ep.id in moved:
            switch = next(i for i, d in enumerate(devices) if d not in cut_devices)
            assert set(devices[:switch]) <= cut_devices
            assert not any(x["state_reset"] for x in ep.replies[:switch])
            assert_matches(ep, 0, ep.replies[:switch])
            after = ep.replies[switch:]
            assert after[0]["state_reset"] is True, ep.id
            assert len({x["device"] for x in after}) == 1, ep.id
            assert not any(x["state_reset"] for x in after[1:])
            assert_matches(ep, switch, after)
        else:
            assert not ep.errors, (ep.id, ep.errors)
            assert len(set(devices)) == 1
            assert not any(x["state_reset"] for x in ep.replies)
            assert_matches(ep, 0, ep.replies)


def lapsed(redis: Any, node: str) -> bool:
    """Redis sees the node's lease as lapsed (its deadline passed, or already noticed)."""
    deadline = redis.zscore(KEYS.nodes, node)
    seconds, micros = redis.time()
    return deadline is None or deadline <= seconds * 1000 + micros // 1000


def test_silent_partition_of_a_node(cluster: Cluster, net: Net) -> None:
    eps = episodes(30, 12, seed=5)
    asyncio.run(drive(eps, range(6), cluster.urls()))
    cut = "n2"
    moved = {ep.id for ep in eps if ep.replies[-1]["node"] == cut}
    assert moved
    # packets dropped, no reset: the node's Redis calls and its peers' forwards just stall
    net.exec(cut, "iptables", "-A", "INPUT", "-i", "eth0", "-j", "DROP")
    net.exec(cut, "iptables", "-A", "OUTPUT", "-o", "eth0", "-j", "DROP")
    try:
        asyncio.run(drive(eps, range(6, 9), cluster.urls(without=(cut,))))
    finally:
        net.exec(cut, "iptables", "-F")
    # healed: the cut node re-registers and serves none of the moved episodes
    node = next(n for n in cluster.nodes if n.node_id == cut)
    wait_until(node.ready, LEASE * 10, f"{cut} ready again")
    asyncio.run(drive(eps, range(9, 12), cluster.urls()))
    check_moved(eps, moved, {f"{cut}/0", f"{cut}/1"})


def test_link_down_and_redis_unreachable_answers_within_deadline(
    cluster: Cluster, net: Net
) -> None:
    eps = episodes(20, 8, seed=6)
    asyncio.run(drive(eps, range(4), cluster.urls()))
    cut = "n0"
    moved = {ep.id for ep in eps if ep.replies[-1]["node"] == cut}
    redis = cluster.redis.client()
    net.exec("redis", "iptables", "-A", "INPUT", "-s", net.ip(2), "-j", "DROP")
    try:
        # n0 still answers its clients, but cannot reach Redis: 503 with Retry-After
        # within its deadline (the client timeout here is far above --act-deadline 3 s)
        with httpx.Client(timeout=15) as c:
            r = c.post(
                cluster.nodes[0].url + "/act",
                json={"episode_id": "new-one", "inputs": {"obs": [[0] * 8]}},
            )
        assert r.status_code == 503 and r.headers.get("retry-after"), r.text
        # keep it cut off until Redis has seen its lease lapse
        wait_until(lambda: lapsed(redis, cut), LEASE * 5, f"{cut} lease lapsed")
        asyncio.run(drive(eps, range(4, 6), cluster.urls(without=(cut,))))
    finally:
        net.exec("redis", "iptables", "-F")
    net.exec(cut, "ip", "link", "set", "eth0", "down")
    time.sleep(0.2)
    net.exec(cut, "ip", "link", "set", "eth0", "up")
    wait_until(cluster.nodes[0].ready, LEASE * 10, f"{cut} ready again")
    asyncio.run(drive(eps, range(6, 8), cluster.urls()))
    assert moved
    check_moved(eps, moved, {f"{cut}/0", f"{cut}/1"})
