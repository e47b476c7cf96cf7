"""Claim-path figures against a real redis-server on loopback.

1. new-episode claim latency vs a bare GET with the same client (p50, p99)
2. sticky hit latency vs GET (p50)
3. claims/s with 8 client processes vs a no-op EVALSHA at the same concurrency
6. Redis memory per live episode at 1,000,000 live episodes, and claim p50 at 1,000,000
   live episodes vs at 1,000

Each latency figure is the median over ``--runs`` rounds of interleaved batches.
Usage: python -m bench.claims [--runs 5] [--samples 2000] [--live 1000000]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time
from typing import Any

import redis
import redis.asyncio

from affinity import Claims, DeviceRegistration, Keys, Registry, Settings
from affinity.scripts import source
from bench.common import RedisServer, median, pct, report, tmpdir

NOOP = "return 1"
KEYS = Keys()


def devices(capacity: int) -> list[DeviceRegistration]:
    return [
        DeviceRegistration(i, "cuda", "bench", f"u{i}", "sm_90", 0, capacity=capacity)
        for i in range(4)
    ]


async def register(client: Any, settings: Settings, capacity: int) -> None:
    # a long lease: the benchmark does not renew
    s = settings.with_(lease_ttl_s=3600)
    await Registry(client, s).register("bench", "http://bench", devices(capacity))


async def latencies(url: str, samples: int, runs: int, prefix: str) -> dict[str, list[float]]:
    client = redis.asyncio.Redis.from_url(url, decode_responses=True)
    settings = Settings(redis_url=url, episode_ttl_s=3600)
    claims = Claims(client, settings)
    await client.set("bench:plain", "x")
    out: dict[str, list[float]] = {"get": [], "claim": [], "hit": []}
    for run in range(runs):
        for i in range(samples):
            ep = f"{prefix}-{run}-{i}"
            t0 = time.perf_counter()
            await client.get("bench:plain")
            t1 = time.perf_counter()
            await claims.resolve(ep)
            t2 = time.perf_counter()
            await claims.resolve(ep)
            t3 = time.perf_counter()
            out["get"].append(t1 - t0)
            out["claim"].append(t2 - t1)
            out["hit"].append(t3 - t2)
    await client.aclose()
    return out


def per_run(values: list[float], runs: int, q: float) -> list[float]:
    n = len(values) // runs
    return [pct(values[i * n : (i + 1) * n], q) for i in range(runs)]


def _throughput_worker(url: str, kind: str, n: int, tag: int, barrier: Any, out: Any) -> None:
    async def main() -> None:
        client = redis.asyncio.Redis.from_url(url, decode_responses=True)
        claims = Claims(client, Settings(redis_url=url, episode_ttl_s=3600))
        noop = client.register_script(NOOP)
        await noop()
        barrier.wait(60)
        t0 = time.perf_counter()
        for i in range(n):
            if kind == "claim":
                await claims.resolve(f"tp-{tag}-{i}")
            else:
                await noop()
        out.put(time.perf_counter() - t0)
        await client.aclose()

    asyncio.run(main())


def throughput(url: str, kind: str, procs: int, n: int, tag: int) -> float:
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    ps = [
        ctx.Process(target=_throughput_worker, args=(url, kind, n, tag * 100 + p, barrier, out))
        for p in range(procs)
    ]
    for p in ps:
        p.start()
    times = [out.get(timeout=600) for _ in ps]
    for p in ps:
        p.join(60)
    return procs * n / max(times)


def fill(url: str, live: int) -> None:
    """Claim ``live`` episodes through the real script, pipelined 1,000 at a time."""
    r = redis.Redis.from_url(url, decode_responses=True)
    script = r.register_script(source("resolve"))
    settings = Settings(episode_ttl_s=3600)
    batch = 1000
    for start in range(0, live, batch):
        pipe = r.pipeline(transaction=False)
        for i in range(start, min(live, start + batch)):
            ep = f"live-{i:07d}"
            script(
                keys=[KEYS.episode(ep), KEYS.rr, KEYS.token, KEYS.nodes, KEYS.events],
                args=[ep, settings.episode_ttl_ms, KEYS.prefix, settings.events_maxlen],
                client=pipe,
            )
        pipe.execute()
    r.close()


def used_memory(url: str) -> int:
    r = redis.Redis.from_url(url)
    value = int(r.info("memory")["used_memory"])
    r.close()
    return value


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--procs", type=int, default=8)
    p.add_argument("--live", type=int, default=1_000_000)
    a = p.parse_args()
    server = RedisServer(tmpdir()).start()
    try:
        url = server.url
        asyncio.run(_setup(url, a.live + 100_000))
        lat = asyncio.run(latencies(url, a.samples, a.runs, "lat"))
        get50, get99 = (
            median(per_run(lat["get"], a.runs, 50)),
            median(per_run(lat["get"], a.runs, 99)),
        )
        claim50 = median(per_run(lat["claim"], a.runs, 50))
        claim99 = median(per_run(lat["claim"], a.runs, 99))
        hit50 = median(per_run(lat["hit"], a.runs, 50))

        tp_claim, tp_noop = [], []
        for run in range(3):
            tp_noop.append(throughput(url, "noop", a.procs, 2000, run))
            tp_claim.append(throughput(url, "claim", a.procs, 2000, run))

        # claim p50 with ~1,000 live episodes (what is there now is a few thousand more
        # from the rounds above; flush and refill exactly)
        server.client().flushdb()
        asyncio.run(_setup(url, a.live + 100_000))
        fill(url, 1000)
        small = asyncio.run(latencies(url, 1000, 3, "small"))
        server.client().flushdb()
        asyncio.run(_setup(url, a.live + 100_000))
        base_mem = used_memory(url)
        fill(url, a.live)
        per_episode = (used_memory(url) - base_mem) / a.live
        r = server.client()
        sample = [f"live-{i:07d}" for i in (0, a.live // 2, a.live - 1)]
        key_usage = median([r.memory_usage(KEYS.episode(ep)) or 0 for ep in sample])
        load_usage = max(r.memory_usage(KEYS.load(f"bench/{i}")) or 0 for i in range(4))
        big = asyncio.run(latencies(url, 1000, 3, "big"))
        small50 = median(per_run(small["claim"], 3, 50))
        big50 = median(per_run(big["claim"], 3, 50))
    finally:
        server.stop()

    figures = [
        {
            "figure": "claim p50 / GET p50",
            "value": claim50 / get50,
            "result": f"{claim50 / get50:.2f}x ({claim50 * 1e6:.0f} us vs {get50 * 1e6:.0f} us)",
            "goal": "<= 1.5x",
            "ok": claim50 / get50 <= 1.5,
        },
        {
            "figure": "claim p99 / GET p99",
            "value": claim99 / get99,
            "result": f"{claim99 / get99:.2f}x ({claim99 * 1e6:.0f} us vs {get99 * 1e6:.0f} us)",
            "goal": "<= 2x",
            "ok": claim99 / get99 <= 2,
        },
        {
            "figure": "hit p50 / GET p50",
            "value": hit50 / get50,
            "result": f"{hit50 / get50:.2f}x ({hit50 * 1e6:.0f} us)",
            "goal": "<= 1.3x",
            "ok": hit50 / get50 <= 1.3,
        },
        {
            "figure": f"claims/s / no-op EVALSHA/s, {a.procs} processes",
            "value": median(tp_claim) / median(tp_noop),
            "result": f"{median(tp_claim) / median(tp_noop):.0%} ({median(tp_claim):.0f}/s vs "
            f"{median(tp_noop):.0f}/s)",
            "goal": ">= 70%",
            "ok": median(tp_claim) / median(tp_noop) >= 0.7,
        },
        {
            "figure": f"Redis bytes per live episode at {a.live:,}",
            "value": per_episode,
            "result": f"{per_episode:.0f} B (INFO used_memory; MEMORY USAGE of one assignment "
            f"{key_usage} B, largest load set {load_usage / (a.live / 4):.0f} B/member)",
            "goal": "<= 150 B",
            "ok": per_episode <= 150,
        },
        {
            "figure": f"claim p50 at {a.live:,} live / at 1,000 live",
            "value": big50 / small50,
            "result": f"{big50 / small50:.2f}x ({big50 * 1e6:.0f} us vs {small50 * 1e6:.0f} us)",
            "goal": "<= 1.2x",
            "ok": big50 / small50 <= 1.2,
        },
    ]
    report("claims", figures)


async def _setup(url: str, capacity: int) -> None:
    client = redis.asyncio.Redis.from_url(url, decode_responses=True)
    await register(client, Settings(redis_url=url), capacity)
    await client.aclose()


if __name__ == "__main__":
    main()
