"""Issue 43's fourth slice: each episode's recurrent state held by its device's worker
process (``--device-workers process``), against the state crossing the hop with every run
(the third slice's way, which the same code still takes for a model whose state outputs it
is not told: ``DeviceModel(state=())``). One run, two worker processes side by side, each a
``DeviceProcs`` of one CPU device, in alternating rounds (which goes first alternates).

The model: ``big_state_policy`` (tests/models.py), whose recurrent state is ``--elements``
float32s (4 MiB by default: a transformer's cache, a long history) and whose step adds one
to it; its outputs a client sees are 36 bytes. One episode is stepped ``--steps`` times in a
row per round, each step fed the last one's state (a handle, or the arrays), as a device's
thread does. Figures, medians over the rounds of the ratio held / crossing:

1. p50 of a step (the core's ``RemoteSession.run``, from the ask to the answer read back);
2. the core's CPU per step (``time.process_time`` of this process: the core's side of the
   hop, the copies into and out of the slot);
3. bytes written into and read out of the slot per step after the first (counted, not
   timed; the first starts from host zeros either way).

Each round also checks that both give the same count: the state was kept either way.

Usage: python -m bench.worker_state [--rounds 5] [--steps 200] [--elements 1048576]
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import median, options, pct, report, tmpdir
from node.deviceprocs import DeviceModel, DeviceProcs, RemoteSession
from node.devices import DeviceSpec
from node.providers import ProviderSettings
from tests.models import big_state_policy

CPU0 = DeviceSpec(0, "cpu", None, "cpu", "cpu-0", "cpu", 0)
NAMES = ["steps", "seen", "state_out.big"]
MODES = ("held", "crossing")


def _procs(path: Path, held: bool, elements: int) -> DeviceProcs:
    state = ("state_out.big",) if held else ()
    return DeviceProcs(
        "b", [CPU0], [DeviceModel("big", str(path), 1, True, 1, state)], ProviderSettings(),
        max_body_bytes=elements * 4 + (1 << 16), hang_s=600.0,
    )  # fmt: skip


def _counted(session: RemoteSession) -> list[int]:
    """Count the bytes written into and read out of the session's slot (one list, summed)."""
    region = session.channel.region  # type: ignore[union-attr]
    moved = [0]
    write, read = region.write, region.read

    def counting_write(slot: int, state: int, kind: int, meta: Any, arrays: list[Any]) -> None:
        moved[0] += sum(a.nbytes for a in arrays)
        write(slot, state, kind, meta, arrays)

    def counting_read(slot: int, copy: bool) -> Any:
        got = read(slot, copy)
        moved[0] += sum(a.nbytes for a in got[2])
        return got

    region.write = counting_write  # type: ignore[method-assign]
    region.read = counting_read  # type: ignore[method-assign]
    return moved


def _round(session: RemoteSession, moved: list[int], steps: int, elements: int) -> dict[str, Any]:
    state: Any = np.zeros((1, elements), np.float32)
    obs = np.zeros((1, 8), np.float32)
    times = []
    before, cpu = moved[0], time.process_time()
    count = 0.0
    for step in range(steps):
        if step == 1:  # after the first step, which starts from host zeros either way
            before = moved[0]
        started = time.perf_counter()
        count_out, _, state = session.run(NAMES, {"obs": obs, "state_in.big": state})
        times.append(time.perf_counter() - started)
        count = float(np.asarray(count_out).reshape(-1)[0])
    cpu = time.process_time() - cpu
    assert round(count) == steps, f"the state was not kept: {count} after {steps} steps"
    return {
        "p50_ms": pct(times, 50) * 1000,
        "cpu_us": cpu / steps * 1e6,
        "bytes": (moved[0] - before) / (steps - 1),
    }


async def main() -> None:
    args = options(rounds=5, steps=200, elements=1 << 20)
    path = big_state_policy(tmpdir(), args.elements)
    procs = {mode: _procs(path, mode == "held", args.elements) for mode in MODES}
    for p in procs.values():
        await p.start()
    try:
        sessions = {mode: p.sessions[("big", "b/0")] for mode, p in procs.items()}
        moved = {mode: _counted(s) for mode, s in sessions.items()}
        rounds: list[dict[str, dict[str, Any]]] = []
        for r in range(args.rounds):
            order = MODES if r % 2 == 0 else MODES[::-1]
            got = {}
            for mode in order:
                got[mode] = await asyncio.to_thread(
                    _round, sessions[mode], moved[mode], args.steps, args.elements
                )
            rounds.append(got)
            print(f"round {r + 1}: " + "; ".join(
                f"{m} p50 {g['p50_ms']:.3f} ms, CPU {g['cpu_us']:.0f} µs, {g['bytes']:,.0f} B"
                for m, g in got.items()))  # fmt: skip
    finally:
        for p in procs.values():
            await p.stop()

    def ratio(key: str) -> tuple[float, float, float]:
        return (
            median([g["held"][key] / g["crossing"][key] for g in rounds]),
            median([g["held"][key] for g in rounds]),
            median([g["crossing"][key] for g in rounds]),
        )

    figures = []
    for key, name, unit in (("p50_ms", "step p50", "ms"), ("cpu_us", "core CPU per step", "µs")):
        x, held, crossing = ratio(key)
        figures.append({
            "figure": f"{name}, state held by the worker / crossing the hop",
            "result": f"{x:.2f}x ({held:.3f} vs {crossing:.3f} {unit})",
            "goal": "< 1x", "ok": x < 1.0,
        })  # fmt: skip
    held_bytes, crossing_bytes = (median([g[m]["bytes"] for g in rounds]) for m in MODES)
    figures.append({
        "figure": "bytes through the slot per step, held / crossing",
        "result": f"{held_bytes:,.0f} vs {crossing_bytes:,.0f} B",
        "goal": "the state never crosses", "ok": held_bytes < args.elements * 4,
    })  # fmt: skip
    header = {"cores": os.cpu_count(), "load": os.getloadavg(), "elements": args.elements,
              "rounds": args.rounds, "steps": args.steps}  # fmt: skip
    print(header)
    report("worker_state", figures, header)


if __name__ == "__main__":
    asyncio.run(main())
