"""KServe v2 HTTP infer through ``--front-doors 2`` (issue 43): this checkout against
``--before``, a revision of this repository (its source is unpacked with ``git archive``
and its node run from there), and a node of one process (this checkout) for scale; the
three driven in turn in every round (same run, the order rotating). With the default
``--before`` (cd8415e) that is the request decoded in the fronts against passed on to the
core as bytes; with ``--before 33fea8a``, its inputs checked in the fronts
(``node/checks.py``) against checked in the core.

The load is ``bench/triton.py``'s: the unmodified ``tritonclient.http`` (binary tensors,
every output), 16 sequences in lockstep each from ``--procs`` client processes, for
``--seconds``, on the ``demo`` policy on one CPU device, Redis beside. Figures: the core's
CPU per step (its process alone: what bounds a node of many fronts), steps/s and server
CPU per step (every process of the node: the core and its fronts, from ``/proc``), each
the median over ``--runs`` rounds of the ratio measured in the same round. The clients run
beside the servers on the same cores: say the machine's cores and load with the figures.

Usage: python -m bench.fronts_kserve [--runs 5] [--seconds 4] [--procs 2] [--before REV]
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from bench.common import (
    ROOT,
    Node,
    RedisServer,
    cpu_seconds,
    median,
    options,
    report,
    tmpdir,
    wait_until,
)
from bench.fronts import family
from bench.triton import load

MODEL = "demo_policy"
SERVERS = ("one", "before", "after")


def unpacked(revision: str, where: Path) -> Path:
    """The source of ``revision`` of this repository, unpacked under ``where``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision], check=True,
                             capture_output=True).stdout  # fmt: skip
    tree = where / f"src-{revision[:12]}"
    tree.mkdir()
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def start(node: Node, cwd: Path, fronts: int) -> None:
    """Start ``node`` from the source in ``cwd`` (its fronts inherit it: ``-m node.front``
    resolves there), and wait for its fronts."""
    out = open(node.proc.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
    node.proc.popen = subprocess.Popen(node.proc.argv, env=node.proc.env, stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True,
                                       cwd=cwd)  # fmt: skip
    out.close()
    wait_until(node.ready, 60, f"node {node.node_id} ready")
    pid = node.proc.popen.pid
    wait_until(lambda: len(family(pid)) > fronts if fronts > 1 else True, 30, "its fronts")


def main() -> None:
    a = options(runs=5, seconds=4.0, procs=2, before=("cd8415e", "the revision before"))
    tmp = tmpdir()
    before = unpacked(a.before, tmp)
    redises = [RedisServer(tmp).start() for _ in SERVERS]  # one fleet each: no forwards
    extra = ["--capacity", "1000", "--lease-ttl", "30", "--access-log", "off"]
    two = [*extra, "--front-doors", "2"]
    nodes = {
        "one": (Node(tmp, "one", redises[0].url, devices="cpu:1", extra=extra), ROOT, 1),
        "before": (Node(tmp, "before", redises[1].url, devices="cpu:1", extra=two), before, 2),
        "after": (Node(tmp, "after", redises[2].url, devices="cpu:1", extra=two), ROOT, 2),
    }
    rounds: list[dict[str, float]] = []
    try:
        for node, cwd, fronts in nodes.values():
            start(node, cwd, fronts)
        hosts = {name: f"{n.host}:{n.port}" for name, (n, _, _) in nodes.items()}
        pids = {name: n.proc.popen.pid for name, (n, _, _) in nodes.items()}  # type: ignore[union-attr]
        sequence = 1
        for name in SERVERS:  # warm (sessions, connections, claims)
            load(hosts[name], MODEL, sequence, 1.0, a.procs, family(pids[name]))
            sequence += 100
        for k in range(a.runs):
            got: dict[str, float] = {}
            order = SERVERS[k % 3 :] + SERVERS[: k % 3]
            for name in order:
                core = cpu_seconds(pids[name])
                rate, cpu, _ = load(hosts[name], MODEL, sequence, a.seconds, a.procs,
                                    family(pids[name]))  # fmt: skip
                core = cpu_seconds(pids[name]) - core  # (the clients' start, idle, with it)
                sequence += 100
                got[f"rps_{name}"], got[f"cpu_{name}"] = rate, cpu * 1e6
                got[f"core_{name}"] = core / max(rate * a.seconds, 1) * 1e6
            rounds.append(got)
            print(f"round {k + 1}: " + ", ".join(f"{key} {v:.0f}" for key, v in got.items()))
    finally:
        for node, _, _ in nodes.values():
            node.stop()
        for redis in redises:
            redis.stop()

    def ratio(top: str, bottom: str) -> float:
        return median([r[top] / r[bottom] for r in rounds])

    def med(key: str) -> float:
        return median([r[key] for r in rounds])

    rps = ratio("rps_after", "rps_before")
    cpu = ratio("cpu_after", "cpu_before")
    core = ratio("core_after", "core_before")
    figures = [
        {
            "figure": f"the core's CPU per step, 2 fronts: this checkout / {a.before}",
            "result": f"{core:.2f}x ({med('core_after'):.0f} vs {med('core_before'):.0f} µs; "
            f"one process {med('core_one'):.0f} µs)",
            "goal": "< 1x",
            "ok": core < 1,
        },
        {
            "figure": f"tritonclient HTTP steps/s, 2 fronts: this checkout / {a.before}",
            "result": f"{rps:.2f}x ({med('rps_after'):.0f} vs {med('rps_before'):.0f} "
            f"steps/s; one process {med('rps_one'):.0f})",
            "goal": "> 1x",
            "ok": rps > 1,
        },
        {
            "figure": f"server CPU per step (every process), 2 fronts: this checkout / {a.before}",
            "result": f"{cpu:.2f}x ({med('cpu_after'):.0f} vs {med('cpu_before'):.0f} µs; "
            f"one process {med('cpu_one'):.0f} µs)",
            "goal": "<= 1x",
            "ok": cpu <= 1,
        },
        {
            "figure": "steps/s, 2 fronts (this checkout) / one process",
            "result": f"{ratio('rps_after', 'rps_one'):.2f}x",
            "goal": "reported",
            "ok": True,
        },
    ]
    report("fronts_kserve", figures, {"rounds": rounds, "cores": os.cpu_count(),
                                      "load": os.getloadavg(), "before": a.before,
                                      "python": sys.version.split()[0]})  # fmt: skip


if __name__ == "__main__":
    main()
