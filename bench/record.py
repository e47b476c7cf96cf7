"""The recorder's cost and capacity (issue 45), each figure against its baseline in one run.

1. Sticky ``POST /act`` in process (as ``bench/path.py``): the node with ``--record`` and
   every episode selected vs the same node without, interleaved rounds; the added µs a step
   and the throughput ratio on/off (the writer thread shares the process and its GIL).
2. ``Recorder.offer`` alone (what the commit path pays, the writer stopped): µs a call.
3. The writer's capacity: N episodes at 20 Hz, each step a 224x224x3 uint8 camera frame, an
   8-float state and a 10x7 action, offered at their pace for D seconds: frames dropped
   and the writer's frames/s (16 and 64 episodes).
4. Replay of the demo policy in process (``node/replay.py``): recorded time / wall time.

Usage: python -m bench.record [--rounds 9] [--steps 500] [--seconds 5]
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from typing import Any

import numpy as np
import uvloop

from affinity.dataset import Selection, finalize
from bench.asgi import Connection, running_node
from bench.common import median, options, report
from bench.path import EPISODES, _one, _per_step_us
from node.models import DEMO_MODEL
from node.recorder import Recorder
from node.replay import replay


async def _act(rounds: int, steps: int, root: str) -> list[dict[str, float]]:
    connection = Connection()
    out = []
    async with running_node() as off, running_node(record=root) as on:
        rec = on.service.recorder
        assert rec is not None
        rec.select({str(mid): Selection("all") for mid, _ in on.service.models.values()})
        for n in range(2 * EPISODES):
            await _one(off, n, connection)
            await _one(on, n, connection)
        for _ in range(rounds):
            off_us = await _per_step_us(off, steps, connection)
            on_us = await _per_step_us(on, steps, connection)
            out.append({"off_us": off_us, "on_us": on_us})
        out.append({"dropped": float(rec.dropped), "queued": float(rec.queued)})
    return out


def _offer_us(root: str, calls: int) -> tuple[float, float]:
    rec = Recorder(root, "bench", queue_max=calls + 1)
    rec.select({"m@1": Selection("all")})
    x = {"obs": np.zeros((1, 8), np.float32)}
    y = {"actions": np.zeros((1, 4, 2), np.float32)}
    started = time.perf_counter()
    for n in range(calls):
        rec.offer("m@1", "d/0", f"e{n % 64}", "c", 1, n, False, x, y)
    chosen = (time.perf_counter() - started) / calls * 1e6
    started = time.perf_counter()
    for n in range(calls):
        rec.offer("other@1", "d/0", f"e{n % 64}", "c", 1, n, False, x, y)
    unselected = (time.perf_counter() - started) / calls * 1e6
    return chosen, unselected


def _capacity(root: str, episodes: int, seconds: float, hz: float = 20.0) -> dict[str, float]:
    rec = Recorder(root, "bench", queue_max=1024)
    rec.select({"vla@1": Selection("all")})
    rec.start()
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (1, 224, 224, 3), np.uint8) for _ in range(8)]
    state = np.zeros((1, 8), np.float32)
    action = {"actions": np.zeros((1, 10, 7), np.float32)}
    period = 1.0 / hz
    start = time.perf_counter()
    ticks = int(seconds * hz)
    for tick in range(ticks):
        due = start + tick * period
        delay = due - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        for e in range(episodes):
            inputs = {"image": frames[(tick + e) % 8], "state": state}
            rec.offer("vla@1", "d/0", f"e{e}", f"c{e}", 1, tick + 1, False, inputs, action)
    offered_s = time.perf_counter() - start
    rec.close(timeout=120)
    total = time.perf_counter() - start
    return {
        "offered": float(rec.queued + rec.dropped),
        "dropped": float(rec.dropped),
        "written": float(rec.written),
        "writer_fps": rec.written / total,
        "offered_fps": (rec.queued + rec.dropped) / offered_s,
    }


async def _replay(root: str, episodes: int, steps: int) -> tuple[float, int]:
    rec = Recorder(root, "bench", queue_max=episodes * steps + 1, flush_frames=256)
    rec.select({"demo@1": Selection("all")})
    rec.start()
    rng = np.random.default_rng(1)
    for e in range(episodes):
        for s in range(steps):
            x = {"obs": rng.standard_normal((1, 8)).astype(np.float32)}
            y = {"actions": rng.standard_normal((1, 4, 2)).astype(np.float32)}
            rec.offer("demo@1", "d/0", f"e{e}", f"c{e}", 1, s + 1, False, x, y)
    rec.close(timeout=120)
    finalize(root, root + "/ds", fps=20)
    result = await replay(root + "/ds", str(DEMO_MODEL))
    return result.speed, result.frames


def main() -> None:
    a = options(rounds=9, steps=500, seconds=5.0)
    with tempfile.TemporaryDirectory() as tmp:
        rounds = uvloop.run(_act(a.rounds, a.steps, tmp + "/act"))
        counts = rounds.pop()
        chosen, unselected = _offer_us(tmp + "/offer", 200_000)
        cap16 = _capacity(tmp + "/c16", 16, a.seconds)
        cap64 = _capacity(tmp + "/c64", 64, a.seconds)
        speed, frames = asyncio.run(_replay(tmp + "/replay", 8, 250))
    added = median([r["on_us"] - r["off_us"] for r in rounds])
    ratio = median([r["off_us"] / r["on_us"] for r in rounds])
    on, off = median([r["on_us"] for r in rounds]), median([r["off_us"] for r in rounds])
    figures: list[dict[str, Any]] = [
        {"figure": "sticky /act in process: recording on - off, per step", "value": added,
         "result": f"+{added:.1f} µs ({on:.0f} vs {off:.0f} µs a step; "
                   f"{counts['dropped']:.0f} of {counts['queued'] + counts['dropped']:.0f} "
                   "dropped)", "goal": "reported", "ok": True},
        {"figure": "/act throughput, recording on / off", "value": ratio,
         "result": f"{ratio:.3f}x", "goal": ">= 0.97x", "ok": ratio >= 0.97},
        {"figure": "Recorder.offer on the commit path (selected episode)", "value": chosen,
         "result": f"{chosen:.2f} µs a step ({unselected:.2f} µs for a model not selected)",
         "goal": "<= 5 µs", "ok": chosen <= 5},
        {"figure": "16 episodes at 20 Hz, 224x224x3 camera: frames dropped",
         "value": cap16["dropped"],
         "result": f"{cap16['dropped']:.0f} of {cap16['offered']:.0f} "
                   f"(writer {cap16['writer_fps']:.0f} frames/s)", "goal": "0",
         "ok": cap16["dropped"] == 0},
        {"figure": "64 episodes at 20 Hz, 224x224x3 camera: drop rate, writer frames/s",
         "value": cap64["dropped"] / max(cap64["offered"], 1),
         "result": f"{100 * cap64['dropped'] / max(cap64['offered'], 1):.1f}% dropped, "
                   f"writer {cap64['writer_fps']:.0f} frames/s "
                   f"(offered {cap64['offered_fps']:.0f}/s)", "goal": "reported", "ok": True},
        {"figure": "replay of the demo policy in process (20 Hz recording)", "value": speed,
         "result": f"{speed:.1f}x real time ({frames} frames)", "goal": ">= 10x",
         "ok": speed >= 10},
    ]  # fmt: skip
    report("record", figures)


if __name__ == "__main__":
    main()
