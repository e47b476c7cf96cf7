"""Real-time chunking figures (issue 27): the largest jump between consecutive executed
actions of a simulated robot with RTC vs switching chunks without it, and the node's added
cost per step.

The robot runs at 50 Hz on simulated time; each step's latency (observation to chunk) is
drawn from 80-110 ms, so d is 4-6 control steps. It starts an inference every ``S`` = 8
control steps from a fresh observation (independent random images and states: every chunk a
new plan, the case where switching hurts most) and switches to the new chunk when it
arrives, at the row of that moment. Both runs use the packaged ``rtc-demo`` (H = 16) through
``MultiGpuDispatcher.step`` on one CPU device, the same observations and latencies:

- **RTC**: the step sends neither ``executed`` nor ``inference_delay``; the node estimates
  both (``--control-hz 50``, its latency samples fed with the simulated latencies) and fills
  the prefix from the last chunk it sent;
- **without**: the same steps with ``executed`` = H (no prefix): the model's own chunk.

The jump is the largest per-axis change between two consecutive executed actions, after the
first chunk. The added cost is the node's per-step RTC work (the estimate, the prefix from
the episode's record: ``RtcSpec.feed``) timed alone, against a whole dispatcher step of the
same model (its p50), both in this run.

Usage: python -m bench.rtc [--seconds 20] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from bench.common import median, pct, report
from node.contract import load_contract
from node.devices import discover
from node.dispatcher import ChunkSettings, MultiGpuDispatcher
from node.models import RTC_DEMO_MODEL
from node.providers import ProviderSettings, build_session
from node.rtc import Ask
from tests.dispatch import dispatch

HZ = 50.0
EVERY = 8  # control steps between inferences (the execution horizon s)
LATENCY_S = (0.08, 0.11)
WORLDS = ("drift", "independent")


class SimClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def observations(world: str, seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Camera images and states: each drawn afresh (``independent``), or a scene that drifts
    (``drift``: a few grey levels of noise on one image, a random walk of the state)."""
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 256, (1, 224, 224, 3)).astype(np.int16)
    state = rng.standard_normal((1, 8)).astype(np.float32)
    while True:
        if world == "independent":
            image = rng.integers(0, 256, (1, 224, 224, 3)).astype(np.int16)
            state = rng.standard_normal((1, 8)).astype(np.float32)
        else:
            image = np.clip(image + rng.integers(-3, 4, image.shape), 0, 255)
            state = state + (0.05 * rng.standard_normal((1, 8))).astype(np.float32)
        yield image.astype(np.uint8), state


async def robot(
    d: MultiGpuDispatcher, clock: SimClock, world: str, seed: int, steps: int, rtc: bool
) -> tuple[np.ndarray, list[float]]:
    """The executed actions ([steps, D]) of one simulated run, and each step's wall time."""
    rng = np.random.default_rng(seed + 1)
    seen = observations(world, seed)
    episode = f"{world}-{rtc}"
    device = d.devices[0]
    executed: list[np.ndarray] = []
    wall: list[float] = []
    chunk: np.ndarray | None = None  # the chunk being executed, and its time step 0
    start = 0
    pending: tuple[int, int, np.ndarray] | None = None  # (arrives at, plan time, chunk)
    seq = 0
    for t in range(steps):
        if t % EVERY == 0:  # a fresh observation; the step leaves now
            image, state = next(seen)
            latency = float(rng.uniform(*LATENCY_S))
            clock.t = t / HZ
            ask = None if rtc else Ask(16, 0)
            t0 = time.perf_counter()
            feed = {"image": image, "state": state}
            result = await dispatch(d, device, episode, 1, seq == 0, feed, rtc=ask)
            wall.append(time.perf_counter() - t0)
            seq += 1
            d.observed(episode, result.seq, latency)
            arrives = t + math.ceil(latency * HZ)
            pending = (arrives, t, result.outputs["actions"][0])
        if pending is not None and t >= pending[0]:
            start, chunk, pending = pending[1], pending[2], None
        if chunk is not None:
            executed.append(chunk[min(t - start, len(chunk) - 1)])
    return np.stack(executed), wall


def largest_jump(actions: np.ndarray) -> float:
    return float(np.abs(np.diff(actions, axis=0)).max())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=20.0, help="simulated seconds per run")
    p.add_argument("--runs", type=int, default=3, help="rounds (each a fresh seed)")
    args = p.parse_args()
    contract = load_contract(RTC_DEMO_MODEL)
    session = build_session(RTC_DEMO_MODEL, discover("cpu:1")[0], ProviderSettings()).session
    steps = int(args.seconds * HZ)
    jumps: dict[str, list[float]] = {f"{w}/{m}": [] for w in WORLDS for m in ("rtc", "without")}
    step_ms: list[float] = []
    for run in range(args.runs):
        for world in WORLDS:
            for mode in ("rtc", "without"):
                clock = SimClock()
                d = MultiGpuDispatcher(["bench/0"], lambda _: session, contract, clock=clock,
                                       chunks=ChunkSettings(control_hz=HZ))  # fmt: skip
                try:
                    actions, wall = asyncio.run(robot(d, clock, world, run, steps, mode == "rtc"))
                finally:
                    d.close()
                jumps[f"{world}/{mode}"].append(largest_jump(actions[EVERY:]))
                if mode == "rtc":
                    step_ms.extend(w * 1e3 for w in wall[1:])
    spec = d.rtc
    assert spec is not None
    previous = np.random.default_rng(0).standard_normal((16, 7)).astype(np.float32)
    latencies = tuple(np.random.default_rng(1).uniform(*LATENCY_S, 16))
    feed_us: list[float] = []
    for _ in range(2000):
        t0 = time.perf_counter()
        spec.feed((previous, 0.0), Ask(), 0.16, latencies, HZ)
        feed_us.append((time.perf_counter() - t0) * 1e6)
    feed, step = pct(feed_us, 50), pct(step_ms, 50)
    figures: list[dict[str, Any]] = []
    for world in WORLDS:
        with_rtc, without = median(jumps[f"{world}/rtc"]), median(jumps[f"{world}/without"])
        figures.append({
            "figure": f"rtc-demo at 50 Hz, 80-110 ms per step, {world} observations: largest "
            "jump between executed actions, RTC / switching chunks without it",
            "value": with_rtc / without,
            "result": f"{with_rtc / without:.3f}x ({with_rtc:.3f} vs {without:.3f}; "
            f"{args.runs} runs of {args.seconds:g} s)",
            "goal": "reported",
            "ok": True,
        })  # fmt: skip
    figures.append(
        {
            "figure": "the node's RTC work per step (estimate and prefix) / a dispatcher step "
            "of rtc-demo, p50",
            "value": feed / (step * 1e3),
            "result": f"{feed / (step * 1e3):.3f}x ({feed:.1f} us vs {step:.3f} ms)",
            "goal": "reported",
            "ok": True,
        }
    )
    report("rtc", figures, {"args": vars(args), "jumps": jumps})


if __name__ == "__main__":
    main()
