"""A candidate shadowing live episodes (issue 47): what it costs the live steps, and
whether an identical candidate's ghosts keep their state right.

One in-process node (the real app, real ONNX Runtime sessions on one CPU device,
fakeredis) serves the demo policy as ``v1`` and can run the same file as ``v2``. A robot
loop steps ``--episodes`` episodes round-robin, ``--steps`` steps each, timing each live
step from request to reply; the ghost steps run in the background as the node runs them
(never awaited by the loop). The same loop runs with no shadow (the baseline) and with
``v2`` shadowing ``v1`` at fraction 1.0, alternating ``--rounds`` times in one run; the
figures are the live steps' p50 and p99 with the shadow over the baseline's, and the
divergence of the identical candidate over every compared step (exactly 0 on the CPU).
First a lock-step pass (each step waits for its ghost) runs every ghost step of
``--episodes`` x ``--steps``: the check that the ghosts' state is kept right.

``--hz`` paces the robots: a round of every episode's step each 1/hz s (0: back to back).

Usage: python -m bench.shadow [--episodes 64] [--steps 200] [--rounds 2] [--hz 0]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import fakeredis
import numpy as np

from affinity.shadows import Shadow, Shadows
from bench.common import pct, report
from node.catalog import ModelSpec
from node.models import DEMO_MODEL
from tests.inproc import InProcNode, cluster, config

LIVE, CANDIDATE = "demo_policy@v1", "demo_policy@v2"


async def loop(
    node: InProcNode, prefix: str, episodes: int, steps: int, hz: float = 0.0
) -> list[float]:
    """The robots' loop: each step of each episode in turn, a round every 1/``hz`` s (0:
    back to back); the live steps' seconds."""
    rng = np.random.default_rng(0)
    obs = rng.standard_normal((steps, episodes, 1, 8)).astype(np.float32).tolist()
    took = []
    began = time.perf_counter()
    for t in range(steps):
        if hz:  # the next control period
            await asyncio.sleep(max(0.0, began + t / hz - time.perf_counter()))
        for e in range(episodes):
            body = {"episode_id": f"{prefix}-{e}", "inputs": {"obs": obs[t][e]}}
            start = time.perf_counter()
            r = await node.client.post("/act", json=body)
            took.append(time.perf_counter() - start)
            assert r.status_code == 200, r.text
    return took


async def lockstep(node: InProcNode, episodes: int, steps: int) -> None:
    """Every episode's step in turn, each round waiting for the ghosts: none is ever
    skipped, so every ghost step is compared with its ghost's state kept all along."""
    rng = np.random.default_rng(1)
    obs = rng.standard_normal((steps, episodes, 1, 8)).astype(np.float32).tolist()
    for t in range(steps):
        for e in range(episodes):
            body = {"episode_id": f"exact-{e}", "inputs": {"obs": obs[t][e]}}
            r = await node.client.post("/act", json=body)
            assert r.status_code == 200, r.text
            await node.service.shadow.idle()


async def measure(episodes: int, steps: int, rounds: int, hz: float) -> dict[str, Any]:
    redis = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
    cfg = config(
        "bench",
        devices="cpu:1",
        models=(ModelSpec(DEMO_MODEL, "demo_policy", "v1"),),
        shadow_models=(ModelSpec(DEMO_MODEL, "demo_policy", "v2"),),
        capacity=1000,  # every round's episodes stay live: none may be refused
    )
    base: list[float] = []
    shadowed: list[float] = []
    async with cluster(redis, [cfg]) as ([node], _):
        svc = node.service
        node.app.access.enabled = False  # no access log line per step
        shadows = Shadows(redis, cfg.settings)
        await loop(node, "warm", 8, 20)  # warm: sessions, allocator pools
        await shadows.start(Shadow.checked(CANDIDATE, LIVE, 1.0))
        await svc.shadow.sync()
        await lockstep(node, episodes, steps)
        exact = svc.shadow.totals[(CANDIDATE, LIVE)].to_json()
        svc.shadow.totals.clear()
        for r in range(rounds):
            await shadows.stop(CANDIDATE)
            await svc.shadow.sync()
            base += await loop(node, f"base{r}", episodes, steps, hz)
            await shadows.start(Shadow.checked(CANDIDATE, LIVE, 1.0))
            await svc.shadow.sync()
            shadowed += await loop(node, f"shadow{r}", episodes, steps, hz)
            await svc.shadow.idle()
        await svc.shadow.sync()
        totals = svc.shadow.totals[(CANDIDATE, LIVE)]
    await redis.aclose()
    return {"base": base, "shadowed": shadowed, "totals": totals.to_json(), "exact": exact}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--hz", type=float, default=0.0, help="rounds a second (0: back to back)")
    a = p.parse_args()
    got = asyncio.run(measure(a.episodes, a.steps, a.rounds, a.hz))
    base, shadowed, totals = got["base"], got["shadowed"], got["totals"]
    figures = []
    for q in (50, 99):
        b, s = pct(base, q), pct(shadowed, q)
        figures.append({
            "figure": f"live step p{q} with a shadow at fraction 1.0 over without "
                      f"({len(shadowed)} vs {len(base)} steps, "
                      f"{f'{a.hz:g} Hz' if a.hz else 'back to back'})",
            "value": s / b,
            "result": f"{s * 1000:.3f} ms vs {b * 1000:.3f} ms: {s / b:.3f}x",
            "goal": "<= 1.05x (spare capacity)",
            "ok": s / b <= 1.05,
        })  # fmt: skip
    exact, n = got["exact"], a.episodes * a.steps
    figures.append({
        "figure": f"divergence of an identical candidate, every ghost step run "
                  f"({a.episodes} episodes x {a.steps} steps, lock-step)",
        "value": exact["max_abs"],
        "result": f"max-abs {exact['max_abs']!r}, L2 {exact['l2_max']!r} over "
                  f"{exact['compared']} continuous steps compared of {n}, skipped "
                  f"{exact['skipped']}",
        "goal": "exactly 0 over every step",
        "ok": exact["max_abs"] == 0.0 and exact["l2_max"] == 0.0 and exact["compared"] == n,
    })  # fmt: skip
    n = a.episodes * a.steps * a.rounds
    figures.append({
        "figure": f"divergence of an identical candidate, free-running ({a.rounds} x "
                  f"{a.episodes} episodes x {a.steps} steps)",
        "value": totals["max_abs"],
        "result": f"max-abs {totals['max_abs']!r}, L2 {totals['l2_max']!r} over "
                  f"{totals['compared']} continuous steps compared of {n}; skipped "
                  f"{totals['skipped']} {totals['skipped_by']}, restarted "
                  f"{totals['restarts']} (their steps kept apart: "
                  f"{totals['restarted_compared']} compared)",
        "goal": "exactly 0",
        "ok": totals["max_abs"] == 0.0 and totals["l2_max"] == 0.0 and totals["compared"] > 0,
    })  # fmt: skip
    report("shadow", figures, {"totals": totals, "lockstep": exact})


if __name__ == "__main__":
    main()
