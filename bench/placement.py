"""Scored placement (issue 46): its figures against a real redis-server on loopback, each
beside a baseline measured in the same run.

(a) A fleet of two device classes, one 2x slower, 20 Hz episodes arriving until 80% of the
    fleet's capacity (the episodes it can serve within the 50 ms period): the fraction of
    episodes whose step p95 stays within the period, scored vs round-robin. The claims and
    the renewals are the real scripts on the real Redis, the scores the node's own
    ``node/placement.StepTimes``; the devices are simulated (a bench knob, nothing of it in
    the node): each runs the steps queued on it in batches of at most 8, a batch of b taking
    ``k x (3 + 0.75 b)`` ms (k = 1 fast, 2 slow; +-10% noise), in simulated time. Every device
    registers the same ``--capacity`` (the fast class's): the registered slots do not know
    which device is slower, as in a fleet whose operator set one capacity for all.
(b) A claim's Redis CPU (``INFO commandstats``, usec_per_call of EVALSHA): scored at 16 and
    1,024 devices, round-robin at 16, vs today's claim at 16 (the claim of /work/main, or
    ``--baseline-root``, run in a subprocess against the same server).

Usage: python -m bench.placement [--claims 3000] [--seconds 12] [--baseline-root /work/main]
"""

from __future__ import annotations

import asyncio
import heapq
import os
import random
import subprocess
import sys
import textwrap
from typing import Any

import redis
import redis.asyncio

from affinity import Claims, DeviceRegistration, NoCapacity, Registry, Settings
from bench.common import RedisServer, options, pct, report, tmpdir
from node.placement import StepTimes

HOUR = 3600.0
PERIOD_MS = 50.0  # 20 Hz
HEADROOM = 0.8
MAX_BATCH = 8
PER_CLASS = 4  # devices of each class


def settings(url: str) -> Settings:
    # long leases: the simulation runs faster than real time and renews on its own clock
    return Settings(redis_url=url, episode_ttl_s=HOUR, lease_ttl_s=10 * HOUR)


def devices(n: int, capacity: int) -> list[DeviceRegistration]:
    return [DeviceRegistration(i, "cpu", "bench", f"u{i}", "cpu", 0, capacity) for i in range(n)]


def run_ms(slow: bool, batch: int, rng: random.Random) -> float:
    return (2.0 if slow else 1.0) * (3 + 0.75 * batch) * rng.uniform(0.9, 1.1)


class Fleet:
    """Simulated devices: each episode steps every period from its start; a device runs
    what is queued on it in batches (event-driven, simulated ms)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.events: list[tuple[float, int, str, Any]] = []
        self.n = 0
        self.queue: dict[str, list[tuple[float, str]]] = {}
        self.busy: dict[str, bool] = {}
        self.latencies: dict[str, list[tuple[float, float]]] = {}
        self.on: dict[str, str] = {}  # episode -> device
        self.runs: list[tuple[str, int, float]] = []  # (device, batch, ms) since last read

    def push(self, at: float, kind: str, what: Any) -> None:
        self.n += 1
        heapq.heappush(self.events, (at, self.n, kind, what))

    def start(self, episode: str, device: str, at: float) -> None:
        self.on[episode] = device
        self.latencies[episode] = []
        self.push(at, "step", episode)

    def run_until(self, until: float) -> None:
        while self.events and self.events[0][0] <= until:
            at, _, kind, what = heapq.heappop(self.events)
            if kind == "step":
                device = self.on[what]
                self.queue.setdefault(device, []).append((at, what))
                self.push(at + PERIOD_MS, "step", what)
                self._kick(device, at)
            else:  # a run ended
                device, batch = what
                for arrived, episode in batch:
                    self.latencies[episode].append((at, at - arrived))
                self.busy[device] = False
                self._kick(device, at)

    def _kick(self, device: str, at: float) -> None:
        q = self.queue.get(device)
        if self.busy.get(device) or not q:
            return
        batch, self.queue[device] = q[:MAX_BATCH], q[MAX_BATCH:]
        ms = run_ms(device.startswith("slow"), len(batch), self.rng)
        self.runs.append((device, len(batch), ms))
        self.busy[device] = True
        self.push(at + ms, "done", (device, batch))


def capacity_of(slow: bool) -> int:
    """The most episodes one device of the class serves with step p95 within the period."""
    best = 0
    for n in range(1, 80):
        f = Fleet(n)
        for i in range(n):
            f.start(f"e{i}", "slow/0" if slow else "fast/0", f.rng.uniform(0, PERIOD_MS))
        f.run_until(4000)
        lat = [ms for e in f.latencies.values() for t, ms in e if t > 1000]
        if pct(lat, 95) > PERIOD_MS:
            break
        best = n
    return best


async def simulate(url: str, mode: str, capacity: int, episodes: int, seconds: float) -> Any:
    r = redis.Redis.from_url(url)
    r.flushall()
    r.close()
    client = redis.asyncio.Redis.from_url(url, decode_responses=True)
    s = settings(url)
    registry, claims = Registry(client, s), Claims(client, s)
    await registry.new_fleet()
    for node in ("fast", "slow"):
        await registry.register(node, f"http://{node}", devices(PER_CLASS, capacity))
    clock = [0.0]  # simulated seconds: the nodes' step rates are measured in it
    books = {node: StepTimes(MAX_BATCH, clock=lambda: clock[0]) for node in ("fast", "slow")}
    live: dict[str, int] = {}
    fleet = Fleet(7)
    refused = 0
    arrive_every = 1000.0 * (seconds / 2) / episodes  # arrivals over the first half
    renew_every, next_renew = 500.0, 0.0
    limit = PERIOD_MS * HEADROOM if mode == "scored" else None
    for i in range(episodes):
        now = i * arrive_every
        fleet.run_until(now)
        clock[0] = now / 1000
        if now >= next_renew:  # each node publishes its devices' scores
            for device, batch, ms in fleet.runs:
                books[device.split("/")[0]].ran(device, (batch, ms / 1000))
            fleet.runs.clear()
            for node, book in books.items():
                ids = [(d, f"{node}/{d}") for d in range(PER_CLASS)]
                scores = book.scores(ids, lambda d: live.get(d, 0), capacity)
                await registry.renew(node, scores=scores)
            next_renew = now + renew_every
        try:
            a = await claims.resolve(f"ep{i}", placement=mode, limit_ms=limit)
        except NoCapacity:
            refused += 1
            continue
        live[a.device] = live.get(a.device, 0) + 1
        fleet.start(f"ep{i}", a.device, now)
    end = seconds * 1000
    fleet.run_until(end)
    await client.aclose()
    settled = end / 2 + 1000  # the last half, less a second: every episode running
    p95 = {e: pct([ms for t, ms in v if t > settled], 95) for e, v in fleet.latencies.items()}
    within = sum(1 for v in p95.values() if v <= PERIOD_MS)
    return within / episodes, refused, dict(sorted(live.items()))


BASELINE = textwrap.dedent(
    """
    import asyncio, sys
    import redis, redis.asyncio
    from affinity import Claims, DeviceRegistration, Registry, Settings
    url, n, per_node = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    async def main():
        r = redis.Redis.from_url(url); r.flushall()
        c = redis.asyncio.Redis.from_url(url, decode_responses=True)
        s = Settings(redis_url=url, episode_ttl_s=3600, lease_ttl_s=36000)
        reg, claims = Registry(c, s), Claims(c, s)
        await reg.new_fleet()
        for node in range(16 // per_node):
            await reg.register(f"b{node}", f"http://b{node}", [DeviceRegistration(
                i, "cuda", "bench", f"u{i}", "sm_90", 0, 10 * n) for i in range(per_node)])
        await claims.resolve("warm")
        r.config_resetstat()
        for i in range(n):
            await claims.resolve(f"e{i}")
        print(r.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])
    asyncio.run(main())
    """
)


async def claim_usec(url: str, mode: str, nodes: int, per_node: int, n: int) -> float:
    r = redis.Redis.from_url(url)
    r.flushall()
    client = redis.asyncio.Redis.from_url(url, decode_responses=True)
    s = settings(url)
    registry, claims = Registry(client, s), Claims(client, s)
    await registry.new_fleet()
    rng = random.Random(1)
    from affinity.registry import DeviceScore

    for node in range(nodes):
        gpus = [
            DeviceRegistration(i, "cuda", "bench", f"u{i}", "sm_90", 0, 10 * n)
            for i in range(per_node)
        ]
        await registry.register(f"b{node}", f"http://b{node}", gpus)
        scores = [DeviceScore(i, rng.uniform(5, 15), 0.5) for i in range(per_node)]
        await registry.renew(f"b{node}", scores=scores)
    await claims.resolve("warm", placement=mode)
    r.config_resetstat()
    for i in range(n):
        await claims.resolve(f"e{i}", placement=mode, limit_ms=1e6 if mode == "scored" else None)
    usec = float(r.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])
    r.close()
    await client.aclose()
    return usec


def main() -> None:
    a = options(claims=3000, seconds=12.0, baseline_root="/work/main", rounds=3)
    fast_cap, slow_cap = capacity_of(False), capacity_of(True)
    total = PER_CLASS * (fast_cap + slow_cap)
    episodes = int(0.8 * total)
    server = RedisServer(tmpdir()).start()
    try:
        url = server.url
        scored, s_refused, s_live = asyncio.run(
            simulate(url, "scored", fast_cap, episodes, a.seconds)
        )
        rr, r_refused, r_live = asyncio.run(
            simulate(url, "round-robin", fast_cap, episodes, a.seconds)
        )
        cpu: dict[str, list[float]] = {"today16": [], "rr16": [], "s16": [], "s1024": []}
        env = {**os.environ, "PYTHONPATH": a.baseline_root}
        for _ in range(a.rounds):  # interleaved rounds; the median of each
            out = subprocess.run(
                [sys.executable, "-c", BASELINE, url, str(a.claims), "4"],
                env=env, capture_output=True, text=True, check=True, cwd=a.baseline_root,
            )  # fmt: skip
            cpu["today16"].append(float(out.stdout.strip()))
            cpu["rr16"].append(asyncio.run(claim_usec(url, "round-robin", 4, 4, a.claims)))
            cpu["s16"].append(asyncio.run(claim_usec(url, "scored", 4, 4, a.claims)))
            cpu["s1024"].append(asyncio.run(claim_usec(url, "scored", 64, 16, a.claims)))
    finally:
        server.stop()
    med = {k: sorted(v)[len(v) // 2] for k, v in cpu.items()}
    figures = [
        {
            "figure": "(a) episodes with step p95 within 50 ms, scored vs round-robin",
            "result": f"scored {scored:.1%} (refused {s_refused}), round-robin {rr:.1%} "
            f"(refused {r_refused}); ratio {scored / max(rr, 1e-9):.2f}x "
            f"[{episodes} episodes = 80% of {total}: fast {fast_cap}/device, slow {slow_cap}]",
            "goal": "scored >= 99%",
            "ok": scored >= 0.99,
        },
        {
            "figure": "(b) claim Redis CPU at 16 devices, scored vs today's",
            "result": f"{med['s16']:.2f} us vs {med['today16']:.2f} us: "
            f"{med['s16'] / med['today16']:.2f}x (round-robin here {med['rr16']:.2f} us, "
            f"{med['rr16'] / med['today16']:.2f}x)",
            "goal": "<= 1.2x",
            "ok": med["s16"] <= 1.2 * med["today16"],
        },
        {
            "figure": "(b) claim Redis CPU at 1,024 devices scored vs today's at 16",
            "result": f"{med['s1024']:.2f} us vs {med['today16']:.2f} us: "
            f"+{med['s1024'] - med['today16']:.2f} us ({med['s1024'] / med['today16']:.2f}x)",
            "goal": "<= +15 us",
            "ok": med["s1024"] - med["today16"] <= 15,
        },
    ]
    report("placement", figures, {"live_scored": s_live, "live_round_robin": r_live, "cpu": cpu})


if __name__ == "__main__":
    main()
