"""Many episodes' steps in one message (issue 44): K episodes over a few connections
through a 3-node fleet of CPU stand-ins (real redis-server, real nodes, the ``demo``
policy), one-row requests against K-row messages (msgpack ``POST /act``).

The load comes from ``--procs`` client processes (the fleet's machine has few cores; one
Python process would be the bottleneck) over a minimal HTTP/1.1 client: each request's
bytes are made once, a reply is read by its ``content-length`` and decoded with msgpack.
Measured per phase, on the same fleet, after every episode was claimed:

- closed loop (a connection's next request when its last is answered), ``--episodes``
  over ``--connections``: steps/s; one-row, each of a connection's episodes' steps is one
  request; rows, its episodes' steps of a round are one message;
- the paced phases, the row p99 at the same load per device: ``--paced`` episodes at
  ``--hz``, every episode's step due at the same instant each period (a simulation farm
  steps its environments together). Three ways to send them: *one-row sequential* (each
  of ``--connections`` connections sends its episodes' steps one after the other), *one-row
  burst* (one connection per episode, all the steps at once: what a farm without rows
  sends), *rows* (each connection's steps in one message). The burst and the rows phases
  run at the rate the sequential one reached (below ``--hz`` only where it could not
  bear it). A row's time two ways: at the client, request sent to reply read; at the node
  it came in by, from the request's arrival to its reply (the reply's ``timing.total_ms``,
  asked with ``X-Affinity-Timing``; for a row, the largest of its message's rows, since
  the message is answered when its last row is);
- messages forwarded between nodes per request (``affinity_forwarded_total``, every
  node): at most the owners a message touches;
- Redis commands per step (``INFO commandstats``, renewals included);
- the nodes' CPU per step in the paced phases (``/proc``, all three nodes);
- the client processes' CPU share of the phase (a load generator near 100% of its core is
  its own bottleneck).

``--rounds``: the paced phases this many times, one after the other (on a shared machine
one round says little). A row's own time at the node (before its message's other rows)
and how many rows were forwarded are in ``bench/results/rows.json``.

Usage: python -m bench.rows [--episodes 256] [--connections 8] [--seconds 6] [--procs 2]
       [--rounds 1]
"""

from __future__ import annotations

import asyncio
import multiprocessing
import re
import resource
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgpack
import numpy as np

from affinity import wire
from bench.common import Node, RedisServer, cpu_seconds, options, pct, report, tmpdir

OBS = np.zeros((1, 8), np.float32)


def forwarded(urls: list[str]) -> float:
    """Forwards every node made so far (any result)."""
    total = 0.0
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=5).text
        total += sum(float(v) for v in re.findall(r"^affinity_forwarded_total\{[^}]*\} (\S+)",
                                                   text, re.M))  # fmt: skip
    return total


def redis_calls(client: Any) -> int:
    stats = client.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k.startswith("cmdstat_"))


def fleet_cpu(nodes: list[Node]) -> float:
    """CPU seconds the nodes' processes used so far."""
    return sum(cpu_seconds(n.proc.popen.pid) for n in nodes if n.proc.popen is not None)


class Conn:
    """One keep-alive HTTP/1.1 connection posting msgpack to ``/act`` (what the bench
    needs of a client, and no more: the load generator is not the bottleneck)."""

    def __init__(self, url: str) -> None:
        split = urlsplit(url)
        self.host, self.port = split.hostname or "127.0.0.1", split.port or 80
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    def request(self, body: bytes) -> bytes:
        """The bytes of a ``POST /act`` of ``body`` (made once, sent many times)."""
        head = (
            f"POST /act HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/msgpack"
            f"\r\naccept: application/msgpack\r\nx-affinity-timing: 1\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body

    async def post(self, request: bytes) -> tuple[int, bytes]:
        assert self.reader is not None and self.writer is not None
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        at = head.lower().index(b"content-length:") + 15
        length = int(head[at : head.index(b"\r\n", at)])
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _phase(job: dict[str, Any]) -> dict[str, Any]:
    """One client process's part of a phase (its connections), run to ``stop``."""
    return asyncio.run(_drive(**job))


async def _drive(
    conns: list[tuple[str, list[str]]], rows: bool, start: float, stop: float, hz: float
) -> dict[str, Any]:
    """Each connection's rounds from ``start`` to ``stop`` (monotonic clock, one for every
    process): closed loop, or a round due every 1/``hz`` s at the same instants for all.
    Returns the steps, requests, each row's times (ms; client side and at the node),
    each round's time (its first step sent to its last reply read) and this process's CPU
    seconds."""
    out: dict[str, Any] = {"steps": 0, "requests": 0, "client": [], "server": [], "rounds": [],
                           "splits": []}  # fmt: skip
    links = [Conn(url) for url, _ in conns]
    await asyncio.gather(*(c.open() for c in links))

    async def connection(conn: Conn, mine: list[str]) -> None:
        if rows:
            body = {"steps": [{"episode_id": e, "inputs": {"obs": OBS}} for e in mine]}
            requests = [conn.request(wire.encode(body))]
        else:
            requests = [conn.request(wire.encode({"episode_id": e, "inputs": {"obs": OBS}}))
                        for e in mine]  # fmt: skip
        due = start
        while True:
            now = time.monotonic()
            if hz:
                if due > now:
                    await asyncio.sleep(due - now)
                due = max(due + 1 / hz, time.monotonic())
            elif now < start:
                await asyncio.sleep(start - now)
            began = time.monotonic()
            if began >= stop:
                return
            for request in requests:
                sent = time.monotonic()
                status, reply = await conn.post(request)
                took = (time.monotonic() - sent) * 1000
                out["requests"] += 1
                if status != 200:
                    continue
                doc = msgpack.unpackb(reply)
                got = [r for r in doc["steps"] if "error" not in r] if rows else [doc]
                if got:  # a message is answered when its last row is
                    at_node = max(r["timing"]["total_ms"] for r in got)
                    out["steps"] += len(got)
                    out["client"].extend([took] * len(got))
                    out["server"].extend([at_node] * len(got))
                    out["splits"].extend(
                        (r["timing"]["total_ms"], r["timing"]["queue_ms"], r["timing"]["run_ms"],
                         r["timing"]["forward_ms"], at_node) for r in got
                    )  # fmt: skip
            out["rounds"].append((time.monotonic() - began) * 1000)

    cpu = resource.getrusage(resource.RUSAGE_SELF)
    try:
        await asyncio.gather(*(connection(c, m) for c, (_, m) in zip(links, conns, strict=True)))
    finally:
        for c in links:
            c.close()
    used = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu_s"] = used.ru_utime + used.ru_stime - cpu.ru_utime - cpu.ru_stime
    return out


def drive(
    urls: list[str], episodes: list[list[str]], seconds: float, rows: bool, procs: int,
    hz: float = 0.0,
) -> dict[str, Any]:  # fmt: skip
    """``seconds`` of steps over one connection per list of ``episodes`` (to the nodes in
    turn), from ``procs`` processes: the processes' results merged, the CPU share the
    busiest process used."""
    conns = [(urls[i % len(urls)], mine) for i, mine in enumerate(episodes)]
    start = time.monotonic() + 1.0  # every process connected by then
    jobs = [{"conns": conns[p::procs], "rows": rows, "start": start,
             "stop": start + seconds, "hz": hz} for p in range(procs)]  # fmt: skip
    with multiprocessing.get_context("fork").Pool(procs) as pool:
        parts = pool.map(_phase, jobs)
    merged: dict[str, Any] = {"steps": 0, "requests": 0, "client": [], "server": [], "rounds": [],
                              "splits": []}  # fmt: skip
    for part in parts:
        for key in merged:
            merged[key] += part[key]
    merged["client_cpu"] = max(part["cpu_s"] for part in parts) / seconds
    return merged


def main() -> None:
    args = options(
        episodes=256,
        connections=8,
        seconds=6.0,
        procs=(2, "client processes"),
        hz=(5.0, "the paced phases' control rate (a load the one-row path bears)"),
        paced=(64, "episodes of the paced phases (a load the one-row path bears)"),
        rounds=(1, "paced rounds (sequential, burst, rows each), one after the other"),
    )
    tmp = tmpdir()
    redis = RedisServer(tmp).start()
    extra = ["--capacity", str(args.episodes), "--max-rows", str(args.episodes)]
    nodes = [Node(tmp, f"n{i}", redis.url, devices="cpu:1", extra=extra) for i in range(3)]
    procs = args.procs
    try:
        for node in nodes:
            node.start()
        urls = [n.url for n in nodes]
        ids = [f"rows-{i}" for i in range(args.episodes)]
        per = [ids[i :: args.connections] for i in range(args.connections)]
        drive(urls, per, 0.5, True, procs)  # every episode claimed (and warmed)
        client = redis.client()
        phases: dict[str, dict[str, float]] = {}
        for name, rows in (("one-row", False), ("rows", True)):
            f0, c0 = forwarded(urls), redis_calls(client)
            got = drive(urls, per, args.seconds, rows, procs)
            f1, c1 = forwarded(urls), redis_calls(client)
            phases[name] = {
                "steps_per_s": got["steps"] / args.seconds,
                "requests": got["requests"],
                "p99_ms": pct(got["client"], 99),
                "forwards_per_request": (f1 - f0) / max(got["requests"], 1),
                "redis_commands_per_step": (c1 - c0) / max(got["steps"], 1),
                "client_cpu": got["client_cpu"],
            }
            print(name, {k: round(v, 4) for k, v in phases[name].items()})
        few = ids[: args.paced]
        grouped = [few[i :: args.connections] for i in range(args.connections)]
        alone = [[e] for e in few]  # one connection per episode
        paced: list[dict[str, dict[str, float]]] = []
        for _ in range(args.rounds):
            hz = args.hz
            this: dict[str, dict[str, float]] = {}
            for name, way, rows in (("sequential", grouped, False), ("burst", alone, False),
                                    ("rows", grouped, True)):  # fmt: skip
                cpu0 = fleet_cpu(nodes)
                got = drive(urls, way, args.seconds, rows, procs, hz)
                cpu = fleet_cpu(nodes) - cpu0
                this[name] = {
                    "hz": hz,
                    "steps_per_s": got["steps"] / args.seconds,
                    "requests": got["requests"],
                    "p99_ms": pct(got["client"], 99),
                    "p50_ms": pct(got["client"], 50),
                    "node_p99_ms": pct(got["server"], 99),
                    "node_p50_ms": pct(got["server"], 50),
                    # a row's own time at the node, before it waits for its message's others
                    "own_p99_ms": pct([split[0] for split in got["splits"]], 99),
                    "forwarded_rows": sum(1 for split in got["splits"] if split[3] > 0),
                    "round_p99_ms": pct(got["rounds"], 99),
                    "client_cpu": got["client_cpu"],
                    "node_cpu_us_per_step": cpu / max(got["steps"], 1) * 1e6,
                }
                print(f"paced {name}", {k: round(v, 4) for k, v in this[name].items()})
                if name == "sequential":
                    # the same load per device: the others at the rate the sequential
                    # one-row requests reached (below --hz when it could not bear it)
                    hz = min(args.hz, got["steps"] / args.seconds / args.paced)
            paced.append(this)
    finally:
        for node in nodes:
            node.stop()
        redis.stop()
    one, many = phases["one-row"], phases["rows"]
    ratio = many["steps_per_s"] / max(one["steps_per_s"], 1e-9)
    touched = 3  # a message's rows live on every node of the fleet
    figures = [
        {
            "figure": "steps/s, K-row messages / one-row requests, closed loop",
            "result": f"{ratio:.2f}x ({many['steps_per_s']:.0f} vs {one['steps_per_s']:.0f})",
            "goal": ">= 3x",
            "ok": ratio >= 3,
        },
        {
            "figure": "row p99 (ms), rows vs one-row, closed loop (unequal loads)",
            "result": f"{many['p99_ms']:.1f} vs {one['p99_ms']:.1f}",
            "goal": "reported",
            "ok": True,
        },
    ]
    for n, this in enumerate(paced):
        seq, burst, rows_ = this["sequential"], this["burst"], this["rows"]
        at = f"round {n + 1}, {args.paced} episodes at {rows_['hz']:.3g} Hz"
        for base_name, base in (("sequential", seq), ("burst", burst)):
            for where, key in (("at the node", "node_p99_ms"), ("at the client", "p99_ms")):
                r = rows_[key] / max(base[key], 1e-9)
                figures.append({
                    "figure": f"row p99 {where}, rows / one-row {base_name} ({at}; steps/s "
                    f"{rows_['steps_per_s']:.0f} vs {base['steps_per_s']:.0f})",
                    "result": f"{r:.2f}x ({rows_[key]:.1f} vs {base[key]:.1f} ms; p50 "
                    f"{rows_[key.replace('99', '50')]:.1f} vs {base[key.replace('99', '50')]:.1f})",
                    "goal": "<= 1.2x",
                    "ok": r <= 1.2,
                })  # fmt: skip
        figures.append({
            "figure": f"the nodes' CPU per step (µs), rows / sequential / burst ({at})",
            "result": " / ".join(f"{p['node_cpu_us_per_step']:.0f}" for p in (rows_, seq, burst)),
            "goal": "reported",
            "ok": True,
        })  # fmt: skip
        figures.append({
            "figure": f"a connection's round (first step sent to last reply read), p99 ms, "
            f"rows / sequential / burst ({at})",
            "result": f"{rows_['round_p99_ms']:.1f} / {seq['round_p99_ms']:.1f} / "
            f"{burst['round_p99_ms']:.1f}",
            "goal": "reported",
            "ok": True,
        })  # fmt: skip
    busiest = max([one["client_cpu"], many["client_cpu"]]
                  + [p["client_cpu"] for this in paced for p in this.values()])  # fmt: skip
    figures += [
        {
            "figure": "messages forwarded per K-row request",
            "result": f"{many['forwards_per_request']:.2f}",
            "goal": f"<= {touched - 1} (the other owners)",
            "ok": many["forwards_per_request"] <= touched - 1,
        },
        {
            "figure": "Redis commands per step (rows)",
            "result": f"{many['redis_commands_per_step']:.5f}",
            "goal": "<= 0.01",
            "ok": many["redis_commands_per_step"] <= 0.01,
        },
        {
            "figure": f"CPU share of the busiest of {procs} client processes, any phase",
            "result": f"{busiest:.0%}",
            "goal": "reported (near 100%: the client is the bottleneck)",
            "ok": True,
        },
    ]
    report(
        "rows",
        figures,
        {
            "episodes": args.episodes,
            "connections": args.connections,
            "procs": procs,
            "phases": phases,
            "paced": paced,
        },
    )


if __name__ == "__main__":
    main()
