"""Many episodes' steps in one message (issue 44): K episodes over a few connections
through a 3-node fleet of CPU stand-ins (real redis-server, real nodes, the ``demo``
policy), one-row requests against K-row messages (msgpack ``POST /act``).

Each connection drives K / connections episodes, closed loop (a request, then the next):
one-row, each of its episodes' steps is one request; rows, its episodes' steps of a round
are one message. Measured per phase, on the same fleet, after every episode was claimed:

- steps/s, and the p99 of a row's time (request sent to reply read);
- the paced phases: the row p99 at the same load per device. ``--paced`` episodes at
  ``--hz``, each connection's round of steps started every 1/hz s: one-row (its steps one
  after the other), then rows (its steps in one message) at the rate the one-row phase
  reached (steps/s equal; below ``--hz`` only where the one-row path could not bear it);
- messages forwarded between nodes per request (``affinity_forwarded_total``, every
  node): at most the owners a message touches;
- Redis commands per step (``INFO commandstats``, renewals included).

Usage: python -m bench.rows [--episodes 256] [--connections 8] [--seconds 6]
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import httpx
import numpy as np

from affinity import wire
from bench.common import Node, RedisServer, options, pct, report, tmpdir

MSGPACK = {"content-type": "application/msgpack", "accept": "application/msgpack"}
OBS = np.zeros((1, 8), np.float32)


def forwarded(urls: list[str]) -> float:
    """Forwards every node made so far (any result)."""
    total = 0.0
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=5).text
        total += sum(float(v) for v in re.findall(r"^affinity_forwarded_total\{[^}]*\} (\S+)",
                                                   text, re.M))  # fmt: skip
    return total


def redis_calls(client: Any) -> int:
    stats = client.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k.startswith("cmdstat_"))


async def drive(
    urls: list[str], episodes: list[list[str]], seconds: float, rows: bool, hz: float = 0.0
) -> tuple[int, int, list[float], list[float]]:
    """(steps, requests, row times, round times) of ``seconds`` of steps (ms): closed loop,
    or each connection's round (its episodes' steps) started every 1/``hz`` s. A round's
    time: its first step sent to its last reply read."""
    steps = requests = 0
    times: list[float] = []
    rounds: list[float] = []
    stop = time.monotonic() + seconds

    async def connection(url: str, mine: list[str]) -> None:
        nonlocal steps, requests
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            due = time.monotonic()
            while time.monotonic() < stop:
                if hz:
                    await asyncio.sleep(max(0.0, due - time.monotonic()))
                    due = max(due + 1 / hz, time.monotonic())
                began = time.monotonic()
                if rows:
                    body = {"steps": [{"episode_id": e, "inputs": {"obs": OBS}} for e in mine]}
                    sent = time.monotonic()
                    r = await client.post("/act", content=wire.encode(body), headers=MSGPACK)
                    took = (time.monotonic() - sent) * 1000
                    got = wire.decode(r.content)["steps"]
                    ok = sum(1 for g in got if "error" not in g)
                    steps, requests = steps + ok, requests + 1
                    times.extend([took] * ok)
                    rounds.append(took)
                    continue
                for e in mine:
                    sent = time.monotonic()
                    step = {"episode_id": e, "inputs": {"obs": OBS}}
                    r = await client.post("/act", content=wire.encode(step), headers=MSGPACK)
                    times.append((time.monotonic() - sent) * 1000)
                    steps += r.status_code == 200
                    requests += 1
                rounds.append((time.monotonic() - began) * 1000)

    await asyncio.gather(*(connection(urls[i % len(urls)], m) for i, m in enumerate(episodes)))
    return steps, requests, times, rounds


def main() -> None:
    args = options(
        episodes=256,
        connections=8,
        seconds=6.0,
        hz=(5.0, "the paced phases' control rate (a load the one-row path bears)"),
        paced=(64, "episodes of the paced phases (a load the one-row path bears)"),
    )
    tmp = tmpdir()
    redis = RedisServer(tmp).start()
    extra = ["--capacity", str(args.episodes), "--max-rows", str(args.episodes)]
    nodes = [Node(tmp, f"n{i}", redis.url, devices="cpu:1", extra=extra) for i in range(3)]
    try:
        for node in nodes:
            node.start()
        urls = [n.url for n in nodes]
        ids = [f"rows-{i}" for i in range(args.episodes)]
        per = [ids[i :: args.connections] for i in range(args.connections)]
        asyncio.run(drive(urls, per, 0.5, rows=True))  # every episode claimed (and warmed)
        client = redis.client()
        phases: dict[str, dict[str, float]] = {}
        for name, rows in (("one-row", False), ("rows", True)):
            f0, c0 = forwarded(urls), redis_calls(client)
            steps, requests, times, _ = asyncio.run(drive(urls, per, args.seconds, rows))
            f1, c1 = forwarded(urls), redis_calls(client)
            phases[name] = {
                "steps_per_s": steps / args.seconds,
                "requests": requests,
                "p99_ms": pct(times, 99),
                "forwards_per_request": (f1 - f0) / max(requests, 1),
                "redis_commands_per_step": (c1 - c0) / max(steps, 1),
            }
            print(name, {k: round(v, 4) for k, v in phases[name].items()})
        few = [ids[: args.paced][i :: args.connections] for i in range(args.connections)]
        hz = args.hz
        for name, rows in (("one-row paced", False), ("rows paced", True)):
            steps, requests, times, rounds = asyncio.run(drive(urls, few, args.seconds, rows, hz))
            phases[name] = {
                "hz": hz,
                "steps_per_s": steps / args.seconds,
                "requests": requests,
                "p99_ms": pct(times, 99),
                "p50_ms": pct(times, 50),
                "round_p99_ms": pct(rounds, 99),
            }
            print(name, {k: round(v, 4) for k, v in phases[name].items()})
            # the same load per device: the rows at the rate the one-row requests reached
            # (below --hz when the one-row path could not bear it)
            hz = min(args.hz, steps / args.seconds / args.paced)
    finally:
        for node in nodes:
            node.stop()
        redis.stop()
    one, many = phases["one-row"], phases["rows"]
    fast, slow = phases["one-row paced"], phases["rows paced"]
    ratio = many["steps_per_s"] / max(one["steps_per_s"], 1e-9)
    touched = 3  # a message's rows live on every node of the fleet
    report(
        "rows",
        [
            {
                "figure": "steps/s, K-row messages / one-row requests",
                "result": f"{ratio:.2f}x ({many['steps_per_s']:.0f} vs {one['steps_per_s']:.0f})",
                "goal": ">= 3x",
                "ok": ratio >= 3,
            },
            {
                "figure": "row p99 (ms), rows vs one-row, closed loop (unequal loads)",
                "result": f"{many['p99_ms']:.1f} vs {one['p99_ms']:.1f}",
                "goal": "reported",
                "ok": True,
            },
            {
                "figure": f"row p99 (ms), rows vs one-row, {args.paced} episodes at "
                f"{slow['hz']:.3g} Hz (steps/s: {slow['steps_per_s']:.0f} vs "
                f"{fast['steps_per_s']:.0f})",
                "result": f"{slow['p99_ms'] / fast['p99_ms']:.2f}x "
                f"({slow['p99_ms']:.1f} vs {fast['p99_ms']:.1f})",
                "goal": "<= 1.2x",
                "ok": slow["p99_ms"] <= 1.2 * fast["p99_ms"],
            },
            {
                "figure": "a connection's round of steps (first sent to last reply), p99 "
                "(ms), rows vs one-row, same paced phases",
                "result": f"{slow['round_p99_ms']:.1f} vs {fast['round_p99_ms']:.1f}",
                "goal": "reported",
                "ok": True,
            },
            {
                "figure": "messages forwarded per K-row request",
                "result": f"{many['forwards_per_request']:.2f}",
                "goal": f"<= {touched - 1} (the other owners)",
                "ok": many["forwards_per_request"] <= touched - 1,
            },
            {
                "figure": "Redis commands per step (rows)",
                "result": f"{many['redis_commands_per_step']:.5f}",
                "goal": "<= 0.01",
                "ok": many["redis_commands_per_step"] <= 0.01,
            },
        ],
        {"episodes": args.episodes, "connections": args.connections, "phases": phases},
    )


if __name__ == "__main__":
    main()
