"""Multi-host behaviour with real processes on loopback: a real redis-server and three
``affinity-node`` processes (2 CPU devices each, 2 s leases). Every loop is bounded in
count and time; every process is killed at teardown."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from affinity import Keys
from node.models import DEMO_MODEL
from tests.procs import Node, RedisServer, free_port, wait_until
from tests.rollout import reference_rollout

pytestmark = pytest.mark.integration

LEASE = 2.0
KEYS = Keys()
SECRET = {"AFFINITY_CLUSTER_SECRET": "test-secret"}


@dataclass
class Cluster:
    redis: RedisServer
    nodes: list[Node]

    def urls(self, *, without: tuple[str, ...] = ()) -> list[str]:
        return [n.url for n in self.nodes if n.node_id not in without]

    def node(self, node_id: str) -> Node:
        return next(n for n in self.nodes if n.node_id == node_id)


@contextmanager
def running(redis: RedisServer, nodes: list[Node]) -> Iterator[Cluster]:
    """Start Redis and the nodes, wait until every node is ready; kill all at the end."""
    try:
        redis.start()
        for n in nodes:
            n.proc.start()
        for n in nodes:
            wait_until(n.ready, 60, f"{n.node_id} ready")
        yield Cluster(redis, nodes)
    finally:
        for n in nodes:
            n.stop(signal.SIGKILL)
        redis.stop()


@contextmanager
def grpc_nodes(tmp: Path, prefix: str, extra: list[str]) -> Iterator[tuple[Cluster, list[str]]]:
    """Three real nodes (two cpu devices each, one Redis) that also serve KServe over gRPC;
    the cluster and the nodes' gRPC addresses."""
    redis = RedisServer(tmp)
    ports = [free_port() for _ in range(3)]
    nodes = [
        Node(
            tmp,
            f"{prefix}{i}",
            redis.url,
            devices="cpu:2",
            env={"AFFINITY_CLUSTER_SECRET": "s"},
            extra=["--lease-ttl", "5", "--act-deadline", "8", *extra, "--grpc-port", str(port)],
        )
        for i, port in enumerate(ports)
    ]
    with running(redis, nodes) as c:
        yield c, [f"127.0.0.1:{p}" for p in ports]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    redis = RedisServer(tmp_path)
    nodes = [
        Node(
            tmp_path,
            f"n{i}",
            redis.url,
            devices="cpu:2",
            env=SECRET,
            extra=["--lease-ttl", str(LEASE), "--capacity", "200", "--act-deadline", "3"],
        )
        for i in range(3)
    ]
    with running(redis, nodes) as c:
        yield c


@dataclass
class Episode:
    id: str
    obs: list[np.ndarray]
    replies: list[dict[str, Any]] = field(default_factory=list)
    errors: list[int] = field(default_factory=list)  # statuses of refused attempts

    @property
    def token(self) -> int | None:
        return self.replies[-1]["token"] if self.replies else None


def episodes(n: int, steps: int, seed: int) -> list[Episode]:
    rng = np.random.default_rng(seed)
    return [
        Episode(
            f"ep-{seed}-{i}", [rng.standard_normal((1, 8)).astype(np.float32) for _ in range(steps)]
        )
        for i in range(n)
    ]


async def drive(
    eps: list[Episode],
    steps: range,
    urls: list[str],
    *,
    concurrency: int = 16,
    patience: float = 15.0,
) -> None:
    """Send ``steps`` of every episode, each step to a random node; retry 503s (bounded)."""
    sem = asyncio.Semaphore(concurrency)
    rng = random.Random(0)
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=10, limits=limits) as client:

        async def one(ep: Episode) -> None:
            async with sem:
                for i in steps:
                    deadline = time.monotonic() + patience
                    while True:
                        body = {"episode_id": ep.id, "inputs": {"obs": ep.obs[i].tolist()}}
                        if ep.token is not None:
                            body["token"] = ep.token
                        r = await client.post(rng.choice(urls) + "/act", json=body)
                        if r.status_code == 200:
                            ep.replies.append(r.json())
                            break
                        assert r.status_code == 503, r.text
                        ep.errors.append(r.status_code)
                        assert time.monotonic() < deadline, f"{ep.id} step {i}: {r.text}"
                        await asyncio.sleep(0.1)

        await asyncio.gather(*(one(ep) for ep in eps))


def assert_matches(ep: Episode, start: int, replies: list[dict[str, Any]]) -> None:
    """The replies equal the reference rollout restarted at step ``start``."""
    ref = reference_rollout(DEMO_MODEL, ep.obs[start : start + len(replies)])
    for got, want in zip(replies, ref, strict=True):
        np.testing.assert_allclose(got["outputs"]["actions"], want["actions"], rtol=1e-4, atol=1e-6)


def test_300_episodes_stay_on_one_device(cluster: Cluster) -> None:
    eps = episodes(300, 20, seed=1)
    asyncio.run(drive(eps, range(20), cluster.urls()))
    r = cluster.redis.client()
    used = set()
    for ep in eps:
        devices = {x["device"] for x in ep.replies}
        assert len(devices) == 1, (ep.id, devices)
        assert [x["routing"] for x in ep.replies] == ["claimed"] + ["hit"] * 19
        assert not any(x["state_reset"] for x in ep.replies)
        assert not ep.errors
        assert_matches(ep, 0, ep.replies)
        value = r.get(KEYS.episode(ep.id))
        assert value.startswith(f"{ep.replies[0]['device']} {ep.replies[0]['token']} ")
        used |= devices
    assert len(used) == 6, "round-robin spreads episodes over every device"


def test_sigkill_moves_only_that_nodes_episodes(cluster: Cluster) -> None:
    eps = episodes(60, 20, seed=2)
    asyncio.run(drive(eps, range(10), cluster.urls()))
    victim = "n2"
    on_victim = {ep.id for ep in eps if ep.replies[-1]["node"] == victim}
    assert on_victim
    cluster.node(victim).stop(signal.SIGKILL)
    asyncio.run(drive(eps, range(10, 20), cluster.urls(without=(victim,))))
    for ep in eps:
        first, later = ep.replies[:10], ep.replies[10:]
        if ep.id in on_victim:
            assert later[0]["routing"] == "reassigned" and later[0]["state_reset"] is True
            assert later[0]["node"] != victim and later[0]["token"] > first[-1]["token"]
            assert len({x["device"] for x in later}) == 1
            assert not any(x["state_reset"] for x in later[1:])
            assert_matches(ep, 10, later)
        else:
            assert not ep.errors, (ep.id, ep.errors)
            assert len({x["device"] for x in ep.replies}) == 1
            assert not any(x["state_reset"] for x in ep.replies)
            assert_matches(ep, 0, ep.replies)


def test_paused_node_serves_nothing_that_moved(cluster: Cluster) -> None:
    eps = episodes(40, 15, seed=3)
    asyncio.run(drive(eps, range(5), cluster.urls()))
    victim = cluster.node("n1")
    victim_devices = {"n1/0", "n1/1"}
    moved = {ep.id for ep in eps if ep.replies[-1]["node"] == "n1"}
    assert moved
    victim.proc.send(signal.SIGSTOP)
    try:
        asyncio.run(drive(eps, range(5, 10), cluster.urls(without=("n1",))))
        time.sleep(0.2)
    finally:
        victim.proc.send(signal.SIGCONT)
    # straight after SIGCONT, the paused node gets requests for the moved episodes
    asyncio.run(drive([ep for ep in eps if ep.id in moved], range(10, 12), [victim.url]))
    asyncio.run(drive(eps, range(12, 15), cluster.urls()))
    r = cluster.redis.client()
    for ep in eps:
        if ep.id not in moved:
            continue
        after = ep.replies[5:]
        assert all(x["device"] not in victim_devices for x in after), ep.id
        assert len({x["device"] for x in after}) == 1
        value = r.get(KEYS.episode(ep.id))
        assert value.split()[0] == after[-1]["device"]
        assert_matches(ep, 5, after)


def test_redis_restart_reregisters_and_resumes(cluster: Cluster) -> None:
    eps = episodes(30, 12, seed=4)
    asyncio.run(drive(eps, range(6), cluster.urls()))
    cluster.redis.restart()
    r = cluster.redis.client()
    # renewals run every LEASE/3; the bound is generous so a busy machine does not flake
    wait_until(lambda: r.zcard(KEYS.nodes) == 3, LEASE * 5, "all nodes re-registered")
    asyncio.run(drive(eps, range(6, 12), cluster.urls()))
    for ep in eps:
        # the owners re-registered within their leases and re-asserted their episodes (no
        # claim was granted meanwhile: the grace period): each episode went on on its device
        # with its state, one step at a time — never two owners
        assert not any(x["state_reset"] for x in ep.replies)
        assert len({x["device"] for x in ep.replies}) == 1
        assert_matches(ep, 0, ep.replies)


def test_a_second_process_with_the_same_node_id_is_refused(tmp_path: Path) -> None:
    redis = RedisServer(tmp_path).start()
    # the first's lease long enough that no stall of a busy machine lapses it meanwhile; the
    # second's short: it gives up after twice its own
    first = Node(tmp_path, "dup", redis.url, devices="cpu:1", extra=["--lease-ttl", "10"])
    second = Node(tmp_path, "dup", redis.url, devices="cpu:1", extra=["--lease-ttl", "1"])
    try:
        first.start()
        second.proc.start()
        assert second.proc.popen is not None
        second.proc.popen.wait(timeout=30)  # gives up after twice the lease, and says why
        assert second.proc.popen.returncode != 0
        assert "held by another running process" in second.proc.log()
        assert first.ready()
        node = redis.client().hgetall(KEYS.node("dup"))
        assert node["url"] == first.url
    finally:
        first.stop()
        second.stop()
        redis.stop()
