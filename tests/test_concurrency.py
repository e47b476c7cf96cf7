"""Many processes resolve the same fresh episodes at the same moment (real Redis)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue
import random
from collections import Counter
from typing import Any

import pytest
import redis.asyncio

from affinity import Claims, Keys, Registry, Settings
from tests.conftest import cpu_devices

pytestmark = pytest.mark.integration

PROCESSES = 8
EPISODES = 2000


def worker(url: str, seed: int, barrier: Any, out: Any) -> None:
    """Put ``(seed, views)`` on ``out``, or ``(seed, error)`` when anything fails."""

    async def main() -> dict[str, tuple[str, int, str]]:
        client = redis.asyncio.Redis.from_url(url, decode_responses=True)
        claims = Claims(client, Settings(redis_url=url))
        ids = [f"ep-{i}" for i in range(EPISODES)]
        random.Random(seed).shuffle(ids)
        await client.ping()
        barrier.wait(timeout=60)
        seen = {}
        for ep in ids:
            a = await claims.resolve(ep)
            seen[ep] = (a.device, a.token, a.status, a.claim)
        await client.aclose()
        return seen

    try:
        out.put((seed, asyncio.run(main())))
    except BaseException as exc:
        out.put((seed, f"{type(exc).__name__}: {exc}"))
        raise


def test_concurrent_resolves_agree(real_redis_url: str) -> None:
    async def setup() -> None:
        client = redis.asyncio.Redis.from_url(real_redis_url, decode_responses=True)
        # a lease that outlives the test however slow the machine is: nobody renews it here
        settings = Settings(redis_url=real_redis_url, lease_ttl_s=3600)
        registry = Registry(client, settings)
        for node in ("a", "b"):
            devs = cpu_devices(2, capacity=600, uuid_prefix=node)
            await registry.register(node, f"http://{node}", devs)
        await client.aclose()

    asyncio.run(setup())
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(PROCESSES)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(real_redis_url, s, barrier, out)) for s in range(PROCESSES)
    ]
    for p in procs:
        p.start()
    results = []
    while len(results) < PROCESSES:
        try:
            seed, got = out.get(timeout=1)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead, f"a worker died without reporting (exit codes {dead})"
            continue
        assert not isinstance(got, str), f"worker {seed} failed: {got}"
        results.append(got)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0

    import redis as sync_redis

    r = sync_redis.Redis.from_url(real_redis_url, decode_responses=True)
    claimed = Counter()
    for ep in (f"ep-{i}" for i in range(EPISODES)):
        views = {(res[ep][0], res[ep][1], res[ep][3]) for res in results}
        assert len(views) == 1, f"{ep} seen as {views}"
        device, token, claim = views.pop()
        assert r.get(Keys().episode(ep)) == f"{device} {token} {claim}"
        claimed[ep] = sum(res[ep][2] == "claimed" for res in results)
    assert set(claimed.values()) == {1}, "each episode claimed exactly once"
    loads = {d: r.zcard(Keys().load(d)) for d in ("a/0", "a/1", "b/0", "b/1")}
    assert sum(loads.values()) == EPISODES and max(loads.values()) <= 600
    assert int(r.get(Keys().rr)) == EPISODES
