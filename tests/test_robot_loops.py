"""Issue 36 item 9: a robot that runs the README's loop, with ``affinity.Client`` or the
unmodified ``openpi-client``, rides out the crash (kill -9) of the node that owns its
episode with default settings (lease 10 s, act deadline 5 s, the client's defaults): the
loop finishes, one reply says ``state_reset``, nothing is raised. It used to give up after
5 x ``Retry-After: 1`` (Client) or end with ``owner_unreachable`` and the socket closed
(openpi), while the lease still ran."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.procs import Node, RedisServer
from tests.test_cluster import Cluster, running
from tests.test_walkthrough import Robot, camera, demo, run_loop, snippet

pytestmark = [
    pytest.mark.shapes,
    pytest.mark.integration,
    # openpi-client 0.1.2 calls websockets' connect() outside a with block
    pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager"),
]

STEPS = 8
CRASH = 3  # the owner is killed before the robot's step 3 (counting from 0)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, node_shape: str) -> Iterator[Cluster]:
    """Three nodes serving both demo policies with the default lease and act deadline."""
    tmp = tmp_path_factory.mktemp("robots")
    redis = RedisServer(tmp)
    nodes = [
        Node(tmp, f"r{i}", redis.url, devices="cpu:1", env={"AFFINITY_CLUSTER_SECRET": "s"},
             extra=["--model", "demo", "--model", "vla-demo"])
        for i in range(3)
    ]  # fmt: skip
    with running(redis, nodes) as cluster:
        yield cluster


def alive(cluster: Cluster) -> list[Node]:
    return [n for n in cluster.nodes if n.proc.popen is not None and n.proc.popen.poll() is None]


def kill_owner(cluster: Cluster, node: str, killed: list[str]) -> None:
    cluster.node(node).stop(signal.SIGKILL)
    killed.append(node)


def test_the_client_loop_rides_out_the_owners_crash(fleet: Cluster) -> None:
    a, b = alive(fleet)[:2]
    replies: list[Any] = []
    killed: list[str] = []
    namespace: dict[str, Any] = {}

    def before(i: int) -> None:
        if i > 0:
            replies.append(namespace["step"])
        if i == CRASH:
            kill_owner(fleet, replies[-1].node, killed)

    robot = Robot(STEPS, demo, before)
    urls = {"http://node-a:8000": a.url, "http://node-b:8000": b.url}
    run_loop(snippet("from affinity import Client"), robot, urls, namespace)
    replies.append(namespace["step"])
    assert len(replies) == STEPS and killed
    resets = [r for r in replies if r.state_reset]
    assert len(resets) == 1 and resets[0] is replies[CRASH], [(r.node, r.routing) for r in replies]
    assert resets[0].routing == "reassigned" and resets[0].node != killed[0]
    assert len({r.device for r in replies[CRASH:]}) == 1


def test_the_openpi_loop_rides_out_the_owners_crash(fleet: Cluster) -> None:
    a, b = alive(fleet)[:2]
    ws = {n: n.url.replace("http://", "ws://") for n in (a, b)}
    replies: list[dict[str, Any]] = []
    killed: list[str] = []
    namespace: dict[str, Any] = {}

    def before(i: int) -> None:
        if i > 0:
            replies.append(namespace["reply"])
        if i == CRASH:
            kill_owner(fleet, replies[-1]["node"], killed)

    robot = Robot(STEPS, camera, before)
    code = snippet("WebsocketClientPolicy")
    run_loop(code, robot, {"ws://node-a:8000": ws[a], "ws://node-b:8000": ws[b]}, namespace)
    replies.append(namespace["reply"])
    assert len(replies) == STEPS and killed
    resets = [r for r in replies if r["state_reset"]]
    seen = [(r["node"], r["routing"], r["seq"]) for r in replies]
    assert len(resets) == 1 and resets[0] is replies[CRASH], seen
    assert resets[0]["routing"] == "reassigned" and resets[0]["node"] != killed[0]
    after = [r["seq"] for r in replies[CRASH:]]
    assert after == list(range(after[0], after[0] + len(after))), seen  # numbered on


def test_the_openpi_loop_reconnects_at_once_when_its_node_stops_gracefully(
    fleet: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 42 item 6: the node the robot is connected to stops gracefully (SIGTERM): it
    moves the episode with its state and closes the websocket with 1012. The README's loop
    slept its 1 s pause before it reconnected, although nothing was wrong. It reconnects at
    once now (no pause from the loop), and the robot sees no reset, its seq numbered on."""
    for node in fleet.nodes:  # the crash tests above killed some
        if node not in alive(fleet):
            node.start()
    a, b = alive(fleet)[:2]
    ws = {n: n.url.replace("http://", "ws://") for n in (a, b)}
    replies: list[dict[str, Any]] = []
    namespace: dict[str, Any] = {}
    pauses: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        if sys._getframe(1).f_code.co_filename == "README.md":  # the loop's own pauses
            pauses.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", sleep)

    def before(i: int) -> None:
        if i > 0:
            replies.append(namespace["reply"])
        if i == CRASH:
            a.proc.stop(signal.SIGTERM, timeout=60)  # the node the loop is connected to

    robot = Robot(STEPS, camera, before)
    urls = {"ws://node-a:8000": ws[a], "ws://node-b:8000": ws[b], "robot-7-ep-3": "graceful"}
    run_loop(snippet("WebsocketClientPolicy"), robot, urls, namespace)
    replies.append(namespace["reply"])
    seen = [(r["node"], r["routing"], r["seq"]) for r in replies]
    assert len(replies) == STEPS, seen
    assert not any(r["state_reset"] for r in replies), seen
    assert [r["seq"] for r in replies] == list(range(1, STEPS + 1)), seen
    assert all(r["node"] != a.node_id for r in replies[CRASH:]), seen
    assert pauses == [], f"the loop paused {pauses} although the node stopped gracefully"
