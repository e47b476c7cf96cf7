"""Action-chunk execution figures (issue 16): execute-steps H vs a model run every step.

The dispatcher alone on one CPU device (ONNX Runtime, one intra-op thread), episodes as
asyncio tasks calling ``MultiGpuDispatcher.step`` in a closed loop; no HTTP, no Redis.
The policy is the packaged camera-sized ``vla_demo`` (two 224x224 cameras, H = 10).
"every step" runs the model at each step (chunk execution off, today's behaviour);
"execute H" runs it once per chunk and answers the H-1 steps between from the buffer.
Medians over ``--runs`` rounds that alternate the two, at 1 and at 8 concurrent episodes;
also the p50 of the buffered steps alone and of the model steps alone (execute H).

Usage: python -m bench.chunks [--seconds 1.5] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from bench.batching import observation
from bench.common import median, pct, report
from node.contract import load_contract
from node.devices import discover
from node.dispatcher import MultiGpuDispatcher
from node.models import VLA_DEMO_MODEL
from node.providers import ProviderSettings, build_session
from tests.dispatch import dispatch


async def drive(
    d: MultiGpuDispatcher, episodes: int, seconds: float, inputs: dict[str, Any], k: int | None
) -> tuple[float, list[float], dict[str, list[float]]]:
    """Closed-loop episodes; return (steps/s, latencies, latencies by reply source)."""
    device = d.devices[0]
    for e in range(episodes):
        await dispatch(d, device, f"ep{e}", 1, True, inputs, execute_steps=k)
    latencies: list[float] = []
    by_source: dict[str, list[float]] = {"model": [], "buffer": []}
    stop = time.perf_counter() + seconds

    async def episode(e: int) -> None:
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            r = await dispatch(d, device, f"ep{e}", 1, False, inputs, execute_steps=k)
            took = time.perf_counter() - t0
            latencies.append(took)
            by_source[r.source].append(took)

    t0 = time.perf_counter()
    await asyncio.gather(*(episode(e) for e in range(episodes)))
    return len(latencies) / (time.perf_counter() - t0), latencies, by_source


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=1.5, help="per measurement")
    p.add_argument("--runs", type=int, default=3, help="rounds, each mode once")
    args = p.parse_args()
    path = VLA_DEMO_MODEL
    contract = load_contract(path)
    session = build_session(path, discover("cpu:1")[0], ProviderSettings()).session
    inputs = observation(contract, 0)
    probe = MultiGpuDispatcher(["bench/0"], lambda _: session, contract)
    chunk = probe.chunk
    probe.close()
    if chunk is None:
        raise SystemExit(f"{path.name} has no action-chunk output")
    horizon = chunk.horizon
    modes: dict[str, int | None] = {"every step": None, f"execute {horizon}": horizon}
    figures: list[dict[str, Any]] = []
    raw: dict[str, Any] = {}
    for episodes in (1, 8):
        rate: dict[str, list[float]] = {m: [] for m in modes}
        p50: dict[str, list[float]] = {m: [] for m in modes}
        p50_source: dict[str, list[float]] = {"model": [], "buffer": []}
        for _ in range(args.runs):
            for mode, k in modes.items():
                d = MultiGpuDispatcher(["bench/0"], lambda _: session, contract)
                try:
                    r, lat, by_source = asyncio.run(drive(d, episodes, args.seconds, inputs, k))
                finally:
                    d.close()
                rate[mode].append(r)
                p50[mode].append(pct(lat, 50) * 1e3)
                if k is not None:
                    for source, values in by_source.items():
                        p50_source[source].append(pct(values, 50) * 1e3)
        every, chunked = (median(rate[m]) for m in modes)
        p_every, p_chunked = (median(p50[m]) for m in modes)
        buffered, model = median(p50_source["buffer"]), median(p50_source["model"])
        raw[str(episodes)] = {"steps_per_s": rate, "p50_ms": p50, "p50_by_source_ms": p50_source}
        figures.append(
            {
                "figure": f"{path.stem} (H={horizon}), {episodes} episode(s): steps/s, "
                f"execute {horizon} / every step",
                "value": chunked / every,
                "result": f"{chunked / every:.2f}x ({chunked:.0f} vs {every:.0f} steps/s)",
                "goal": "reported",
                "ok": True,
            }
        )
        figures.append(
            {
                "figure": f"{path.stem}, {episodes} episode(s): p50, execute {horizon} / every "
                "step",
                "value": p_chunked / p_every,
                "result": f"{p_chunked / p_every:.4f}x ({p_chunked:.3f} vs {p_every:.3f} ms; "
                f"buffered steps {buffered:.3f} ms, model steps {model:.3f} ms)",
                "goal": "reported",
                "ok": True,
            }
        )
    report("chunks", figures, {"args": vars(args), "policy": path.name, "measured": raw})


if __name__ == "__main__":
    main()
