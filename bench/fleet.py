"""Fleet-scale simulation (issue 22): how many steps/s the Redis of one fleet sustains with
N nodes x M episodes, owner-authoritative (the owner serves from memory; Redis sees each
node's renewals and its flush) against per-step scripts (every step one resolve).

The Redis CPU of each script is measured on a real redis-server (``INFO commandstats``
usec of EVALSHA over many calls, same run): a sticky hit (resolve), a renewal, a flush per
episode slid. The fleet's Redis load is then computed from those costs:

- per-step scripts: steps/s x hit cost; one Redis core saturates at 1 / hit cost steps/s,
  however many nodes there are;
- owner-authoritative: per node, renewals (every lease/3) + the flushes that slide each
  stepping episode's backstop once it nears (every idle timeout + lease TTL, see
  ``node/ownership.py``; at most one flush a second a node, counted as one a second when
  slides are due more often); the step rate does not appear. Claims and ends (episode
  churn) are not modelled: each is one script, as before. It saturates when the fleet's
  nodes need more renewals and slides than one core runs.

Usage: python -m bench.fleet [--calls 4000] [--hz 10] [--lease 10] [--episode-ttl 300]
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio

from affinity import Claims, DeviceRegistration, Registry, Settings
from affinity.registry import HeldEpisode
from bench.common import RedisServer, options, report, tmpdir

NODES = (10, 100, 1000)
EPISODES_PER_NODE = 64


def evalsha_usec(info: dict[str, Any]) -> tuple[int, float]:
    s = info.get("cmdstat_evalsha", {"calls": 0, "usec": 0})
    return int(s["calls"]), float(s["usec"])


async def cost(client: Any, run: Any, calls: int) -> float:
    """Redis CPU (µs) per call of ``run()``, from INFO commandstats."""
    await client.config_resetstat()
    for _ in range(calls):
        await run()
    n, usec = evalsha_usec(await client.info("commandstats"))
    return usec / max(n, 1)


async def measure(calls: int, lease: float) -> dict[str, float]:
    tmp = tmpdir()
    server = RedisServer(tmp).start()
    client = redis.asyncio.Redis.from_url(server.url, decode_responses=True)
    settings = Settings(redis_url=server.url, lease_ttl_s=lease)
    registry, claims = Registry(client, settings), Claims(client, settings)
    try:
        devices = [
            DeviceRegistration(i, "cpu", "c", f"u{i}", "cpu", 0, capacity=10_000) for i in range(8)
        ]
        await registry.register("n", "http://n", devices, instance="i")
        held = []
        for i in range(EPISODES_PER_NODE):
            a = await claims.resolve(f"e{i}")
            held.append(HeldEpisode(a.episode, a.device, a.token, a.claim, a.model))
        k = 0

        async def hit() -> None:
            nonlocal k
            k += 1
            await claims.resolve(f"e{k % EPISODES_PER_NODE}")

        async def renew() -> None:
            await registry.renew("n", "i")

        async def flush_all() -> None:
            await registry.flush("n", "i", held, [])

        async def flush_none() -> None:
            await registry.flush("n", "i", [], [("missing", 1)])

        hit_us = await cost(client, hit, calls)
        renew_us = await cost(client, renew, calls // 4)
        flush_base_us = await cost(client, flush_none, calls // 4)
        flush_all_us = await cost(client, flush_all, calls // 8)
        slide_us = (flush_all_us - flush_base_us) / EPISODES_PER_NODE
        return {
            "hit_us": hit_us,
            "renew_us": renew_us,
            "flush_base_us": flush_base_us,
            "slide_us": slide_us,
        }
    finally:
        await client.aclose()
        server.stop()


def main() -> None:
    a = options(calls=4000, hz=10.0, lease=10.0, episode_ttl=300.0)
    c = asyncio.run(measure(a.calls, a.lease))
    per_step_max = 1e6 / c["hit_us"]  # steps/s one Redis core runs as per-step scripts

    def owner_load(nodes: int) -> float:
        """Redis CPU (µs per second) of ``nodes`` owners (their step rate does not count)."""
        renewals = nodes * (3 / a.lease) * c["renew_us"]
        slides_per_s = EPISODES_PER_NODE / (a.episode_ttl + a.lease)  # one node's
        flushes = nodes * min(1.0, slides_per_s) * c["flush_base_us"]
        slides = nodes * slides_per_s * c["slide_us"]
        return renewals + flushes + slides

    rows = []
    for n in NODES:
        steps = n * EPISODES_PER_NODE * a.hz
        rows.append(
            {
                "nodes": n,
                "episodes": n * EPISODES_PER_NODE,
                "steps_per_s": steps,
                "per_step_redis_cpu": steps * c["hit_us"] / 1e6,
                "owner_redis_cpu": owner_load(n) / 1e6,
            }
        )
    per_node = owner_load(1)
    owner_nodes_max = 1e6 / per_node
    owner_steps_max = owner_nodes_max * EPISODES_PER_NODE * a.hz
    for r in rows:
        print(
            f"{r['nodes']:>5} nodes x {EPISODES_PER_NODE} episodes at {a.hz:g} Hz = "
            f"{r['steps_per_s']:>9.0f} steps/s: Redis CPU per-step scripts "
            f"{r['per_step_redis_cpu']:.0%} of a core, owner-authoritative "
            f"{r['owner_redis_cpu']:.1%}"
        )
    ratio = owner_steps_max / per_step_max
    report(
        "fleet",
        [
            {
                "figure": "steps/s one Redis core sustains: per-step scripts",
                "value": per_step_max,
                "result": f"{per_step_max:,.0f} steps/s ({c['hit_us']:.1f} µs of Redis CPU a hit)",
                "goal": "-",
                "ok": True,
            },
            {
                "figure": f"owner-authoritative, {EPISODES_PER_NODE} episodes a node at "
                f"{a.hz:g} Hz, lease {a.lease:g} s, idle timeout {a.episode_ttl:g} s",
                "value": owner_steps_max,
                "result": f"{owner_steps_max:,.0f} steps/s ({owner_nodes_max:,.0f} nodes; "
                f"{ratio:,.0f}x per-step scripts)",
                "goal": "> per-step scripts",
                "ok": ratio > 1,
            },
        ],
        {"costs_us": c, "rows": rows},
    )


if __name__ == "__main__":
    main()
