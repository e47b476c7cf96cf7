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

``--rows K`` adds a phase to each round: ``--procs`` processes each sending messages of K
rows (``episode_ids``, FP64 inputs the model takes as FP32) in a closed loop; the core's
CPU per row and rows/s.

Usage: python -m bench.fronts_kserve [--runs 5] [--seconds 4] [--procs 2] [--before REV]
[--rows K]
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson

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


def _rows_process(url: str, k: int, first: int, start_at: float, seconds: float,
                  out: Any) -> None:  # fmt: skip
    """A client process: messages of ``k`` rows (``episode_ids`` from ``first``), each
    message's next when its last is answered, the first starting the rows' sequences; the
    rows served (a row's error counted as not served)."""
    import httpx
    import tritonclient.http as th

    rng = np.random.default_rng(first)
    ids = orjson.dumps([f"b{first + i}" for i in range(k)]).decode()

    def body(start: bool) -> tuple[bytes, dict[str, str]]:
        given = th.InferInput("obs", [k, 8], "FP64")  # (converted to the model's FP32)
        given.set_data_from_numpy(rng.standard_normal((k, 8)), binary_data=True)
        params = {"episode_ids": ids, "sequence_starts": orjson.dumps([start] * k).decode()}
        raw, size = th.InferenceServerClient.generate_request_body([given], parameters=params)
        return raw, {"Inference-Header-Content-Length": str(size)}

    served = 0
    with httpx.Client(base_url=url, timeout=60) as client:
        client.post(f"/v2/models/{MODEL}/infer", content=body(True)[0], headers=body(True)[1])
        raw, headers = body(False)
        time.sleep(max(0.0, start_at - time.time()))
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            r = client.post(f"/v2/models/{MODEL}/infer", content=raw, headers=headers)
            if r.status_code == 200:
                size = int(r.headers.get("inference-header-content-length", len(r.content)))
                facts = orjson.loads(orjson.loads(r.content[:size])["parameters"]["rows"])
                served += sum("error" not in f for f in facts)
    out.put(served)


def rows_load(url: str, k: int, first: int, seconds: float, procs: int) -> float:
    """Rows served per second by ``procs`` processes sending messages of ``k`` rows."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + 3.0  # the processes import tritonclient first
    workers = [ctx.Process(target=_rows_process,
                           args=(url, k, first + i * k, start_at, seconds, out))
               for i in range(procs)]  # fmt: skip
    for w in workers:
        w.start()
    served = sum(out.get(timeout=seconds + 120) for _ in workers)
    for w in workers:
        w.join()
    return served / seconds


def start(node: Node, cwd: Path, fronts: int) -> None:
    """Start ``node`` from the source in ``cwd`` (its fork server inherits it:
    ``-m node.forkserver`` resolves there), and wait for its fronts."""
    out = open(node.proc.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
    node.proc.popen = subprocess.Popen(node.proc.argv, env=node.proc.env, stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True,
                                       cwd=cwd)  # fmt: skip
    out.close()
    wait_until(node.ready, 60, f"node {node.node_id} ready")
    pid = node.proc.popen.pid
    wait_until(lambda: len(family(pid)) > fronts if fronts > 1 else True, 30, "its fronts")


def main() -> None:
    a = options(
        runs=5,
        seconds=4.0,
        procs=2,
        before=("cd8415e", "the revision before"),
        rows=(0, "also messages of this many rows (episode_ids), each a round"),
    )
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
                if a.rows:  # a simulation farm's messages: the core's CPU per row
                    url = f"http://{hosts[name]}"
                    core = cpu_seconds(pids[name])
                    rate = rows_load(url, a.rows, sequence, a.seconds, a.procs)
                    core = cpu_seconds(pids[name]) - core
                    sequence += a.rows * a.procs
                    got[f"rowsps_{name}"] = rate
                    got[f"rowcore_{name}"] = core / max(rate * a.seconds, 1) * 1e6
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
        *(
            [
                {
                    "figure": f"messages of {a.rows} rows: the core's CPU per row, 2 fronts: "
                    f"this checkout / {a.before}",
                    "result": f"{ratio('rowcore_after', 'rowcore_before'):.2f}x "
                    f"({med('rowcore_after'):.0f} vs {med('rowcore_before'):.0f} µs; one "
                    f"process {med('rowcore_one'):.0f} µs); rows/s "
                    f"{ratio('rowsps_after', 'rowsps_before'):.2f}x "
                    f"({med('rowsps_after'):.0f} vs {med('rowsps_before'):.0f}; one process "
                    f"{med('rowsps_one'):.0f})",
                    "goal": "< 1x",
                    "ok": ratio("rowcore_after", "rowcore_before") < 1,
                }
            ]
            if a.rows
            else []
        ),
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
