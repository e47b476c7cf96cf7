"""What a forwarded row costs the fleet's CPU (issue 44): messages of ``--rows`` rows, all
owned by node n1, sent by ``--connections`` connections either through node n0, which
forwards each message to n1 (``fwd``), or straight to n1 (``local``). Two real nodes of
the ``demo`` CPU stand-in on a real ``redis-server``; msgpack ``POST /act``.

Measured from ``/proc`` over ``--seconds``: each node's CPU per row, and n1's split by
thread (its event loop, its device's worker). ``--rate``: messages per second per
connection (0: closed loop, the next message when the last is answered). At a low rate
every message wakes idle processes and threads, which costs more than the same work under
load: that is what the paced phases of ``bench/rows.py`` see.

Usage: python -m bench.forward_cpu [--mode fwd] [--rows 3] [--rate 15] [--seconds 10]
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import httpx
import numpy as np

from affinity import wire
from bench.common import Node, RedisServer, cpu_seconds, options, tmpdir

MSGPACK = {"content-type": "application/msgpack", "accept": "application/msgpack"}
OBS = np.zeros((1, 8), np.float32)


def threads(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of ``pid`` so far: ``loop`` (the main thread) and the others by
    name and id."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        head, _, tail = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rpartition(")")
        fields = tail.split()
        name = "loop" if int(tid) == pid else f"{head.partition('(')[2]}-{tid}"
        out[name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def body(episodes: list[str]) -> bytes:
    return wire.encode({"steps": [{"episode_id": e, "inputs": {"obs": OBS}} for e in episodes]})


async def drive(url: str, bodies: list[bytes], seconds: float, rate: float) -> int:
    """Messages answered: one connection per body, each sending its body until ``seconds``."""
    answered = 0
    stop = time.monotonic() + seconds

    async def connection(message: bytes) -> None:
        nonlocal answered
        due = time.monotonic()
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            while time.monotonic() < stop:
                if rate:
                    due += 1 / rate
                    await asyncio.sleep(max(0.0, due - time.monotonic()))
                r = await client.post("/act", content=message, headers=MSGPACK)
                if r.status_code != 200:
                    raise RuntimeError(f"{r.status_code}: {r.text[:300]}")
                answered += 1

    await asyncio.gather(*(connection(b) for b in bodies))
    return answered


def main() -> None:
    opts = options(mode="fwd", rows=3, rate=15.0, seconds=10.0, connections=3)
    tmp = tmpdir()
    redis = RedisServer(tmp).start()
    extra = ["--capacity", "512", "--max-rows", "512"]
    nodes = [Node(tmp, f"n{i}", redis.url, devices="cpu:1", extra=extra) for i in range(2)]
    try:
        for n in nodes:
            n.start()
        entry, owner = nodes
        # claimed through n0: about half the episodes land on n1
        claim = body([f"p-{i}" for i in range(4 * opts.rows * opts.connections)])
        got = wire.decode(httpx.post(entry.url + "/act", content=claim, headers=MSGPACK,
                                     timeout=30).content)["steps"]  # fmt: skip
        remote = [g["episode_id"] for g in got if g.get("node") == "n1"]
        k = opts.rows
        bodies = [body(remote[i * k : (i + 1) * k]) for i in range(opts.connections)]
        url = entry.url if opts.mode == "fwd" else owner.url
        asyncio.run(drive(url, bodies, 2, opts.rate))  # warm
        pids = [n.proc.popen.pid for n in nodes if n.proc.popen is not None]
        before, split = [cpu_seconds(p) for p in pids], threads(pids[1])
        messages = asyncio.run(drive(url, bodies, opts.seconds, opts.rate))
        after, split_after = [cpu_seconds(p) for p in pids], threads(pids[1])
    finally:
        for n in nodes:
            n.stop()
        redis.stop()
    rows = messages * k
    per = [(b - a) / rows * 1e6 for a, b in zip(before, after, strict=True)]
    by_thread = {t: round((split_after[t] - s) / rows * 1e6) for t, s in split.items()
                 if split_after.get(t, s) > s}  # fmt: skip
    print(f"{opts.mode}, {k}-row messages, {messages / opts.seconds:.0f} messages/s "
          f"({rows / opts.seconds:.0f} rows/s): CPU per row n0 {per[0]:.0f} µs, n1 {per[1]:.0f} "
          f"µs, both {sum(per):.0f} µs; n1 by thread {by_thread}; load "
          f"{os.getloadavg()[0]:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
