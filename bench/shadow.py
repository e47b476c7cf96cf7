"""A candidate shadowing live episodes (issue 47): what it costs the live steps, and
whether an identical candidate's ghosts keep their state right.

One in-process node (the real app, real ONNX Runtime sessions on one CPU device,
fakeredis) serves the demo policy as ``v1`` and can run the same file as ``v2``. A robot
loop steps ``--episodes`` episodes in lock-step, ``--steps`` steps each, timing each live
step from request to reply; the ghost steps run in the background as the node runs them
(never awaited by the loop). Two loads, each alternating no shadow (the baseline) and
``v2`` shadowing ``v1`` at fraction 1.0, ``--rounds`` times in one run, each round
``--block`` steps of new episodes (short rounds: the shared machine's load changes less
within a pair of them):

- **spare capacity**: a round of every episode's step each 1/``--hz`` s, the robots
  thinking in between (a control rate; the device idle part of the time). Figures: the
  live steps' p50 and p99 with the shadow over without (the median of the rounds' ratios),
  and whether every live reply is the same with and without it.
- **no spare capacity**: back to back, a saturating load. Figures: the live steps' p99 with
  the shadow over without, and the ghost steps skipped (``busy``), counted.

First a lock-step pass (each step waits for its ghost) runs every ghost step of
``--episodes`` x ``--steps``: the check that the ghosts' state is kept right (divergence
exactly 0).

Usage: python -m bench.shadow [--episodes 64] [--steps 200] [--rounds 10] [--block 20] [--hz 5]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import fakeredis
import numpy as np

from affinity.shadows import Shadow, Shadows
from bench.common import median, pct, report
from node.catalog import ModelSpec
from node.models import DEMO_MODEL
from tests.inproc import InProcNode, cluster, config

LIVE, CANDIDATE = "demo_policy@v1", "demo_policy@v2"


async def loop(
    node: InProcNode, prefix: str, episodes: int, steps: int, hz: float = 0.0
) -> tuple[list[float], list[Any]]:
    """The robots' loop: each step of each episode in turn, a round every 1/``hz`` s (0:
    back to back); the live steps' seconds and their replies' outputs."""
    rng = np.random.default_rng(0)
    obs = rng.standard_normal((steps, episodes, 1, 8)).astype(np.float32).tolist()
    took, outputs = [], []
    began = time.perf_counter()
    for t in range(steps):
        if hz:  # the next control period
            await asyncio.sleep(max(0.0, began + t / hz - time.perf_counter()))
        for e in range(episodes):
            body = {"episode_id": f"{prefix}-{e}", "inputs": {"obs": obs[t][e]},
                    "end": t == steps - 1}  # fmt: skip
            start = time.perf_counter()
            r = await node.client.post("/act", json=body)
            took.append(time.perf_counter() - start)
            assert r.status_code == 200, r.text
            outputs.append(r.json()["outputs"])
    return took, outputs


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


async def alternate(
    node: InProcNode,
    shadows: Shadows,
    load: str,
    episodes: int,
    steps: int,
    rounds: int,
    hz: float,
) -> dict[str, Any]:
    """``rounds`` x (no shadow, then the shadow at fraction 1.0) under one load: each
    round's live step seconds, whether the replies agreed, and the ghosts' totals."""
    svc = node.service
    svc.shadow.totals.clear()
    busy: list[float] = []  # the baseline rounds' live step seconds over their wall time
    base: list[list[float]] = []
    shadowed: list[list[float]] = []
    same = True
    for r in range(rounds):
        await shadows.stop(CANDIDATE)
        await svc.shadow.sync()
        began = time.perf_counter()
        took, want = await loop(node, f"{load}-base{r}", episodes, steps, hz)
        busy.append(sum(took) / (time.perf_counter() - began))
        base.append(took)
        await shadows.start(Shadow.checked(CANDIDATE, LIVE, 1.0))
        await svc.shadow.sync()
        took, got = await loop(node, f"{load}-shadow{r}", episodes, steps, hz)
        shadowed.append(took)
        same = same and got == want
        await svc.shadow.idle()
    totals = svc.shadow.totals.get((CANDIDATE, LIVE))
    return {"base": base, "shadowed": shadowed, "same": same, "busy": median(busy),
            "totals": totals.to_json() if totals else None}  # fmt: skip


async def measure(episodes: int, steps: int, rounds: int, block: int, hz: float) -> dict[str, Any]:
    redis = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
    cfg = config(
        "bench",
        devices="cpu:1",
        models=(ModelSpec(DEMO_MODEL, "demo_policy", "v1"),),
        shadow_models=(ModelSpec(DEMO_MODEL, "demo_policy", "v2"),),
        capacity=1000,  # every round's episodes stay live: none may be refused
    )
    async with cluster(redis, [cfg]) as ([node], _):
        svc = node.service
        node.app.access.enabled = False  # no access log line per step
        shadows = Shadows(redis, cfg.settings)
        await loop(node, "warm", 8, 20)  # warm: sessions, allocator pools
        await shadows.start(Shadow.checked(CANDIDATE, LIVE, 1.0))
        await svc.shadow.sync()
        await lockstep(node, episodes, steps)
        exact = svc.shadow.totals[(CANDIDATE, LIVE)].to_json()
        spare = await alternate(node, shadows, "spare", episodes, block, rounds, hz)
        full = await alternate(node, shadows, "full", episodes, block, rounds, 0.0)
    await redis.aclose()
    return {"spare": spare, "full": full, "exact": exact}


def ratios(got: dict[str, Any], q: float) -> tuple[float, list[float]]:
    """The median over the rounds of the shadowed round's q-th percentile over its
    baseline's, and each round's."""
    each = [pct(s, q) / pct(b, q) for b, s in zip(got["base"], got["shadowed"], strict=True)]
    return median(each), each


def timing(got: dict[str, Any], q: float, load: str, goal: str) -> dict[str, Any]:
    value, each = ratios(got, q)
    steps = sum(len(t) for t in got["shadowed"])
    base = pct([x for t in got["base"] for x in t], q)
    shadowed = pct([x for t in got["shadowed"] for x in t], q)
    return {
        "figure": f"live step p{q:g} with a shadow at fraction 1.0 over without, {load} "
                  f"(median of {len(each)} rounds, {steps} steps each way)",
        "value": value,
        "result": f"{value:.3f}x (rounds: {', '.join(f'{r:.3f}' for r in each)}; all "
                  f"steps {shadowed * 1000:.3f} ms vs {base * 1000:.3f} ms)",
        "goal": goal,
        "ok": value <= 1.05,
    }  # fmt: skip


def in_flight(got: dict[str, Any]) -> str:
    return f"live steps in flight {got['busy']:.0%} of the time"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--block", type=int, default=20, help="steps per episode in a round")
    p.add_argument("--hz", type=float, default=5.0, help="control rate of the spare load")
    a = p.parse_args()
    got = asyncio.run(measure(a.episodes, a.steps, a.rounds, a.block, a.hz))
    spare, full = got["spare"], got["full"]
    load = f"spare capacity ({a.episodes} robots in lock-step at {a.hz:g} Hz, {in_flight(spare)})"
    figures = [
        timing(spare, 50, load, "<= 1.05x"),
        timing(spare, 99, load, "<= 1.05x"),
        {
            "figure": f"live replies with the shadow the same as without, {load}",
            "value": spare["same"],
            "result": "identical" if spare["same"] else "DIFFERENT",
            "goal": "identical",
            "ok": spare["same"],
        },
        timing(full, 99, f"no spare capacity (back to back, {in_flight(full)})", "<= 1.05x"),
    ]
    for name, phase in (("spare capacity", spare), ("no spare capacity", full)):
        t = phase["totals"] or {"compared": 0, "restarted_compared": 0, "skipped": 0,
                                "skipped_by": {}, "restarts": 0, "max_abs": 0.0}  # fmt: skip
        n = a.episodes * a.block * a.rounds
        figures.append({
            "figure": f"ghost steps, {name} ({n} live steps shadowed)",
            "value": t["skipped"],
            "result": f"{t['compared']} compared continuous (max-abs {t['max_abs']!r}), "
                      f"{t['restarted_compared']} compared restarted, {t['skipped']} "
                      f"skipped {t['skipped_by']}, {t['restarts']} restarts",
            "goal": "every skipped step counted",
            "ok": t["compared"] + t["restarted_compared"] + t["skipped"] >= n
                  and t["max_abs"] == 0.0,
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
    with open("/proc/loadavg") as f:
        loadavg = f.read().strip()
    print(f"/proc/loadavg at the end: {loadavg}")
    report("shadow", figures, {"spare": spare["totals"], "full": full["totals"],
                               "lockstep": exact, "loadavg": loadavg})  # fmt: skip


if __name__ == "__main__":
    main()
