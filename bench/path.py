"""The node's own request path in process: one sticky ``POST /act`` through the node's ASGI
app vs the minimal app of ``bench/baseline_app.py``, both called directly (no sockets, no
HTTP parsing, no load generator), interleaved in one process on uvloop.

Lockstep latency over loopback (``bench/act.py``) is mostly the kernel's and uvicorn's
work, which both servers pay, and it moves by ±15% between runs on a shared machine; this
isolates what the node adds per step — decoding and checking the body, routing and the
owner's record of the step, the run, metrics, the reply — at a resolution of a few µs.
The node runs on the embedded store (a sticky step at its owner asks no store anyway), 64
episodes in turn, with the connection probe the node's HTTP server gives every request
(``node.asgi.CONNECTION``: one ``poll(2)`` of a socket, no loop turn when alone).
Its rounds move by a few µs on a shared machine: a budget of 1% of a step is compared in
instructions instead, by ``bench/path_instructions.py`` (callgrind, the same steps). Each
round is also timed by the loop thread's CPU time (``time.thread_time``), which the other
processes of a shared machine move less than the clock: ``cpu_us``.

Steps served inline never let the event loop turn. So the timers each step armed and
cancelled (its time limit, its connection's watch) are closed only when the round ends, a
thousand steps' worth at once, which costs more than one step's at a time. ``--turn``
turns the loop once after each step, as a server's loop turns at each request.

Usage: python -m bench.path [--rounds 15] [--steps 1000] [--turn]
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import uvloop

from bench.asgi import Connection, post, running_node
from bench.common import median, options, report

BODY = b'{"episode_id":"ep-%d","inputs":{"obs":[[0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8]]}}'
EPISODES = 64


JSON = [(b"content-type", b"application/json")]


async def _one(app: Any, n: int, connection: Connection) -> None:
    await post(app, "/act", BODY % (n % EPISODES), JSON, connection)


async def _per_step_us(
    app: Any, steps: int, connection: Connection, turn: bool
) -> tuple[float, float]:
    """The clock's and the loop thread's CPU µs per step over ``steps`` steps."""
    started, cpu = time.perf_counter(), time.thread_time()
    for n in range(steps):
        await _one(app, n, connection)
        if turn:
            await asyncio.sleep(0)
    cpu, took = time.thread_time() - cpu, time.perf_counter() - started
    return took / steps * 1e6, cpu / steps * 1e6


async def _measure(rounds: int, steps: int, turn: bool) -> list[dict[str, float]]:
    import bench.baseline_app as baseline  # builds its session on import

    connection = Connection()
    results = []
    async with running_node() as app:
        for n in range(2 * EPISODES):  # claims, sessions and caches warm
            await _one(app, n, connection)
            await _one(baseline.app, n, connection)
        for _ in range(rounds):
            node, node_cpu = await _per_step_us(app, steps, connection, turn)
            base, base_cpu = await _per_step_us(baseline.app, steps, connection, turn)
            results.append(
                {"node_us": node, "base_us": base, "node_cpu_us": node_cpu, "base_cpu_us": base_cpu}
            )
    return results


def main() -> None:
    a = options(rounds=15, steps=1000, turn=(False, "turn the event loop after each step"))
    rounds = uvloop.run(_measure(a.rounds, a.steps, a.turn))
    ratio = median([r["node_us"] / r["base_us"] for r in rounds])
    added = median([r["node_us"] - r["base_us"] for r in rounds])
    added_cpu = median([r["node_cpu_us"] - r["base_cpu_us"] for r in rounds])
    node, base = median([r["node_us"] for r in rounds]), median([r["base_us"] for r in rounds])
    report(
        "path",
        [
            {
                "figure": "sticky /act in process, node's ASGI app / minimal app (no sockets)",
                "value": ratio,
                "result": f"{ratio:.2f}x ({node:.0f} µs vs {base:.0f} µs a step)",
                "goal": "reported",
                "ok": True,
            },
            {
                "figure": "what the node's request path adds per step (node - minimal app)",
                "value": added,
                "result": f"+{added:.1f} µs (+{added_cpu:.1f} µs of the loop thread's CPU)",
                "goal": "reported",
                "ok": True,
            },
        ],
        {"rounds": rounds, "turn": a.turn, "added_cpu_us": added_cpu},
    )


if __name__ == "__main__":
    main()
