"""KServe v2 over gRPC through ``--front-doors 2`` (issue 43): decoded in the fronts and
carried over the hop (this checkout) against served by the core alone (``--before``, a
revision from before that, unpacked with ``git archive`` and run from there: its fronts
take HTTP only), and a node of one process (this checkout); the three driven in turn in
every round (same run, the order rotating).

The load: the unmodified ``tritonclient.grpc`` (raw tensors), 16 sequences in lockstep
each from ``--procs`` client processes (a thread and a channel per sequence), for
``--seconds``, on the ``demo`` policy on one CPU device, Redis beside. Figures: steps/s
and server CPU per step (every process of the node: the core and its fronts, from
``/proc``), each the median over ``--runs`` rounds of the ratio measured in the same round.
The clients run beside the servers on the same cores: say the machine's cores and load
with the figures.

Usage: python -m bench.fronts_grpc [--runs 5] [--seconds 4] [--procs 2] [--before REV]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from typing import Any

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
)
from bench.fronts import family
from bench.fronts_kserve import start, unpacked
from bench.triton import SEQUENCES, observations

MODEL = "demo_policy"
SERVERS = ("one", "before", "after")


def accepts(port: int) -> bool:
    """Whether something accepts on ``127.0.0.1:port``."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def _sequence(address: str, sequence: int, until: float) -> int:
    """Step one sequence in lockstep until ``until`` (monotonic), then END it; the steps
    before the END."""
    import tritonclient.grpc as tg

    client = tg.InferenceServerClient(address)
    inputs = [tg.InferInput(name, list(a.shape), datatype).set_data_from_numpy(a)
              for name, datatype, a in observations(MODEL, sequence)]  # fmt: skip
    steps = 0
    try:
        while time.monotonic() < until:
            client.infer(MODEL, inputs, sequence_id=sequence, sequence_start=steps == 0)
            steps += 1
        client.infer(MODEL, inputs, sequence_id=sequence, sequence_end=True)
    finally:
        client.close()
    return steps


def _process(address: str, sequences: list[int], start_at: float, seconds: float,
             out: Any) -> None:  # fmt: skip
    """A client process: one thread per sequence, all starting at ``start_at`` (wall time)."""
    import tritonclient.grpc  # noqa: F401 - imported before the start, not timed

    counts: list[int] = []
    time.sleep(max(0.0, start_at - time.time()))
    until = time.monotonic() + seconds
    threads = [threading.Thread(target=lambda s=s: counts.append(_sequence(address, s, until)))
               for s in sequences]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(sum(counts))


def load(address: str, first: int, seconds: float, procs: int,
         pids: list[int]) -> tuple[float, float, float]:  # fmt: skip
    """Steps/s of :data:`SEQUENCES` sequences from ``procs`` processes, the CPU of
    ``pids`` per step and that of the first of them (the core) per step (seconds)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ids = list(range(first, first + SEQUENCES))
    start_at = time.time() + 3.0  # the processes import tritonclient first
    workers = [ctx.Process(target=_process, args=(address, ids[i::procs], start_at, seconds, out))
               for i in range(procs)]  # fmt: skip
    for w in workers:
        w.start()
    time.sleep(max(0.0, start_at - time.time()))
    before = [cpu_seconds(p) for p in pids]
    steps = sum(out.get(timeout=seconds + 120) for _ in workers)
    used = [cpu_seconds(p) - b for p, b in zip(pids, before, strict=True)]
    for w in workers:
        w.join()
    return steps / seconds, sum(used) / max(steps, 1), used[0] / max(steps, 1)


def main() -> None:
    a = options(runs=5, seconds=4.0, procs=2, before=("791d7ce", "the revision before"))
    tmp = tmpdir()
    before = unpacked(a.before, tmp)
    redises = [RedisServer(tmp).start() for _ in SERVERS]  # one fleet each: no forwards
    ports = {name: free_port() for name in SERVERS}
    extra = ["--capacity", "1000", "--lease-ttl", "30", "--access-log", "off"]
    two = [*extra, "--front-doors", "2"]

    def node(name: str, k: int, more: list[str]) -> Node:
        return Node(tmp, name, redises[k].url, devices="cpu:1",
                    extra=[*more, "--grpc-port", str(ports[name])])  # fmt: skip

    nodes = {
        "one": (node("one", 0, extra), ROOT, 1),
        "before": (node("before", 1, two), before, 2),
        "after": (node("after", 2, two), ROOT, 2),
    }
    rounds: list[dict[str, float]] = []
    try:
        for n, cwd, fronts in nodes.values():
            start(n, cwd, fronts)
        for name in SERVERS:  # the fronts bind the gRPC port once started
            wait_until(lambda name=name: accepts(ports[name]), 30, f"gRPC of {name}")
        hosts = {name: f"127.0.0.1:{ports[name]}" for name in SERVERS}
        pids = {name: n.proc.popen.pid for name, (n, _, _) in nodes.items()}  # type: ignore[union-attr]
        sequence = 1
        for name in SERVERS:  # warm (sessions, channels, claims)
            load(hosts[name], sequence, 1.0, a.procs, family(pids[name]))
            sequence += 100
        for k in range(a.runs):
            got: dict[str, float] = {}
            for name in SERVERS[k % 3 :] + SERVERS[: k % 3]:
                rate, cpu, core = load(hosts[name], sequence, a.seconds, a.procs,
                                       family(pids[name]))  # fmt: skip
                sequence += 100
                got[f"rps_{name}"], got[f"cpu_{name}"] = rate, cpu * 1e6
                got[f"core_{name}"] = core * 1e6
            rounds.append(got)
            print(f"round {k + 1}: " + ", ".join(f"{key} {v:.0f}" for key, v in got.items()))
    finally:
        for n, _, _ in nodes.values():
            n.stop()
        for redis in redises:
            redis.stop()

    def ratio(top: str, bottom: str) -> float:
        return median([r[top] / r[bottom] for r in rounds])

    def med(key: str) -> float:
        return median([r[key] for r in rounds])

    figures = [
        {
            "figure": "tritonclient.grpc steps/s, 2 fronts decoding gRPC / one process",
            "result": f"{ratio('rps_after', 'rps_one'):.2f}x ({med('rps_after'):.0f} vs "
            f"{med('rps_one'):.0f} steps/s)",
            "goal": "reported",
            "ok": True,
        },
        {
            "figure": "server CPU per step (every process), 2 fronts decoding / one process",
            "result": f"{ratio('cpu_after', 'cpu_one'):.2f}x ({med('cpu_after'):.0f} vs "
            f"{med('cpu_one'):.0f} µs)",
            "goal": "reported",
            "ok": True,
        },
        {
            "figure": "steps/s and CPU per step, 2 fronts: gRPC decoded in the fronts / "
            "served by the core alone",
            "result": f"{ratio('rps_after', 'rps_before'):.2f}x steps/s "
            f"(before {med('rps_before'):.0f}), {ratio('cpu_after', 'cpu_before'):.2f}x CPU "
            f"(before {med('cpu_before'):.0f} µs)",
            "goal": "reported",
            "ok": True,
        },
        {
            "figure": "the core's own CPU per step, 2 fronts decoding / served by the core "
            "alone / one process",
            "result": f"{med('core_after'):.0f} / {med('core_before'):.0f} / "
            f"{med('core_one'):.0f} µs ({ratio('core_after', 'core_before'):.2f}x the core "
            "alone)",
            "goal": "< 1x the core alone",
            "ok": ratio("core_after", "core_before") < 1,
        },
    ]
    report("fronts_grpc", figures, {"rounds": rounds, "cores": os.cpu_count(),
                                    "load": os.getloadavg(), "before": a.before,
                                    "python": sys.version.split()[0]})  # fmt: skip


if __name__ == "__main__":
    main()
