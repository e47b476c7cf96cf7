"""The ``redis-cli`` lines of docs/redis.md, run verbatim (plus ``-p <port>``) by the real
``redis-cli`` against a throwaway redis-server holding known assignments."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import redis.asyncio

from affinity import Claims, DeviceRegistration, Keys, ModelId, Registry, Settings
from tests.procs import ROOT, RedisServer

pytestmark = pytest.mark.integration

KEYS = Keys("affinity")
DEMO = ModelId("demo_policy", "v1")
CONTRACT = json.dumps({"inputs": [{"name": "obs", "shape": ["batch", 8], "dtype": "float32"}]})
EPISODES = ["ep-42", *(f"ep-{i}" for i in range(1, 8))]
EXPIRED = "ep-6"  # its idle deadline passed: still in the load set, no longer live


@dataclass
class Fleet:
    server: RedisServer
    placed: dict[str, tuple[str, int, str]]  # live episode -> (device, token, claim id)
    on_a0: set[str]  # live episodes on gpu-a/0
    now_ms: int


Check = Callable[[str, Fleet], None]


def check_get(out: str, f: Fleet) -> None:
    device, token, claim = f.placed["ep-42"]
    assert out == f"{device} {token} {claim} demo_policy@v1\n"
    assert device == "gpu-a/0"


def check_ttl(out: str, f: Fleet) -> None:
    backstop = Settings(episode_ttl_s=300, lease_ttl_s=60).backstop_ms / 1000
    assert 0 < int(out) <= backstop


def check_scan(out: str, f: Fleet) -> None:
    assert sorted(out.split()) == sorted(KEYS.episode(ep) for ep in f.placed)


def check_device_hash(out: str, f: Fleet) -> None:
    lines = out.splitlines()
    fields = dict(zip(lines[0::2], lines[1::2], strict=True))
    assert fields["node"] == "gpu-a" and fields["index"] == "0"
    assert fields["kind"] == "cuda" and fields["name"] == "NVIDIA H200"
    assert fields["capacity"] == "4" and fields["weight"] == "1"
    assert fields["state"] == "active"


def check_live_count(out: str, f: Fleet) -> None:
    assert int(out) == len(f.on_a0)  # not counting EXPIRED, which ZCARD would


def check_live_members(out: str, f: Fleet) -> None:
    lines = out.splitlines()
    assert set(lines[0::2]) == f.on_a0
    assert all(float(score) > f.now_ms for score in lines[1::2])


def check_events(out: str, f: Fleet) -> None:
    lines = out.splitlines()
    types = [lines[i + 1] for i, line in enumerate(lines[:-1]) if line == "type"]
    assert types == ["claim"] * len(EPISODES) + ["rollout"] + ["node-up"]  # newest first


def check_nodes(out: str, f: Fleet) -> None:
    lines = out.splitlines()
    assert lines[0::2] == ["gpu-a", "gpu-b"]
    assert all(float(score) > f.now_ms for score in lines[1::2])


def check_node_hash(out: str, f: Fleet) -> None:
    lines = out.splitlines()
    fields = dict(zip(lines[0::2], lines[1::2], strict=True))
    assert (fields["url"], fields["state"]) == ("http://gpu-a:8000", "up")
    assert fields["devices"] == "gpu-a/0,gpu-a/1"
    assert fields["models"] == "demo_policy@v1,vla@v1"


def check_route(out: str, f: Fleet) -> None:
    assert out == "gpu-a active 4 1 http://gpu-a:8000\n"


def check_ring(out: str, f: Fleet) -> None:
    lines = out.splitlines()
    # gpu-b/0 is full (capacity 2); the two others were picked 3 times each
    assert lines == ["gpu-a/0", "3", "gpu-a/1", "3"]


def check_full(out: str, f: Fleet) -> None:
    device, deadline = out.splitlines()
    assert device == "gpu-b/0" and float(deadline) > f.now_ms


def check_models(out: str, f: Fleet) -> None:
    assert out == "demo_policy@v1,vla@v1\n"


def check_versions(out: str, f: Fleet) -> None:
    version, registered = out.splitlines()
    assert version == "v1" and 0 < f.now_ms - float(registered) < 600_000


def check_rollout(out: str, f: Fleet) -> None:
    assert out.splitlines() == ["v1", "1"]


def check_contract(out: str, f: Fleet) -> None:
    assert json.loads(out)["inputs"][0]["name"] == "obs"


def check_devices(out: str, f: Fleet) -> None:
    assert sorted(out.split()) == ["gpu-a/0", "gpu-a/1", "gpu-b/0"]


# Each line appears verbatim in docs/redis.md ("Inspecting with redis-cli").
DOCUMENTED: list[tuple[str, Check]] = [
    ("redis-cli GET '{affinity}:episode:ep-42'", check_get),
    ("redis-cli TTL '{affinity}:episode:ep-42'", check_ttl),
    ("redis-cli --scan --pattern '{affinity}:episode:*'", check_scan),
    ("redis-cli SMEMBERS '{affinity}:devices'", check_devices),
    ("redis-cli HGETALL '{affinity}:device:gpu-a/0'", check_device_hash),
    (
        """redis-cli ZCOUNT '{affinity}:load:gpu-a/0' "($(($(date +%s%N)/1000000))" +inf""",
        check_live_count,
    ),
    (
        "redis-cli ZRANGE '{affinity}:load:gpu-a/0' "
        """"($(($(date +%s%N)/1000000))" +inf BYSCORE WITHSCORES""",
        check_live_members,
    ),
    (
        """redis-cli EVAL "local t = redis.call('TIME') return redis.call('ZCOUNT', KEYS[1], """
        """'(' .. (t[1] * 1000 + math.floor(t[2] / 1000)), '+inf')" 1 '{affinity}:load:gpu-a/0'""",
        check_live_count,
    ),
    ("redis-cli XREVRANGE '{affinity}:events' + - COUNT 10", check_events),
    ("redis-cli ZRANGE '{affinity}:nodes' 0 -1 WITHSCORES", check_nodes),
    ("redis-cli HGETALL '{affinity}:node:gpu-a'", check_node_hash),
    ("redis-cli HGET '{affinity}:route' gpu-a/0", check_route),
    ("redis-cli ZRANGE '{affinity}:ring:demo_policy@v1' 0 -1 WITHSCORES", check_ring),
    ("redis-cli HGET '{affinity}:node:gpu-a' models", check_models),
    ("redis-cli ZRANGE '{affinity}:versions:demo_policy' 0 -1 WITHSCORES", check_versions),
    ("redis-cli HGETALL '{affinity}:rollout:demo_policy'", check_rollout),
    ("redis-cli GET '{affinity}:contract:demo_policy@v1'", check_contract),
    ("redis-cli ZRANGE '{affinity}:full' 0 -1 WITHSCORES", check_full),
]


def cuda(node: str, n: int, capacity: int = 4) -> list[DeviceRegistration]:
    return [
        DeviceRegistration(
            i, "cuda", "NVIDIA H200", f"{node}-{i}", "sm_90", 143_771, capacity=capacity
        )
        for i in range(n)
    ]


async def populate(url: str) -> dict[str, tuple[str, int]]:
    client = redis.asyncio.Redis.from_url(url, decode_responses=True)
    settings = Settings(redis_url=url, namespace="affinity", episode_ttl_s=300, lease_ttl_s=60)
    try:
        registry, claims = Registry(client, settings), Claims(client, settings)
        both = {DEMO: CONTRACT, ModelId("vla", "v1"): CONTRACT}
        await registry.register("gpu-a", "http://gpu-a:8000", cuda("gpu-a", 2), models=both)
        await registry.register("gpu-b", "http://gpu-b:8000", cuda("gpu-b", 1, capacity=2),
                                models={DEMO: CONTRACT})  # fmt: skip
        await registry.rollout("demo_policy", "v1", 1)
        placed = {}
        for ep in EPISODES:
            a = await claims.resolve(ep, model="demo_policy")
            placed[ep] = (a.device, a.token, a.claim)
        return placed
    finally:
        await client.aclose()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    if shutil.which("redis-cli") is None:
        pytest.fail("redis-cli is not installed (bash .ci/run installs it)", pytrace=False)
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        placed = asyncio.run(populate(server.url))
        assert placed["ep-42"][0] == "gpu-a/0", "the first claim takes the first device"
        assert placed[EXPIRED][0] == "gpu-a/0", placed
        # What an idle TTL running out looks like (see tests/conftest.py Env.expire).
        r = server.client()
        r.delete(KEYS.episode(EXPIRED))
        r.zadd(KEYS.load("gpu-a/0"), {EXPIRED: 1})
        del placed[EXPIRED]
        on_a0 = {ep for ep, (d, _, _) in placed.items() if d == "gpu-a/0"}
        assert r.zcard(KEYS.load("gpu-a/0")) == len(on_a0) + 1
        yield Fleet(server, placed, on_a0, int(time.time() * 1000))
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("line", "check"),
    DOCUMENTED,
    ids=[f"{i}-{line.split()[1]}" for i, (line, _) in enumerate(DOCUMENTED)],
)
def test_documented_line(fleet: Fleet, line: str, check: Check) -> None:
    assert line.startswith("redis-cli ")
    command = line.replace("redis-cli ", f"redis-cli -p {fleet.server.port} ", 1)
    done = subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, timeout=30, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert not done.stdout.startswith("(error)") and "ERR" not in done.stdout, done.stdout
    check(done.stdout, fleet)


def test_documented_lines_are_in_the_docs() -> None:
    doc = (ROOT / "docs" / "redis.md").read_text(encoding="utf-8")
    missing = [line for line, _ in DOCUMENTED if line not in doc]
    assert not missing, "docs/redis.md lacks these redis-cli lines:\n" + "\n".join(missing)
