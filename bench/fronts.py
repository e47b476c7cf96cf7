"""``--front-doors`` (issue 43's first slice) under ``wrk -c16``: a node with 1 and with 2
fronts against the minimal app of ``bench/baseline_app.py`` with 1 and 2 uvicorn workers,
the four servers driven in turn in every round (same run, alternating).

Figures (medians over ``--runs`` rounds of ratios measured in the same round):
throughput of the node with N fronts / the minimal app with N workers (goal ≥ 0.9x at 2);
the node with 2 fronts / the node with 1 (goal ≥ 1.4x); p50 under that load, node 2 fronts
/ app 2 workers (goal ≤ 1.1x); p50 of one client in lockstep, node 2 fronts / node 1
(goal ≤ 1.05x); Redis commands per 1,000 steps and per second under that load, node 2
fronts against node 1 (reported: a hit sends none in either shape, so what each sends is
its lease's and its upkeep's, in bursts); server
CPU per request of every process of each server (from
/proc); every process' RSS, and the node's total at 2 fronts / at 1 (goal ≤ 1.5x), and
every process' PSS (shared pages counted once: what the host holds), its total as a ratio.

The load is bench/act.py's: JSON /act bodies cycling over 64 sticky episodes on one CPU
device of the demo policy (each a hit: its owner serves it from its own records, no Redis
command on the way; what it sends Redis meanwhile is its lease and upkeep). wrk runs one thread,
beside the servers on the same cores: say the machine's cores and load with the figures.

``--scale 1,2,4,8`` measures instead the issue's table: a node with each of those numbers
of fronts (each on its own Redis), all driven in turn in every round, their steps/s, its ratio
to the first, server CPU per request (and its split: the core, its fronts together, its
worker process), p50, and the RSS and PSS totals. A count with a ``w`` (``2w``)
is a node of that many fronts whose device runs in its own worker process
(``--device-workers process``): the whole multi-process shape, e.g. ``--scale 1,2,1w,2w``.

Usage: python -m bench.fronts [--runs 5] [--seconds 4] [--connections 16] [--scale 1,2,4,8]
(wrk: ``bash .ci/run --print-packages`` lists it; else ``apt-get install -y wrk``)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import redis

from bench.act import EXTRA, episodes_lua
from bench.common import (
    ROOT,
    Node,
    RedisServer,
    cpu_seconds,
    free_port,
    median,
    options,
    report,
    tmpdir,
    wait_until,
    wrk,
)

SERVERS = ("node1", "node2", "app1", "app2")


def family(pid: int) -> list[int]:
    """``pid`` and its descendants (a node's fork server and the fronts it forked, its device
    workers; uvicorn's workers), from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [pid], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def redis_commands(url: str) -> int:
    """Commands a Redis server has processed so far (``INFO stats``)."""
    client = redis.Redis.from_url(url)
    try:
        return int(client.info("stats")["total_commands_processed"])
    finally:
        client.close()


def pss_mib(pid: int) -> float:
    """``pid``'s proportional set size: its own pages, and each page it shares (the
    libraries' code, numpy's, Python's) divided among the processes mapping it. The RSS of
    every process added up counts each shared page once per process; the PSS added up is
    what the host's memory holds for them."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    return 0.0


def role(pid: int, top: int) -> str:
    """What a node's process is: ``core`` (``top``, the node's own), ``front`` (a front, or
    the fork server that forked them: the fronts' cost) or ``worker`` (a device's worker
    process), from its command line."""
    if pid == top:
        return "core"
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return "worker" if b"node.deviceproc" in argv else "front"


def cpu_by_role(pids: list[int], top: int, before: dict[int, float]) -> dict[str, float]:
    """CPU seconds each role's processes used since ``before`` (a process gone meanwhile
    counts nothing)."""
    used: dict[str, float] = {}
    for pid in pids:
        try:
            spent = cpu_seconds(pid) - before[pid]
            kind = role(pid, top)
        except OSError:
            continue
        used[kind] = used.get(kind, 0.0) + spent
    return used


def app(workers: int) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    argv = [sys.executable, "-m", "bench.baseline_app", str(port), str(workers)]
    proc = subprocess.Popen(argv, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(url + "/readyz").status_code == 200
        except httpx.TransportError:
            return False

    wait_until(ready, 60, f"minimal app, {workers} worker(s)")
    if workers > 1:
        wait_until(lambda: len(family(proc.pid)) > workers, 60, "its workers")
    return proc, url


def scale_table(a: argparse.Namespace, counts: list[str]) -> None:
    """Steps/s of a node with each of ``counts`` fronts (1: one process; ``2w``: 2 fronts
    and a device worker process), alternating."""
    tmp = tmpdir()
    redises = [RedisServer(tmp).start() for _ in counts]  # a fleet each: no forwards
    extra = ["--capacity", "1000", "--lease-ttl", "30", "--access-log", "off", *EXTRA]

    def shape(n: str) -> list[str]:
        fronts = ["--front-doors", n.removesuffix("w")]
        return [*fronts, "--device-workers", "process"] if n.endswith("w") else fronts

    nodes = {
        n: Node(tmp, f"s{n}", redis.url, devices="cpu:1", extra=[*extra, *shape(n)])
        for n, redis in zip(counts, redises, strict=True)
    }  # fmt: skip
    rounds: list[dict[str, tuple[float, float, float, dict[str, float]]]] = []
    rss: dict[str, list[float]] = {}
    pss: dict[str, list[float]] = {}
    try:
        for n, node in nodes.items():
            node.start(timeout=60)
            assert node.proc.popen is not None
            fronts = int(n.removesuffix("w"))
            procs = 1 + (fronts + 1 if fronts > 1 else 0) + n.endswith("w")  # (fork server)
            wait_until(lambda node=node, k=procs: len(family(node.proc.popen.pid)) >= k, 30,
                       "fronts")  # fmt: skip
        load = episodes_lua(64)
        for node in nodes.values():  # warm (sessions, connections, claims)
            wrk(node.url, load, duration_s=1, connections=a.connections)
        for _ in range(a.runs):
            got = {}
            for n, node in nodes.items():
                assert node.proc.popen is not None
                top = node.proc.popen.pid
                pids = family(top)
                before = {p: cpu_seconds(p) for p in pids}
                run = wrk(node.url, load, duration_s=a.seconds, connections=a.connections,
                          server_pids=pids)  # fmt: skip
                steps = max(1, run.requests)
                by_role = {k: v / steps * 1e6 for k, v in cpu_by_role(pids, top, before).items()}
                got[n] = (run.rps, run.cpu_per_request * 1e6, run.p50, by_role)
            rounds.append(got)
        for n, node in nodes.items():
            assert node.proc.popen is not None
            rss[n] = [round(rss_mib(p), 1) for p in family(node.proc.popen.pid)]
            pss[n] = [round(pss_mib(p), 1) for p in family(node.proc.popen.pid)]
    finally:
        for node in nodes.values():
            node.stop()
        for redis in redises:
            redis.stop()
    base = counts[0]
    figures = []
    for n in counts:
        speed = median([r[n][0] / r[base][0] for r in rounds])
        workers = ", its device in a worker process" if n.endswith("w") else ""
        roles = sorted({k for r in rounds for k in r[n][3]}, key=("core", "front", "worker").index)
        split = ", ".join(f"{k} {median([r[n][3].get(k, 0.0) for r in rounds]):.0f}"
                          for k in roles)  # fmt: skip
        figures.append({
            "figure": f"node with {n.removesuffix('w')} front(s){workers}, wrk "
            f"-c{a.connections}: steps/s; ratio to {base}; server CPU per request (µs: all, "
            "then by role, its fronts or workers together); p50; RSS total; PSS total (MiB)",
            "result": f"{median([r[n][0] for r in rounds]):.0f} steps/s; {speed:.2f}x; "
            f"{median([r[n][1] for r in rounds]):.0f} ({split}); "
            f"{median([r[n][2] for r in rounds]) * 1e3:.2f} ms; {sum(rss[n]):.0f}; "
            f"{sum(pss[n]):.0f}",
            "goal": "reported",
            "ok": True,
        })  # fmt: skip
    report("fronts_scale", figures, {"rounds": [{str(k): v for k, v in r.items()} for r in rounds],
                                     "rss_mib": {str(k): v for k, v in rss.items()},
                                     "pss_mib": {str(k): v for k, v in pss.items()},
                                     "cores": os.cpu_count(), "load": os.getloadavg()})  # fmt: skip


def main() -> None:
    a = options(runs=5, seconds=4.0, connections=16,
                scale=("", "e.g. 1,2,4,8 (2w: with a device worker process): the table "
                        "of steps/s by shape instead"))  # fmt: skip
    if a.scale:
        scale_table(a, a.scale.split(","))
        return
    tmp = tmpdir()
    redises = [RedisServer(tmp).start() for _ in range(2)]  # two fleets: no forwards between
    extra = ["--capacity", "1000", "--lease-ttl", "30", "--access-log", "off", *EXTRA]
    nodes = {
        1: Node(tmp, "one", redises[0].url, devices="cpu:1", extra=extra),
        2: Node(tmp, "two", redises[1].url, devices="cpu:1", extra=[*extra, "--front-doors", "2"]),
    }
    apps: dict[int, tuple[subprocess.Popen[bytes], str]] = {}
    rounds: list[dict[str, float]] = []
    rss: dict[str, list[float]] = {}
    pss: dict[str, list[float]] = {}
    try:
        for n, node in nodes.items():
            node.start(timeout=60)
            assert node.proc.popen is not None
            procs = n + 2 if n > 1 else 1  # the core, its fork server, n fronts
            wait_until(lambda node=node, k=procs: len(family(node.proc.popen.pid)) >= k, 30,
                       "fronts")  # fmt: skip
            apps[n] = app(n)
        urls = {f"node{n}": node.url for n, node in nodes.items()}
        urls.update({f"app{n}": url for n, (_, url) in apps.items()})
        pids = {f"node{n}": node.proc.popen.pid for n, node in nodes.items()}  # type: ignore[union-attr]
        pids.update({f"app{n}": proc.pid for n, (proc, _) in apps.items()})
        load = episodes_lua(64)
        for url in urls.values():  # warm (sessions, connections, claims)
            wrk(url, load, duration_s=1, connections=a.connections)
        sent = {"node1": [0.0, 0.0, 0.0], "node2": [0.0, 0.0, 0.0]}  # commands, seconds, steps
        for _ in range(a.runs):
            got: dict[str, float] = {}
            for name in ("app1", "node1", "app2", "node2"):
                k = int(name[-1]) - 1
                store = redises[k].url if name.startswith("node") else None
                before_commands = redis_commands(store) if store else 0
                began = time.monotonic()
                run = wrk(urls[name], load, duration_s=a.seconds, connections=a.connections,
                          server_pids=family(pids[name]))  # fmt: skip
                if store:  # each node on a Redis of its own: every command there is its own
                    tally = sent[name]
                    tally[0] += redis_commands(store) - before_commands
                    tally[1] += time.monotonic() - began
                    tally[2] += run.requests
                got[f"rps_{name}"] = run.rps
                got[f"p50_{name}"] = run.p50
                got[f"cpu_{name}"] = run.cpu_per_request * 1e6
            for name in ("node1", "node2"):  # one client in lockstep: a robot's latency
                procs = family(pids[name])
                before = {p: cpu_seconds(p) for p in procs}
                run = wrk(urls[name], load, duration_s=a.seconds / 2, connections=1)
                got[f"p50_1_{name}"] = run.p50
                for kind, spent in cpu_by_role(procs, pids[name], before).items():
                    got[f"cpu_1_{name}_{kind}"] = spent / max(1, run.requests) * 1e6
            rounds.append(got)
        for name, pid in pids.items():
            rss[name] = [round(rss_mib(p), 1) for p in family(pid)]
            pss[name] = [round(pss_mib(p), 1) for p in family(pid)]
    finally:
        for node in nodes.values():
            node.stop()
        for proc, _ in apps.values():
            for pid in reversed(family(proc.pid)):  # uvicorn's workers outlive a killed master
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
        for redis in redises:
            redis.stop()

    def ratio(top: str, bottom: str) -> float:
        return median([r[top] / r[bottom] for r in rounds])

    per_step = [sent[n][0] / max(1, sent[n][2]) * 1000 for n in ("node1", "node2")]
    per_second = [sent[n][0] / max(1e-9, sent[n][1]) for n in ("node1", "node2")]

    def med(key: str) -> float:
        return median([r[key] for r in rounds])

    t1 = ratio("rps_node1", "rps_app1")
    t2 = ratio("rps_node2", "rps_app2")
    scale = ratio("rps_node2", "rps_node1")
    p50 = ratio("p50_node2", "p50_app2")
    memory = sum(rss["node2"]) / sum(rss["node1"])
    lockstep = ratio("p50_1_node2", "p50_1_node1")
    figures = [
        {
            "figure": f"/act throughput, wrk -c{a.connections}, node 1 front / minimal app "
            "1 worker",
            "result": f"{t1:.2f}x ({med('rps_node1'):.0f} vs {med('rps_app1'):.0f} req/s)",
            "goal": "reported",
            "ok": True,
        },
        {
            "figure": "node 2 fronts / minimal app 2 workers",
            "result": f"{t2:.2f}x ({med('rps_node2'):.0f} vs {med('rps_app2'):.0f} req/s)",
            "goal": ">= 0.9x",
            "ok": t2 >= 0.9,
        },
        {
            "figure": "node 2 fronts / node 1 front",
            "result": f"{scale:.2f}x",
            "goal": ">= 1.4x",
            "ok": scale >= 1.4,
        },
        {
            "figure": "p50 under that load, node 2 fronts / minimal app 2 workers",
            "result": f"{p50:.2f}x ({med('p50_node2') * 1e3:.2f} ms vs "
            f"{med('p50_app2') * 1e3:.2f} ms)",
            "goal": "<= 1.1x",
            "ok": p50 <= 1.1,
        },
        {
            "figure": "p50 of one client in lockstep, node 2 fronts / node 1",
            "result": f"{lockstep:.2f}x ({med('p50_1_node2') * 1e3:.2f} ms vs "
            f"{med('p50_1_node1') * 1e3:.2f} ms)",
            "goal": "<= 1.05x",
            "ok": lockstep <= 1.05,
        },
        {
            "figure": "CPU per step in lockstep by process (µs): node 1's one process; node 2's "
            "core, its fronts together",
            "result": f"{med('cpu_1_node1_core'):.0f}; {med('cpu_1_node2_core'):.0f}, "
            f"{med('cpu_1_node2_front'):.0f}",
            "goal": "reported",
            "ok": True,
        },
        {
            "figure": "Redis commands per 1,000 steps under that load, everything each node sent "
            "during the runs (each on its own Redis), node 2 fronts vs node 1, and per "
            "second: a hit sends none, so these are the lease's renewals and the node's "
            "upkeep, which come in bursts every 10 s (--lease-ttl 30): a few seconds of "
            "load catch one or not",
            "result": f"{per_step[1]:.2f} vs {per_step[0]:.2f} ({per_second[1]:.1f} vs "
            f"{per_second[0]:.1f} a second)",
            "goal": "reported",
            "ok": True,
        },
        {
            "figure": "server CPU per request (every process): node 1, node 2, app 1, app 2",
            "result": ", ".join(f"{med('cpu_' + n):.0f} µs" for n in SERVERS),
            "goal": "reported",
            "ok": True,
        },
        {
            "figure": "RSS of every process (MiB; the node's process or the app's master "
            "first), node 2 fronts total / node 1",
            "result": f"{memory:.2f}x; "
            + "; ".join(f"{n}: {'+'.join(map(str, v))}" for n, v in rss.items()),
            "goal": "<= 1.5x",
            "ok": memory <= 1.5,
        },
        {
            "figure": "PSS of every process (MiB: shared pages divided among the processes "
            "that map them, so the total is what the host holds), node 2 fronts total / node 1",
            "result": f"{sum(pss['node2']) / sum(pss['node1']):.2f}x; "
            + "; ".join(f"{n}: {'+'.join(map(str, v))}" for n, v in pss.items()),
            "goal": "reported",
            "ok": True,
        },
    ]
    report("fronts", figures, {"rounds": rounds, "rss_mib": rss, "pss_mib": pss,
                               "cores": os.cpu_count(),
                               "load": os.getloadavg()})  # fmt: skip


if __name__ == "__main__":
    main()
