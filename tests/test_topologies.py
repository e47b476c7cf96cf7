"""The library against Redis Cluster (every key in one slot thanks to the hash tag) and
behind Sentinel, with real redis-server processes."""

from __future__ import annotations

import asyncio
import random
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from affinity import Claims, EventStream, Inventory, Registry, Settings, close, connect
from tests.conftest import cpu_devices
from tests.procs import Proc, free_port, wait_until

pytestmark = pytest.mark.integration
REDIS = shutil.which("redis-server") or "redis-server"


async def round_trip(url: str) -> None:
    """Register, claim, hit, list, drain, release, read events, deregister."""
    settings = Settings(redis_url=url, redis_deadline_s=5)
    client = connect(settings)
    registry, claims = Registry(client, settings), Claims(client, settings)
    inventory = Inventory(client, settings)
    assert await registry.new_fleet()  # a new fleet: no grace period for its first claims
    await registry.register("n", "http://n", cpu_devices(2, capacity=10))
    a = await claims.resolve("ep-1")
    assert a.status == "claimed"
    assert (await claims.resolve("ep-1")).status == "hit"
    assert {d.device: d.load for d in await inventory.devices()} == {"n/0": 1, "n/1": 0}
    assert [r.episode for r in await inventory.episodes(node="n")] == ["ep-1"]
    await registry.drain("n/1", "test")
    assert (await claims.release("ep-1", a.token, owner=True)).device == a.device
    assert [f["type"] for _, f in await EventStream(client, settings).events()] == [
        "node-up",
        "claim",
        "drain",
        "release",
    ]
    assert await registry.deregister("n") == 0
    await close(client)


def cluster_port() -> int:
    """A free port whose cluster-bus port (port + 10000) is free and valid too."""
    for _ in range(200):
        port = random.randint(20000, 50000)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise AssertionError("no free port pair for a cluster node")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[list[int]]:
    ports = [cluster_port() for _ in range(3)]
    procs = []
    try:
        for port in ports:
            d = tmp_path / str(port)
            d.mkdir()
            p = Proc(
                [
                    REDIS,
                    "--port",
                    str(port),
                    "--bind",
                    "127.0.0.1",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(d),
                ],
                None,
                d / "log",
            )
            p.start()
            procs.append(p)
        for port in ports:
            wait_until(redis.Redis(host="127.0.0.1", port=port).ping, 10, f"cluster node {port}")
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in ports),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        wait_until(
            lambda: all(
                b"cluster_state:ok"
                in redis.Redis(host="127.0.0.1", port=p).execute_command("CLUSTER", "INFO")
                for p in ports
            ),
            30,
            "cluster_state ok",
        )
        yield ports
    finally:
        for p in procs:
            p.stop()


def test_redis_cluster(cluster: list[int]) -> None:
    asyncio.run(round_trip(f"redis+cluster://127.0.0.1:{cluster[0]}"))


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[int]:
    master, port = free_port(), free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(
        f"port {port}\nbind 127.0.0.1\nsentinel monitor affinity-master 127.0.0.1 {master} 1\n"
    )
    procs = [
        Proc(
            [
                REDIS,
                "--port",
                str(master),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(tmp_path),
            ],
            None,
            tmp_path / "master.log",
        ),
        Proc([REDIS, str(conf), "--sentinel"], None, tmp_path / "sentinel.log"),
    ]
    try:
        for p in procs:
            p.start()
        wait_until(
            lambda: redis.Redis(host="127.0.0.1", port=port).execute_command(
                "SENTINEL", "get-master-addr-by-name", "affinity-master"
            ),
            20,
            "sentinel",
        )
        yield port
    finally:
        for p in procs:
            p.stop()


def test_sentinel(sentinel: int) -> None:
    asyncio.run(round_trip(f"redis+sentinel://127.0.0.1:{sentinel}/affinity-master"))
