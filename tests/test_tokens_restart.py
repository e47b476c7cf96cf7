"""Fencing tokens never go backwards, even after Redis restarts empty (real Redis)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis.asyncio

from affinity import Claims, DeviceRegistration, Registry, Settings
from tests.procs import RedisServer

pytestmark = pytest.mark.integration


async def claim_tokens(url: str, prefix: str, n: int) -> list[int]:
    client = redis.asyncio.Redis.from_url(url, decode_responses=True)
    settings = Settings(redis_url=url)
    await Registry(client, settings).new_fleet()  # nobody serves: no grace period to wait out
    await Registry(client, settings).register(
        "a", "http://a", [DeviceRegistration(0, "cpu", "c", "u", "cpu", 0, capacity=100)]
    )
    claims = Claims(client, settings)
    tokens = [(await claims.resolve(f"{prefix}-{i}")).token for i in range(n)]
    await client.aclose()
    return tokens


def test_tokens_exceed_old_ones_after_empty_restart(tmp_path: Path) -> None:
    server = RedisServer(tmp_path).start()
    try:
        before = asyncio.run(claim_tokens(server.url, "old", 50))
        server.restart()
        assert server.client().dbsize() == 0, "the restarted server must be empty"
        after = asyncio.run(claim_tokens(server.url, "new", 50))
    finally:
        server.stop()
    assert min(after) > max(before)
    assert after == sorted(after) and len(set(after)) == len(after)
