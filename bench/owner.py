"""Owner-authoritative hits (issue 22): Redis commands per step, and steps through a Redis
pause (real redis-server, three real nodes, 64 live episodes).

1. Commands per step: every episode steps for ``--seconds`` at its owner, driven by one
   ``wrk`` per node (C, not the bottleneck; each cycles over the episodes that node owns),
   all three at once; ``INFO commandstats`` before and after gives the commands Redis ran
   (those scripts ran included, the bench's own ``INFO`` excluded) and the scripts called,
   per step. The commands are per node and second (lease renewal, the owner's flush, the
   fleet's models read every 10 s), not per step: the figure also prints the step rate
   from which they are <= 1%. Goal: <= 1%.
2. Redis SIGSTOPped for ``--pause`` seconds (lease ``--lease``) while every episode steps
   at ``--rate`` Hz (one Python client: paced so that it is not its own bottleneck), half
   of them at their owners and half through another node: failed steps (goal 0), the
   slowest step during the pause against the p99 before it, and what a new episode gets
   during the pause (a 503 with Retry-After).

Usage: python -m bench.owner [--seconds 10] [--pause 3] [--lease 10] [--rate 5]
"""

from __future__ import annotations

import asyncio
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import redis

from bench.common import Node, RedisServer, Wrk, cpu_seconds, options, pct, report, tmpdir, wrk

EPISODES = 64
OBS = {"obs": [[0.0] * 8]}


def owned_lua(episodes: list[str]) -> str:
    """wrk's request(): JSON /act bodies cycling over ``episodes`` (one node's own)."""
    bodies = ",".join(
        "'" + '{"episode_id":"' + ep + '","inputs":{"obs":[[0,0,0,0,0,0,0,0]]}}' + "'"
        for ep in episodes
    )
    return f"""
local bodies = {{{bodies}}}
local i = 0
request = function()
  i = i + 1
  return wrk.format("POST", "/act", {{["Content-Type"] = "application/json"}},
    bodies[(i % #bodies) + 1])
end
"""


def at_owners(
    nodes: list[Node], home: dict[str, str], seconds: float, connections: int
) -> list[Wrk]:
    """One wrk per node, all at once, each stepping the episodes that node owns."""
    by_node = {n.node_id: [ep for ep, owner in home.items() if owner == n.node_id] for n in nodes}
    busy = [n for n in nodes if by_node[n.node_id]]
    with ThreadPoolExecutor(len(busy)) as pool:
        runs = [
            pool.submit(
                wrk,
                n.url,
                owned_lua(by_node[n.node_id]),
                duration_s=seconds,
                connections=min(connections, len(by_node[n.node_id])),
            )
            for n in busy
        ]
        return [r.result() for r in runs]


def commandstats(r: redis.Redis) -> dict[str, int]:
    stats = r.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


async def drive(
    client: httpx.AsyncClient,
    home: dict[str, str],
    urls: dict[str, str],
    until: float,
    routed: bool,
    latencies: list[tuple[float, float]],
    failures: list[str],
    rate_hz: float,
) -> int:
    """Step every episode at ``rate_hz`` (a robot's control loop: the next step is sent
    at the next period, or at once when the last one took longer) until ``until``, one
    task per episode; ``routed``: odd episodes go through another node than their owner.
    Returns the steps served."""
    nodes = sorted(urls)
    served = 0
    period = 1.0 / rate_hz

    async def one(i: int, episode: str) -> None:
        nonlocal served
        tick = time.monotonic() + period * i / len(home)  # spread over one period
        while time.monotonic() < until:
            await asyncio.sleep(max(0.0, tick - time.monotonic()))
            tick = max(tick + period, time.monotonic())
            owner = home[episode]
            node = owner
            if routed and i % 2:
                node = nodes[(nodes.index(owner) + 1) % len(nodes)]
            sent = time.monotonic()
            try:
                r = await client.post(
                    urls[node] + "/act", json={"episode_id": episode, "inputs": OBS}
                )
            except httpx.HTTPError as exc:
                failures.append(f"{type(exc).__name__}")
                continue
            latencies.append((sent, time.monotonic() - sent))
            if r.status_code != 200:
                failures.append(f"{r.status_code} {r.text[:120]}")
                continue
            home[episode] = r.json()["node"]
            served += 1

    await asyncio.gather(*(one(i, ep) for i, ep in enumerate(home)))
    return served


async def run(seconds: float, pause: float, lease: float, rate: float) -> dict[str, Any]:
    tmp = tmpdir()
    server = RedisServer(tmp).start()
    extra = ["--lease-ttl", str(lease)]
    nodes = [Node(tmp, f"o{i}", server.url, devices="cpu:2", extra=extra) for i in range(3)]
    r = server.client()
    try:
        for n in nodes:
            n.start()
        urls = {n.node_id: n.url for n in nodes}
        limits = httpx.Limits(max_connections=EPISODES + 8)
        async with httpx.AsyncClient(timeout=30, limits=limits) as client:
            home: dict[str, str] = {}
            for i in range(EPISODES):
                via = nodes[i % 3].url
                reply = await client.post(via + "/act", json={"episode_id": f"e{i}", "inputs": OBS})
                home[f"e{i}"] = reply.json()["node"]
            await asyncio.sleep(1.5)  # one flush: the owners serve from memory from now on
            await asyncio.to_thread(at_owners, nodes, home, 1, 4)  # warm
            pids = [n.proc.popen.pid for n in nodes if n.proc.popen is not None]
            cpu0 = sum(cpu_seconds(p) for p in pids)
            before = commandstats(r)
            runs = await asyncio.to_thread(at_owners, nodes, home, seconds, 4)
            after = commandstats(r)
            cpu = sum(cpu_seconds(p) for p in pids) - cpu0
            steps = sum(w.requests for w in runs)
            ran = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            ran.pop("info", None)
            total = sum(ran.values())
            scripts = ran.get("evalsha", 0) + ran.get("eval", 0)
            measured = max(w.seconds for w in runs)

            # the pause: half at the owners, half through another node (each router has
            # found its episodes' owners before: one resolve per episode, then hints)
            await drive(client, home, urls, time.monotonic() + 1.5, True, [], [], rate)
            lat, fails = [], []
            start = time.monotonic()
            pause_at, end = start + 2.0, start + 2.0 + pause + 2.0
            task = asyncio.create_task(drive(client, home, urls, end, True, lat, fails, rate))
            await asyncio.sleep(pause_at - time.monotonic())
            server.proc.send(signal.SIGSTOP)
            stopped = time.monotonic()
            new_sent = time.monotonic()
            new = await client.post(
                nodes[0].url + "/act", json={"episode_id": "new-in-pause", "inputs": OBS}
            )
            new_s = time.monotonic() - new_sent
            await asyncio.sleep(max(0.0, stopped + pause - time.monotonic()))
            server.proc.send(signal.SIGCONT)
            resumed = time.monotonic()
            paused_steps = await task
        before_p99 = pct([d for s, d in lat if s < stopped], 99)
        during = [d for s, d in lat if stopped <= s < resumed]
        return {
            "steps": steps,
            "steps_per_s": steps / measured,
            "seconds": measured,
            "node_cpu_per_step_us": cpu / max(steps, 1) * 1e6,
            "p50_at_owners_ms": sorted(w.p50 for w in runs)[len(runs) // 2] * 1000,
            "commands": total,
            "scripts": scripts,
            "commands_by_name": {k: v for k, v in ran.items() if v},
            "pause_steps": paused_steps,
            "pause_failures": fails,
            "p99_before_ms": before_p99 * 1000,
            "max_during_ms": max(during) * 1000 if during else float("nan"),
            "steps_during": len(during),
            "new_episode": {
                "status": new.status_code,
                "code": new.json().get("error", {}).get("code") if new.status_code != 200 else "",
                "retry_after": new.headers.get("retry-after"),
                "seconds": new_s,
            },
        }
    finally:
        for n in nodes:
            n.stop()
        server.stop()


def main() -> None:
    a = options(
        seconds=10.0, pause=3.0, lease=10.0, rate=(5.0, "steps/s of each episode in the pause")
    )
    out = asyncio.run(run(a.seconds, a.pause, a.lease, a.rate))
    per_step = out["commands"] / out["steps"]
    scripts_per_step = out["scripts"] / out["steps"]
    per_node_s = out["commands"] / out["seconds"] / 3  # renewals and flushes: not per step
    out["break_even_steps_per_s"] = out["commands"] / out["seconds"] / 0.01
    slow = out["max_during_ms"] / out["p99_before_ms"]
    new = out["new_episode"]
    report(
        "owner",
        [
            {
                "figure": f"Redis commands per step, {EPISODES} episodes at their owners, 3 nodes",
                "value": per_step,
                "result": f"{per_step:.2%} commands ({scripts_per_step:.3%} scripts) over "
                f"{out['steps']} steps ({out['steps_per_s']:.0f}/s, wrk at the owners); "
                f"{per_node_s:.1f} commands/s per node (lease, flush, models), <= 1% from "
                f"{out['break_even_steps_per_s']:.0f} steps/s",
                "goal": "<= 1%",
                "ok": per_step <= 0.01,
            },
            {
                "figure": f"failed steps, Redis SIGSTOPped {a.pause:g} s (lease {a.lease:g} s), "
                f"{EPISODES} episodes at {a.rate:g} Hz",
                "value": len(out["pause_failures"]),
                "result": f"{len(out['pause_failures'])} of {out['pause_steps']} "
                f"({out['steps_during']} sent during the pause)",
                "goal": "0",
                "ok": not out["pause_failures"],
            },
            {
                "figure": "slowest step during the pause / p99 before it",
                "value": slow,
                "result": f"{slow:.2f}x ({out['max_during_ms']:.1f} ms vs "
                f"{out['p99_before_ms']:.1f} ms)",
                "goal": "a few times",
                "ok": slow <= 5,
            },
            {
                "figure": "a new episode during the pause",
                "value": new["status"],
                "result": f"{new['status']} {new['code']} Retry-After {new['retry_after']} "
                f"after {new['seconds']:.2f} s",
                "goal": "503 with Retry-After",
                "ok": new["status"] == 503 and new["retry_after"] is not None,
            },
        ],
        out,
    )


if __name__ == "__main__":
    main()
