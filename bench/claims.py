"""Claim-path figures against a real redis-server on loopback, each as a ratio to a
baseline measured in the same run.

1. new-episode claim latency vs a bare GET with the same client (p50, p99)
2. sticky hit latency vs GET (p50)
3. claims/s with 8 client processes vs a no-op EVALSHA at the same concurrency
4. Redis CPU per claim (and per hit) with 256 devices (32 nodes x 8) vs 4 devices
   (``INFO commandstats``: usec_per_call of EVALSHA); and with 256 devices serving 4 models
   (one ring each; model m0 in two versions shared 1:1 by rollout weights, claims cycling
   over the models) vs 4 devices serving one model (``--models-only``: this figure alone)
5. Redis bytes per live episode at 1,000,000 live episodes vs the floor of the same keys
   and values as plain ``SET k v PXAT`` strings (same run), on a fleet with realistic
   capacity (64 per device); what ``affinity episodes --device`` / ``--node`` cost there
6. claim p50 at 1,000,000 live episodes vs at 1,000 (the same fleet in a second namespace,
   claims interleaved)

Each latency figure is the median over ``--runs`` rounds of interleaved batches.
Usage: python -m bench.claims [--runs 5] [--samples 2000] [--live 1000000]
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import os
import time
from typing import Any

import redis
import redis.asyncio

from affinity import Claims, DeviceRegistration, Inventory, ModelId, Models, Registry, Settings
from bench.common import RedisServer, median, options, pct, report, tmpdir

NOOP = "return 1"
HOUR = 3600.0
FLEET_CAPACITY = 64  # per device, for the 1,000,000-episode fleet (listpack load sets)


def settings(url: str, namespace: str = "affinity") -> Settings:
    # long leases and TTLs: the benchmark does not renew, and nothing should expire
    return Settings(redis_url=url, namespace=namespace, episode_ttl_s=HOUR, lease_ttl_s=10 * HOUR)


def devices(n: int, capacity: int) -> list[DeviceRegistration]:
    return [
        DeviceRegistration(i, "cuda", "bench", f"u{i}", "sm_90", 0, capacity=capacity)
        for i in range(n)
    ]


async def register_fleet(
    url: str, nodes: int, per_node: int, capacity: int, namespace: str = "affinity", models: int = 0
) -> None:
    """``models`` > 0: every node serves m0..m<models-1>, m0 as v1 on even nodes and v2 on
    odd ones (given weights 1:1 when there are two nodes or more)."""
    client = redis.asyncio.Redis.from_url(url, decode_responses=True)
    registry = Registry(client, settings(url, namespace))
    await registry.new_fleet()  # a new fleet: no grace period (else no claim for a lease)
    for n in range(nodes):
        served = {ModelId(f"m{j}", f"v{2 if j == 0 and n % 2 else 1}"): "{}" for j in range(models)}
        await registry.register(
            f"bench-{n}", f"http://bench-{n}", devices(per_node, capacity), models=served
        )
    if models and nodes > 1:
        for version in ("v1", "v2"):
            await Models(client, settings(url, namespace)).rollout("m0", version, 1)
    await client.aclose()


def fresh(server: RedisServer, nodes: int, per_node: int, capacity: int, models: int = 0) -> None:
    server.client().flushall()
    asyncio.run(register_fleet(server.url, nodes, per_node, capacity, models=models))


# -- latency --------------------------------------------------------------------------------


async def latencies(url: str, samples: int, runs: int, prefix: str) -> dict[str, list[float]]:
    client = redis.asyncio.Redis.from_url(url, decode_responses=True)
    claims = Claims(client, settings(url))
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


async def small_and_big(url: str, samples: int, runs: int) -> dict[str, list[float]]:
    """Claim latency in namespace "small" (1,000 live) and "big" (the many live), same
    fleet, interleaved so that both see the same machine."""
    client = redis.asyncio.Redis.from_url(url, decode_responses=True)
    small, big = Claims(client, settings(url, "small")), Claims(client, settings(url, "big"))
    out: dict[str, list[float]] = {"small": [], "big": []}
    for run in range(runs):
        for i in range(samples):
            for name, claims in (("small", small), ("big", big))[:: 1 if i % 2 else -1]:
                t0 = time.perf_counter()
                await claims.resolve(f"lat-{run}-{i}")
                out[name].append(time.perf_counter() - t0)
    await client.aclose()
    return out


def per_run(values: list[float], runs: int, q: float) -> list[float]:
    n = len(values) // runs
    return [pct(values[i * n : (i + 1) * n], q) for i in range(runs)]


# -- throughput -----------------------------------------------------------------------------


def _throughput_worker(url: str, kind: str, n: int, tag: int, barrier: Any, out: Any) -> None:
    async def main() -> None:
        client = redis.asyncio.Redis.from_url(url, decode_responses=True)
        claims = Claims(client, settings(url))
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


# -- Redis CPU per call ---------------------------------------------------------------------


def evalsha_usec(r: redis.Redis) -> float:
    stats = r.info("commandstats")
    return float(stats["cmdstat_evalsha"]["usec_per_call"])


async def _claims_then_hits(url: str, n: int, tag: str, models: int) -> tuple[float, float]:
    client = redis.asyncio.Redis.from_url(url, decode_responses=True)
    claims = Claims(client, settings(url))
    r = redis.Redis.from_url(url)

    def model(i: int) -> str:
        return f"m{i % models}" if models else ""

    await claims.resolve(f"{tag}-warm", model=model(0))  # loads the script
    r.config_resetstat()
    for i in range(n):
        await claims.resolve(f"{tag}-{i}", model=model(i))
    claim_usec = evalsha_usec(r)
    r.config_resetstat()
    for i in range(n):
        await claims.resolve(f"{tag}-{i}", model=model(i))
    hit_usec = evalsha_usec(r)
    r.close()
    await client.aclose()
    return claim_usec, hit_usec


def redis_cpu(
    server: RedisServer, nodes: int, per_node: int, n: int, rounds: int, models: int = 0
) -> Any:
    claim, hit = [], []
    for i in range(rounds):
        fresh(server, nodes, per_node, 10 * n, models)
        c, h = asyncio.run(_claims_then_hits(server.url, n, f"cpu{i}", models))
        claim.append(c)
        hit.append(h)
    return median(claim), median(hit)


# -- memory ---------------------------------------------------------------------------------


def used_memory(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


def live_id(i: int) -> str:
    return f"live-{i:07d}"


def fill(url: str, start: int, stop: int, namespace: str = "affinity") -> None:
    """Claim episodes ``start..stop`` through the real script, pipelined 1,000 at a time."""
    r = redis.Redis.from_url(url, decode_responses=True)
    s = settings(url, namespace)
    script = Claims(None, s).scripts.resolve
    r.script_load(script.text)
    for first in range(start, stop, 1000):
        pipe = r.pipeline(transaction=False)
        for i in range(first, min(stop, first + 1000)):
            key = s.keys.episode(live_id(i))
            # resolve.lua's ARGV: no restart, a claim id, no model, no version, no lease heard of
            args = ("", os.urandom(8).hex(), "", "", 0)
            pipe.execute_command("EVALSHA", script.sha, 1, key, *args)
        for reply in pipe.execute():
            assert reply.startswith("claimed "), reply
    r.close()


def floor_bytes(server: RedisServer, live: int, values: list[str]) -> float:
    """Bytes per key of ``live`` plain ``SET <episode key> <value> PXAT`` strings."""
    server.client().flushall()
    r = redis.Redis.from_url(server.url)
    keys = settings(server.url).keys
    base = used_memory(r)
    deadline = int(time.time() * 1000) + 3_600_000
    for first in range(0, live, 1000):
        pipe = r.pipeline(transaction=False)
        for i in range(first, min(live, first + 1000)):
            pipe.set(keys.episode(live_id(i)), values[i % len(values)], pxat=deadline)
        pipe.execute()
    per_key = (used_memory(r) - base) / live
    r.close()
    server.client().flushall()
    return per_key


async def listing_ms(url: str, device: str, node: str) -> tuple[float, float, int, int]:
    client = redis.asyncio.Redis.from_url(url, decode_responses=True)
    inventory = Inventory(client, settings(url, "big"))
    times_d, times_n = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        on_device = await inventory.episodes(device=device)
        t1 = time.perf_counter()
        on_node = await inventory.episodes(node=node)
        t2 = time.perf_counter()
        times_d.append(t1 - t0)
        times_n.append(t2 - t1)
    await client.aclose()
    return median(times_d) * 1e3, median(times_n) * 1e3, len(on_device), len(on_node)


# -- main -----------------------------------------------------------------------------------


def main() -> None:
    a = options(
        runs=5,
        samples=2000,
        procs=8,
        live=1_000_000,
        cpu_claims=5000,
        models_only=(False, "the 256 x 4 models figure alone"),
    )
    if a.models_only:
        models_figure(a.cpu_claims)
        return
    per_node = 8
    # room for the live episodes and the latency rounds run on top of them
    fleet_nodes = math.ceil((a.live + 10_000) * 1.02 / FLEET_CAPACITY / per_node)
    server = RedisServer(tmpdir()).start()
    r = server.client()
    try:
        url = server.url
        fresh(server, 1, 4, a.live + 100_000)
        lat = asyncio.run(latencies(url, a.samples, a.runs, "lat"))
        get50 = median(per_run(lat["get"], a.runs, 50))
        get99 = median(per_run(lat["get"], a.runs, 99))
        claim50 = median(per_run(lat["claim"], a.runs, 50))
        claim99 = median(per_run(lat["claim"], a.runs, 99))
        hit50 = median(per_run(lat["hit"], a.runs, 50))

        tp_claim, tp_noop = [], []
        for run in range(3):
            tp_noop.append(throughput(url, "noop", a.procs, 2000, run))
            tp_claim.append(throughput(url, "claim", a.procs, 2000, run))

        claim4, hit4 = redis_cpu(server, 1, 4, a.cpu_claims, 3)
        claim256, hit256 = redis_cpu(server, 32, 8, a.cpu_claims, 3)
        m_claim4, m_hit4 = redis_cpu(server, 1, 4, a.cpu_claims, 3, models=1)
        m_claim256, m_hit256 = redis_cpu(server, 32, 8, a.cpu_claims, 3, models=4)

        # memory: the floor first (plain strings with the same keys and values), then the
        # real thing on a fleet of capacity-64 devices; a second namespace with the same
        # fleet and 1,000 live episodes is the baseline of the claim latency at scale
        fresh(server, fleet_nodes, per_node, FLEET_CAPACITY)
        fill(url, 0, 1000)
        sample_values = [r.get(settings(url).keys.episode(live_id(i))) for i in range(1000)]
        floor = floor_bytes(server, a.live, sample_values)
        for namespace in ("small", "big"):
            asyncio.run(register_fleet(url, fleet_nodes, per_node, FLEET_CAPACITY, namespace))
        fill(url, 0, 1000, "small")
        base_mem = used_memory(r)
        fill(url, 0, a.live, "big")
        per_episode = (used_memory(r) - base_mem) / a.live
        keys = settings(url, "big").keys
        device = r.get(keys.episode(live_id(0))).split(" ")[0]
        encoding = r.object("encoding", keys.load(device))
        by_device_ms, by_node_ms, n_device, n_node = asyncio.run(
            listing_ms(url, device, device.split("/")[0])
        )
        scale = asyncio.run(small_and_big(url, 1000, 3))
        small50 = median(per_run(scale["small"], 3, 50))
        big50 = median(per_run(scale["big"], 3, 50))
    finally:
        server.stop()

    tp = median(tp_claim) / median(tp_noop)
    figures = [
        figure(
            "claim p50 / GET p50",
            claim50 / get50,
            f"{claim50 / get50:.2f}x ({claim50 * 1e6:.0f} us vs {get50 * 1e6:.0f} us)",
            "<= 1.5x",
            claim50 / get50 <= 1.5,
        ),
        figure(
            "claim p99 / GET p99",
            claim99 / get99,
            f"{claim99 / get99:.2f}x ({claim99 * 1e6:.0f} us vs {get99 * 1e6:.0f} us)",
            "<= 2x",
            claim99 / get99 <= 2,
        ),
        figure(
            "hit p50 / GET p50",
            hit50 / get50,
            f"{hit50 / get50:.2f}x ({hit50 * 1e6:.0f} us vs {get50 * 1e6:.0f} us)",
            "<= 1.3x",
            hit50 / get50 <= 1.3,
        ),
        figure(
            f"claims/s / no-op EVALSHA/s, {a.procs} processes",
            tp,
            f"{tp:.0%} ({median(tp_claim):.0f}/s vs {median(tp_noop):.0f}/s)",
            ">= 70%",
            tp >= 0.7,
        ),
        figure(
            "Redis CPU per claim, 256 devices (32 nodes x 8) / 4 devices",
            claim256 / claim4,
            f"{claim256 / claim4:.2f}x ({claim256:.1f} us vs {claim4:.1f} us per EVALSHA)",
            "<= 1.5x",
            claim256 / claim4 <= 1.5,
        ),
        figure(
            "Redis CPU per hit, 256 devices / 4 devices",
            hit256 / hit4,
            f"{hit256 / hit4:.2f}x ({hit256:.1f} us vs {hit4:.1f} us per EVALSHA)",
            "<= 1.5x",
            hit256 / hit4 <= 1.5,
        ),
        *model_figures(m_claim4, m_hit4, m_claim256, m_hit256),
        figure(
            f"Redis bytes per live episode at {a.live:,} / one plain string key with PXAT",
            per_episode / floor,
            f"{per_episode / floor:.2f}x ({per_episode:.0f} B vs {floor:.0f} B; "
            f"{fleet_nodes * per_node:,} devices of capacity {FLEET_CAPACITY}, load sets "
            f"{encoding})",
            "<= 1.25x",
            per_episode / floor <= 1.25,
        ),
        figure(
            f"claim p50 at {a.live:,} live / at 1,000 live (same fleet, interleaved)",
            big50 / small50,
            f"{big50 / small50:.2f}x ({big50 * 1e6:.0f} us vs {small50 * 1e6:.0f} us)",
            "<= 1.2x",
            big50 / small50 <= 1.2,
        ),
    ]
    extra = {
        "episodes_listing_at_live": {
            "live": a.live,
            "by_device_ms": round(by_device_ms, 2),
            "by_device_rows": n_device,
            "by_node_ms": round(by_node_ms, 2),
            "by_node_rows": n_node,
        }
    }
    print(
        f"affinity episodes at {a.live:,} live: --device {by_device_ms:.1f} ms "
        f"({n_device} rows), --node {by_node_ms:.1f} ms ({n_node} rows)"
    )
    report("claims", figures, extra)


def figure(name: str, value: float, result: str, goal: str, ok: bool) -> dict[str, Any]:
    return {"figure": name, "value": value, "result": result, "goal": goal, "ok": ok}


def model_figures(claim4: float, hit4: float, claim256: float, hit256: float) -> list[Any]:
    return [
        figure(
            "Redis CPU per claim, 256 devices x 4 models (m0 in 2 weighted versions) / "
            "4 devices x 1 model",
            claim256 / claim4,
            f"{claim256 / claim4:.2f}x ({claim256:.1f} us vs {claim4:.1f} us per EVALSHA)",
            "<= 1.5x",
            claim256 / claim4 <= 1.5,
        ),
        figure(
            "Redis CPU per hit, 256 devices x 4 models / 4 devices x 1 model",
            hit256 / hit4,
            f"{hit256 / hit4:.2f}x ({hit256:.1f} us vs {hit4:.1f} us per EVALSHA)",
            "<= 1.5x",
            hit256 / hit4 <= 1.5,
        ),
    ]


def models_figure(n: int) -> None:
    server = RedisServer(tmpdir()).start()
    try:
        plain4, _ = redis_cpu(server, 1, 4, n, 3)
        claim4, hit4 = redis_cpu(server, 1, 4, n, 3, models=1)
        claim256, hit256 = redis_cpu(server, 32, 8, n, 3, models=4)
    finally:
        server.stop()
    figures = model_figures(claim4, hit4, claim256, hit256)
    figures.append(
        figure(
            "Redis CPU per claim, 4 devices x 1 model / 4 devices without models",
            claim4 / plain4,
            f"{claim4 / plain4:.2f}x ({claim4:.1f} us vs {plain4:.1f} us per EVALSHA)",
            "(for information)",
            True,
        )
    )
    report("claims-models", figures, {})


if __name__ == "__main__":
    main()
