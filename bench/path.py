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

Usage: python -m bench.path [--rounds 15] [--steps 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import select
import socket
import time
from dataclasses import replace
from typing import Any

import uvloop

from affinity import Settings
from bench.common import median, report
from node.app import NodeApp, create_app
from node.config import NodeConfig
from node.main import build_service

BODY = b'{"episode_id":"ep-%d","inputs":{"obs":[[0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8]]}}'
EPISODES = 64


class _Connection:
    """What the node's HTTP protocol tells a request (``node.asgi.Connection``), over a
    real socket pair: the close check costs the same ``poll(2)``."""

    def __init__(self) -> None:
        self.ours, self.theirs = socket.socketpair()
        self.poll = select.poll()
        self.poll.register(self.ours.fileno(), select.POLLRDHUP)

    def peer_closed(self) -> bool:
        return bool(self.poll.poll(0))

    def serving_others(self) -> bool:
        return False


async def _one(app: Any, n: int, connection: _Connection) -> None:
    body = BODY % (n % EPISODES)
    sent = False
    out: list[Any] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.get_running_loop().create_future()  # open until the reply
        raise AssertionError("unreachable")

    async def send(message: Any) -> None:
        out.append(message)

    scope = {
        "type": "http", "method": "POST", "path": "/act", "http_version": "1.1",
        "scheme": "http", "query_string": b"", "root_path": "", "client": ("127.0.0.1", 5555),
        "server": ("127.0.0.1", 8000), "asgi": {"version": "3.0"}, "state": {},
        "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
        "affinity.connection": connection,
    }  # fmt: skip
    await app(scope, receive, send)
    if out[0]["status"] != 200:
        raise RuntimeError(f"{out[0]['status']}: {out[-1].get('body', b'')[:300]!r}")


async def _per_step_us(app: Any, steps: int, connection: _Connection) -> float:
    started = time.perf_counter()
    for n in range(steps):
        await _one(app, n, connection)
    return (time.perf_counter() - started) / steps * 1e6


async def _measure(rounds: int, steps: int) -> list[dict[str, float]]:
    import bench.baseline_app as baseline  # builds its session on import

    config = replace(
        NodeConfig(node_id="path", advertise_url="http://path.test", devices="cpu:1"),
        settings=Settings(lease_ttl_s=30),
        capacity=1000,
    )
    app: NodeApp = create_app(build_service(config))
    app.access.stream = open(os.devnull, "w")  # noqa: SIM115 (closed below)
    connection = _Connection()
    results = []
    try:
        async with app.api.router.lifespan_context(app.api):
            for n in range(2 * EPISODES):  # claims, sessions and caches warm
                await _one(app, n, connection)
                await _one(baseline.app, n, connection)
            for _ in range(rounds):
                node = await _per_step_us(app, steps, connection)
                base = await _per_step_us(baseline.app, steps, connection)
                results.append({"node_us": node, "base_us": base})
    finally:
        app.access.stream.close()
    return results


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=1000)
    a = p.parse_args()
    rounds = uvloop.run(_measure(a.rounds, a.steps))
    ratio = median([r["node_us"] / r["base_us"] for r in rounds])
    added = median([r["node_us"] - r["base_us"] for r in rounds])
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
                "result": f"+{added:.0f} µs",
                "goal": "reported",
                "ok": True,
            },
        ],
        {"rounds": rounds},
    )


if __name__ == "__main__":
    main()
