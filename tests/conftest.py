"""Shared fixtures: one test body, two backends (fakeredis and a real redis-server).

The real server comes from ``AFFINITY_TEST_REDIS_URL`` (``.ci/run`` exports it) and
defaults to ``redis://127.0.0.1:6379/15``. When it does not answer, tests that need it
FAIL with a message: they never skip silently.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import fakeredis
import pytest
import redis
import redis.asyncio

from affinity import Claims, DeviceRegistration, Registry, Settings

REAL_URL = os.environ.get("AFFINITY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
BACKENDS = ["fake", "real"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def require_real_redis() -> str:
    try:
        redis.Redis.from_url(REAL_URL, socket_connect_timeout=2, socket_timeout=2).ping()
    except redis.RedisError as exc:
        pytest.fail(
            f"real Redis at {REAL_URL} does not answer ({exc}); start one "
            "(bash .ci/run does) or set AFFINITY_TEST_REDIS_URL",
            pytrace=False,
        )
    return REAL_URL


@pytest.fixture
def real_redis_url() -> Iterator[str]:
    url = require_real_redis()
    r = redis.Redis.from_url(url)
    r.flushdb()
    yield url
    r.flushdb()
    r.close()


def cpu_devices(
    count: int = 2,
    *,
    capacity: int = 100,
    weights: Sequence[int] | None = None,
    uuid_prefix: str = "u",
) -> list[DeviceRegistration]:
    """CPU stand-in devices 0..count-1 (``weights`` sets count when given)."""
    weights = list(weights) if weights is not None else [1] * count
    return [
        DeviceRegistration(
            index=i,
            kind="cpu",
            name="cpu",
            uuid=f"{uuid_prefix}-cpu-{i}",
            arch="cpu",
            memory_mb=0,
            capacity=capacity,
            weight=w,
            provider="CPUExecutionProvider",
        )
        for i, w in enumerate(weights)
    ]


@dataclass
class Env:
    redis: Any
    settings: Settings
    claims: Claims
    registry: Registry

    @property
    def keys(self):  # type: ignore[no-untyped-def]
        return self.settings.keys

    async def node(self, node: str, n: int = 2, capacity: int = 100, weight: int = 1) -> list[str]:
        devices = cpu_devices(n, capacity=capacity, weights=[weight] * n, uuid_prefix=node)
        await self.registry.register(node, f"http://{node}.test:8000", devices, version="t")
        return [f"{node}/{i}" for i in range(n)]

    async def lapse(self, node: str) -> None:
        """What a lapsed lease looks like: the deadline in the past, the hash expired."""
        await self.redis.zadd(self.keys.nodes, {node: 1})
        await self.redis.delete(self.keys.node(node))

    async def expire(self, episode: str) -> None:
        """What an idle TTL running out looks like for one episode."""
        value = await self.redis.get(self.keys.episode(episode))
        device = value.rsplit(" ", 1)[0]
        await self.redis.delete(self.keys.episode(episode))
        await self.redis.zadd(self.keys.load(device), {episode: 1})

    async def snapshot(self) -> dict[str, Any]:
        """The whole keyspace, for 'nothing was written' assertions (stream ids included)."""
        out: dict[str, Any] = {}
        for key in sorted(await self.redis.keys("*")):
            kind = await self.redis.type(key)
            if kind == "string":
                out[key] = await self.redis.get(key)
            elif kind == "hash":
                out[key] = await self.redis.hgetall(key)
            elif kind == "zset":
                out[key] = await self.redis.zrange(key, 0, -1, withscores=True)
            elif kind == "set":
                out[key] = sorted(await self.redis.smembers(key))
            elif kind == "stream":
                out[key] = await self.redis.xrange(key)
            else:
                raise AssertionError(f"unexpected type {kind} for {key}")
        return out


async def make_client(backend: str) -> Any:
    if backend == "fake":
        return fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
    client = redis.asyncio.Redis.from_url(require_real_redis(), decode_responses=True)
    await client.flushdb()
    return client


@pytest.fixture(params=BACKENDS)
async def env(request: pytest.FixtureRequest) -> AsyncIterator[Env]:
    client = await make_client(request.param)
    settings = Settings(redis_url=None, episode_ttl_s=60, lease_ttl_s=10)
    yield Env(client, settings, Claims(client, settings), Registry(client, settings))
    if request.param == "real":
        await client.flushdb()
    await client.aclose()
