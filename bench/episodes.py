"""Memory the owner holds per live episode (node/episodes.py: the record, the last reply and
the record before the last step), measured with ``tracemalloc`` in one process.

A dispatcher on one CPU device runs ``--episodes`` episodes of ``--steps`` steps each with
the real ONNX session; the figure is the growth of Python-allocated memory per episode
(records, dicts, array headers). The tensors themselves (the recurrent states and the
replies' outputs) are allocated by ONNX Runtime, which ``tracemalloc`` does not see: the
figure names their size per copy beside it. Run it on two checkouts to compare.

Usage: python -m bench.episodes [--model demo] [--episodes 1000] [--steps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import tracemalloc

from bench.common import report
from node.contract import load_contract
from node.devices import discover
from node.dispatcher import BatchSettings, MultiGpuDispatcher
from node.models import resolve_model
from node.providers import ProviderSettings, build_session
from tests.dispatch import dispatch


async def measure(model: str, episodes: int, steps: int) -> tuple[float, int]:
    path = resolve_model(model)
    contract = load_contract(path)
    spec = discover("cpu:1")[0]
    session = build_session(path, spec, ProviderSettings()).session
    device = "bench/0"
    d = MultiGpuDispatcher(
        [device], lambda _: session, contract, batching=BatchSettings(max_batch=1)
    )
    inputs = {s.name: s.zeros() for s in contract.observation_inputs}
    try:
        for i in range(20):  # warm: allocator pools, caches
            await dispatch(d, device, f"warm-{i}", 1, True, inputs)
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        last = None
        for i in range(episodes):
            for t in range(steps):
                last = await dispatch(d, device, f"ep-{i}", 1, t == 0, inputs)
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
    finally:
        d.close()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert last is not None
    floor = sum(v.nbytes for v in contract.initial_state().values())
    floor += sum(v.nbytes for v in last.outputs.values())
    return grown / episodes, floor


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--episodes", type=int, default=1000)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    per_episode, floor = asyncio.run(measure(a.model, a.episodes, a.steps))
    report(
        "episodes",
        [
            {
                "figure": f"Python objects per live episode at the owner ({a.model}, "
                f"{a.episodes} episodes of {a.steps} steps)",
                "value": per_episode,
                "result": f"{per_episode:,.0f} B (plus tensors: {floor} B per state and "
                "reply, allocated by ONNX Runtime)",
                "goal": "reported",
                "ok": True,
            }
        ],
    )


if __name__ == "__main__":
    main()
