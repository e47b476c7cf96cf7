"""Clients that read nothing, beside clients that read (issue 43: a front's hop tickets).

A robot on a slow link, or a client that stopped reading, leaves its reply in its front's
buffer. A node of two fronts serves `wrk` (readers, msgpack `/act` over 64 episodes) alone,
then beside ``--stalled`` clients that each send one step and never read its reply (a
socket with a 64 KiB receive buffer; the model answers ``4 * --wide`` bytes a step, more
than the kernel's buffers hold). Figures, per node, medians of the rounds: the readers'
steps/s beside the stalled clients / alone (same round), their non-2xx answers, and how
many stalled clients still get their whole reply once they read (the others were dropped
by their front, their steps in doubt). ``--against REF`` runs the same node from commit
``REF`` too (unpacked with ``git archive``), the two in turn in every round, and adds the
server CPU per request of the readers alone, this checkout / ``REF``.

Usage: python -m bench.stalled [--against REF] [--runs 3] [--seconds 3] [--stalled 70]
[--wide 1048576] [--connections 8]
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from pathlib import Path

import httpx

from affinity import wire
from bench.act import episodes_lua
from bench.common import Node, RedisServer, median, options, report, tmpdir, wait_until, wrk
from bench.fronts import family
from bench.fronts_openpi import checkout, node_from
from tests.models import counter_policy


def stall(node: Node, episode: str) -> socket.socket:
    """One msgpack step on a socket that reads nothing (64 KiB receive buffer)."""
    data = wire.encode({"episode_id": episode, "inputs": {"obs": [[0.0] * 8]}})
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    sock.connect((node.host, node.port))
    sock.sendall(b"POST /act HTTP/1.1\r\nHost: node\r\nContent-Type: application/msgpack\r\n"
                 b"Accept: application/msgpack\r\nContent-Length: " + str(len(data)).encode()
                 + b"\r\n\r\n" + data)  # fmt: skip
    return sock


def whole(sock: socket.socket, timeout: float = 30.0) -> bool:
    """Whether ``sock`` now reads a whole 200 reply (False: reset, closed or cut short)."""
    sock.settimeout(timeout)
    raw = b""
    try:
        while b"\r\n\r\n" not in raw:
            chunk = sock.recv(1 << 16)
            if not chunk:
                return False
            raw += chunk
        head, _, body = raw.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        if b" 200 " not in lines[0] + b" ":
            return False
        length = int(
            next(ln.split(b":")[1] for ln in lines if ln.lower().startswith(b"content-length"))
        )
        while len(body) < length:
            chunk = sock.recv(1 << 20)
            if not chunk:
                return False
            body += chunk
        return True
    except (OSError, StopIteration, ValueError):
        return False
    finally:
        sock.close()


def steps_served(url: str) -> float:
    """The steps the node served so far (``affinity_routing_total``, every served result)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("affinity_routing_total{")
        and any(f'result="{r}"' in line for r in ("hit", "claimed", "reassigned", "stateless"))
    )


def main() -> None:
    a = options(against="", runs=3, seconds=3.0, stalled=70, wide=1 << 20, connections=8)
    tmp = tmpdir()
    model = counter_policy(tmp, wide=a.wide)
    extra = ["--front-doors", "2", "--model", str(model), "--capacity", "100000",
             "--lease-ttl", "30", "--access-log", "off", "--act-deadline", "60"]  # fmt: skip
    servers: dict[str, Path | None] = {"this": None}
    if a.against:
        servers["before"] = checkout(a.against, tmp)
    redises = {name: RedisServer(tmp).start() for name in servers}
    nodes: dict[str, Node] = {}
    rounds: list[dict[str, float]] = []
    load = episodes_lua(64, accept="application/msgpack", prefix="rd")
    try:
        for name, src in servers.items():
            node = Node(tmp, name, redises[name].url, devices="cpu:1", extra=extra)
            nodes[name] = node_from(node, src) if src is not None else node
            node.start(timeout=90)
            assert node.proc.popen is not None
            wait_until(lambda node=node: len(family(node.proc.popen.pid)) >= 3, 30, "fronts")
            wrk(node.url, load, duration_s=1, connections=a.connections)  # warm
        for r in range(a.runs):
            got: dict[str, float] = {}
            order = list(nodes) if r % 2 == 0 else list(reversed(nodes))
            for name in order:
                node = nodes[name]
                assert node.proc.popen is not None
                pids = family(node.proc.popen.pid)
                alone = wrk(node.url, load, duration_s=a.seconds, connections=a.connections,
                            server_pids=pids)  # fmt: skip
                served = steps_served(node.url)
                socks = [stall(node, f"st-{r}-{k}") for k in range(a.stalled)]
                # answered, their replies stuck in the fronts (the node's own count: a node
                # before the tickets has none of them to show)
                wait_until(lambda url=node.url, n=served + a.stalled: steps_served(url) >= n,
                           60, "the stalled clients' steps served")  # fmt: skip
                beside = wrk(node.url, load, duration_s=a.seconds, connections=a.connections,
                             allow_errors=True)  # fmt: skip
                got[f"ratio_{name}"] = beside.rps / alone.rps
                got[f"cpu_{name}"] = alone.cpu_per_request * 1e6
                got[f"errors_{name}"] = beside.errors
                got[f"whole_{name}"] = sum(whole(s) for s in socks)
            rounds.append(got)
            print(f"round {r}: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items()), flush=True)
    finally:
        for node in nodes.values():
            with contextlib.suppress(Exception):
                node.stop()
        for redis in redises.values():
            redis.stop()
    figures = []
    for name in nodes:
        label = "this checkout" if name == "this" else a.against
        figures.append({
            "figure": f"{label}, 2 fronts: readers' steps/s beside {a.stalled} clients that "
            f"read nothing / alone (wrk -c{a.connections}, {4 * a.wide >> 20} MiB replies); "
            "readers' non-2xx beside them; stalled clients whose whole reply came once read",
            "result": f"{median([x[f'ratio_{name}'] for x in rounds]):.2f}x; "
            f"{median([x[f'errors_{name}'] for x in rounds]):.0f}; "
            f"{median([x[f'whole_{name}'] for x in rounds]):.0f} of {a.stalled}",
            "goal": "reported",
            "ok": True,
        })  # fmt: skip
    facts = {"rounds": rounds, "against": a.against, "cores": os.cpu_count(),
             "load": os.getloadavg(), "python": sys.version.split()[0]}  # fmt: skip
    if "before" in nodes:
        figures.append({
            "figure": f"readers alone, server CPU per request (every process), this checkout / "
            f"{a.against}: what the tickets cost a reply the kernel takes at once",
            "result": f"{median([x['cpu_this'] / x['cpu_before'] for x in rounds]):.2f}x "
            f"({median([x['cpu_this'] for x in rounds]):.0f} vs "
            f"{median([x['cpu_before'] for x in rounds]):.0f} µs)",
            "goal": "reported",
            "ok": True,
        })  # fmt: skip
    report("stalled", figures, facts)


if __name__ == "__main__":
    main()
