"""Batching figures (issue 14): the dispatcher alone, batching on vs off in the same run.

Episodes are asyncio tasks calling ``MultiGpuDispatcher.step`` in a closed loop (each sends
its next step when the last one is answered), on one device; no HTTP, no Redis. "On" is
the default (``max_batch`` 8, ``batch_delay_us`` 500), "off" is ``max_batch=1``; every
figure is a median over ``--runs`` rounds that alternate on and off.

1. scheduler: an injected session whose run costs the same (``--cost-ms`` of sleep) at
   any batch size up to 8, as a GPU does at small batches: steps/s with 32 concurrent
   episodes, on / off (goal >= 6x); p99 step latency of a lone episode, on / off (goal
   <= 1.2x: the batch delay must not cost a lone robot anything).
2. cpu: each packaged ONNX policy (``node/models/*.onnx``: ``demo_policy``, ``vla_demo``)
   on one CPU device (ONNX Runtime, one intra-op thread as a node runs it): steps/s and
   p50 at 1, 8 and 32 concurrent episodes, on / off.
3. gpu (only with ``RUN_HARDWARE_TESTS=1``): the same on the first GPU (CUDA EP).

Usage: python -m bench.batching [--seconds 1.5] [--runs 3] [--cost-ms 2]
       RUN_HARDWARE_TESTS=1 python -m bench.batching        # adds the GPU figures
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import median, pct, report
from node.contract import PolicyContract, TensorSpec, load_contract
from node.devices import DeviceSpec, discover, pin_pci_bus_order
from node.dispatcher import BatchSettings, MultiGpuDispatcher, Session
from node.models import MODELS_DIR
from node.providers import ProviderSettings, build_session
from tests.dispatch import dispatch

MODES = {"on": None, "off": 1}  # max_batch

SCHEDULER = PolicyContract(
    inputs=(
        TensorSpec("obs", ("batch", 8), "float32"),
        TensorSpec("state_in.h", ("batch", 16), "float32"),
    ),
    outputs=(
        TensorSpec("actions", ("batch", 4, 2), "float32"),
        TensorSpec("state_out.h", ("batch", 16), "float32"),
    ),
    state={"state_in.h": "state_out.h"},
    batch_axis=True,
)


class FixedCost:
    """A session whose run takes ``cost_s`` whatever the batch (up to 8): a small policy
    on a GPU. Sleeping releases the GIL, as ONNX Runtime does while it runs."""

    def __init__(self, cost_s: float) -> None:
        self.cost_s = cost_s

    def run(self, names: Sequence[str] | None, feed: Mapping[str, Any]) -> list[Any]:
        rows = len(feed["obs"])
        assert rows <= 8
        time.sleep(self.cost_s)
        return [np.zeros((rows, 4, 2), np.float32), feed["state_in.h"] + 1]


def observation(contract: PolicyContract, seed: int) -> dict[str, Any]:
    """One random observation of one sample (first dimension 1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for spec in contract.observation_inputs:
        shape = tuple(d if isinstance(d, int) else 1 for d in spec.shape)
        if np.dtype(spec.dtype).kind == "f":
            out[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
        else:
            out[spec.name] = rng.integers(0, 100, shape).astype(spec.dtype)
    return out


async def drive(
    d: MultiGpuDispatcher, episodes: int, seconds: float, inputs: dict[str, Any]
) -> tuple[float, list[float]]:
    """Closed-loop episodes for ``seconds``; return (steps/s, step latencies in s)."""
    device = d.devices[0]
    rtc = None if d.rtc is None else d.rtc_for(0, 0)  # an RTC model: no prefix, no estimate
    for e in range(episodes):  # claim each episode once, outside the measurement
        await dispatch(d, device, f"ep{e}", 1, True, inputs, rtc=rtc)
    latencies: list[float] = []
    stop = time.perf_counter() + seconds

    async def episode(e: int) -> None:
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            await dispatch(d, device, f"ep{e}", 1, False, inputs, rtc=rtc)
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(episode(e) for e in range(episodes)))
    return len(latencies) / (time.perf_counter() - t0), latencies


def measure(
    contract: PolicyContract,
    make_session: Any,
    episodes: int,
    seconds: float,
    runs: int,
) -> dict[str, dict[str, float]]:
    """Median steps/s, p50 and p99 (ms) of ``episodes`` episodes, batching on and off."""
    inputs = observation(contract, 0)
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    p50: dict[str, list[float]] = {m: [] for m in MODES}
    p99: dict[str, list[float]] = {m: [] for m in MODES}
    sessions = {mode: make_session() for mode in MODES}
    for _ in range(runs):
        for mode, max_batch in MODES.items():

            async def once(mode: str = mode, max_batch: int | None = max_batch) -> None:
                d = MultiGpuDispatcher(
                    ["bench/0"],
                    lambda _: sessions[mode],
                    contract,
                    batching=BatchSettings(max_batch=max_batch),
                )
                try:
                    rate, lat = await drive(d, episodes, seconds, inputs)
                finally:
                    d.close()
                rates[mode].append(rate)
                p50[mode].append(pct(lat, 50) * 1e3)
                p99[mode].append(pct(lat, 99) * 1e3)

            asyncio.run(once())
    return {
        m: {"steps_per_s": median(rates[m]), "p50_ms": median(p50[m]), "p99_ms": median(p99[m])}
        for m in MODES
    }


def policies() -> list[tuple[str, Path]]:
    """The packaged policies (``node/models/*.onnx``)."""
    return [(path.stem, path) for path in sorted(MODELS_DIR.glob("*.onnx"))]


def real_figures(
    kind: str, device: DeviceSpec, args: argparse.Namespace
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    figures: list[dict[str, Any]] = []
    raw: dict[str, Any] = {}
    for name, path in policies():
        contract = load_contract(path)
        if not contract.batchable:
            raise SystemExit(f"{path.name} cannot batch: {contract.batch_blocker}")

        def make_session(path: Path = path) -> Session:
            built = build_session(path, device, ProviderSettings())
            return built.session  # type: ignore[no-any-return]

        for episodes in (1, 8, 32):
            got = measure(contract, make_session, episodes, args.seconds, args.runs)
            raw[f"{kind} {name} {episodes}"] = got
            on, off = got["on"], got["off"]
            ratio = on["steps_per_s"] / off["steps_per_s"]
            figures.append(
                {
                    "figure": f"{kind} {name}: steps/s at {episodes} episodes, on / off",
                    "value": ratio,
                    "result": f"{ratio:.2f}x ({on['steps_per_s']:.0f} vs "
                    f"{off['steps_per_s']:.0f} steps/s; p50 {on['p50_ms']:.2f} vs "
                    f"{off['p50_ms']:.2f} ms)",
                    "goal": "reported",
                    "ok": True,
                }
            )
    return figures, raw


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=1.5, help="per measurement")
    p.add_argument("--runs", type=int, default=3, help="rounds, each on then off")
    p.add_argument("--cost-ms", type=float, default=2.0, help="the scheduler session's run")
    args = p.parse_args()
    cost = args.cost_ms / 1e3

    many = measure(SCHEDULER, lambda: FixedCost(cost), 32, args.seconds, args.runs)
    lone = measure(SCHEDULER, lambda: FixedCost(cost), 1, args.seconds, args.runs)
    speedup = many["on"]["steps_per_s"] / many["off"]["steps_per_s"]
    p99 = lone["on"]["p99_ms"] / lone["off"]["p99_ms"]
    figures: list[dict[str, Any]] = [
        {
            "figure": f"scheduler ({args.cost_ms:g} ms/run at any batch): steps/s at 32 "
            "episodes, batching on / off",
            "value": speedup,
            "result": f"{speedup:.2f}x ({many['on']['steps_per_s']:.0f} vs "
            f"{many['off']['steps_per_s']:.0f} steps/s)",
            "goal": ">= 6x",
            "ok": speedup >= 6,
        },
        {
            "figure": "scheduler: p99 step latency of a lone episode, batching on / off",
            "value": p99,
            "result": f"{p99:.2f}x ({lone['on']['p99_ms']:.2f} ms vs "
            f"{lone['off']['p99_ms']:.2f} ms)",
            "goal": "<= 1.2x",
            "ok": p99 <= 1.2,
        },
    ]
    raw: dict[str, Any] = {"scheduler 32": many, "scheduler 1": lone}
    cpu, cpu_raw = real_figures("cpu", discover("cpu:1")[0], args)
    figures += cpu
    raw.update(cpu_raw)
    if os.environ.get("RUN_HARDWARE_TESTS") == "1":
        pin_pci_bus_order(os.environ)
        gpus = [d for d in discover("auto") if d.kind == "cuda"]
        if not gpus:
            raise SystemExit("RUN_HARDWARE_TESTS=1 but no GPU was discovered")
        gpu, gpu_raw = real_figures("gpu", gpus[0], args)
        figures += gpu
        raw.update(gpu_raw)
    report("batching", figures, {"args": vars(args), "measured": raw})


if __name__ == "__main__":
    main()
