"""openpi's websocket through ``--front-doors 2`` (issue 43): each frame decoded in a front and
its step crossing the hop (this checkout) against the same node from another commit
(``--against REF``, e.g. the one whose fronts relayed every frame to the core's door), and
the single-process node (``--front-doors 1``, this checkout) as the reference.

The unmodified ``openpi-client``, LIBERO-shaped observations (two 224x224x3 cameras, an
8-dim state, a prompt). ``--model demo`` (the default) measures the door: the cheap demo
policy takes the state as its ``obs`` and ignores the cameras, which are still decoded and
carried every step; ``--model vla-demo`` takes them all (its run dominates the CPU). Every
node on its own Redis, one CPU device.
Within a round the servers take turns (same run, alternating): ``--steps`` steps of one
robot in lockstep, then ``--robots`` robots in lockstep at once for ``--seconds``. For each:
steps/s, the server CPU per step of every process of the node (the core and its fronts,
from /proc), and the core's alone. Figures: medians over ``--runs`` rounds of the ratios
of one round.

Usage: python -m bench.fronts_openpi [--against REF] [--model demo] [--runs 5] [--steps 300]
[--robots 4] [--seconds 4]
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

from openpi_client.websocket_client_policy import WebsocketClientPolicy

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
from tests.test_openpi import libero


def checkout(ref: str, into: Path) -> Path:
    """The files of commit ``ref`` of this repository, extracted under ``into``."""
    src = into / f"src-{ref}"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True,
                             capture_output=True).stdout  # fmt: skip
    path = into / "src.tar"
    path.write_bytes(archive)
    with tarfile.open(path) as tar:
        tar.extractall(src, filter="data")
    return src


def node_from(node: Node, src: Path) -> Node:
    """``node`` run from the files in ``src`` (its fronts too: they start from its folder)."""
    command = shlex.join(node.proc.argv)
    node.proc.argv = ["sh", "-c", f"cd {shlex.quote(str(src))} && exec {command}"]
    return node


def cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += cpu_seconds(pid)
    return total


def lockstep(url: str, obs: list[dict[str, Any]], pids: list[int]) -> tuple[float, float, float]:
    """(steps/s, server CPU µs per step, the core's alone) of one robot stepping ``obs``
    in lockstep."""
    policy = WebsocketClientPolicy(url)
    policy.infer(obs[0])
    c0, k0, t0 = cpu(pids), cpu(pids[:1]), time.perf_counter()
    for o in obs:
        policy.infer(o)
    seconds, used, core = time.perf_counter() - t0, cpu(pids) - c0, cpu(pids[:1]) - k0
    policy._ws.close()
    return len(obs) / seconds, used / len(obs) * 1e6, core / len(obs) * 1e6


def robots(
    url: str, episode: str, obs: list[dict[str, Any]], n: int, seconds: float, pids: list[int]
) -> tuple[float, float, float]:
    """(steps/s, server CPU µs per step, the core's alone) of ``n`` robots, each in
    lockstep, for ``seconds``."""
    policies = [WebsocketClientPolicy(f"{url}?episode_id={episode}-{k}") for k in range(n)]
    for p in policies:
        p.infer(obs[0])
    counts = [0] * n
    go = threading.Event()
    until = [0.0]

    def run(k: int) -> None:
        go.wait()
        i = 0
        while time.perf_counter() < until[0]:
            policies[k].infer(obs[i % len(obs)])
            i += 1
        counts[k] = i

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    c0, k0, t0 = cpu(pids), cpu(pids[:1]), time.perf_counter()
    until[0] = t0 + seconds
    go.set()
    for t in threads:
        t.join()
    elapsed, used, core = time.perf_counter() - t0, cpu(pids) - c0, cpu(pids[:1]) - k0
    for p in policies:
        p._ws.close()
    steps = max(sum(counts), 1)
    return steps / elapsed, used / steps * 1e6, core / steps * 1e6


def main() -> None:
    a = options(against="", model="demo", runs=5, steps=300, robots=4, seconds=4.0)
    tmp = tmpdir()
    extra = ["--model", a.model, "--max-batch", "1", "--lease-ttl", "30", "--capacity",
             "100", "--access-log", "off"]  # fmt: skip
    servers: dict[str, tuple[list[str], Path | None]] = {
        "one": ([], None),
        "decoded": (["--front-doors", "2"], None),
    }
    if a.against:
        servers["relay"] = (["--front-doors", "2"], checkout(a.against, tmp))
    redises = {name: RedisServer(tmp).start() for name in servers}
    nodes: dict[str, Node] = {}
    rounds: list[dict[str, float]] = []
    try:
        for name, (more, src) in servers.items():
            node = Node(tmp, name, redises[name].url, devices="cpu:1", extra=[*extra, *more])
            nodes[name] = node_from(node, src) if src is not None else node
            node.start(timeout=90)
            assert node.proc.popen is not None
            want = 3 if more else 1
            wait_until(lambda node=node, want=want: len(family(node.proc.popen.pid)) >= want,
                       30, "fronts")  # fmt: skip
        pids = {name: family(node.proc.popen.pid) for name, node in nodes.items()}  # type: ignore[union-attr]
        urls = {name: f"ws://{node.host}:{node.port}/" for name, node in nodes.items()}
        obs = libero(0, a.steps)
        if a.model == "demo":  # the state as the model's input; the cameras carried, ignored
            obs = [{**o, "obs": o["observation/state"].astype("float32")} for o in obs]
        for name, url in urls.items():  # warm: sessions, claims
            lockstep(url + "?episode_id=warm", obs[:10], pids[name])
        for r in range(a.runs):
            got: dict[str, float] = {}
            order = list(urls) if r % 2 == 0 else list(reversed(urls))
            for name in order:
                got[f"sps_1_{name}"], got[f"cpu_1_{name}"], got[f"core_1_{name}"] = lockstep(
                    urls[name] + f"?episode_id=one-{r}", obs, pids[name]
                )
            for name in order:
                got[f"sps_n_{name}"], got[f"cpu_n_{name}"], got[f"core_n_{name}"] = robots(
                    urls[name], f"many-{r}", obs, a.robots, a.seconds, pids[name]
                )
            rounds.append(got)
            print(f"round {r}: " + ", ".join(f"{k} {v:.1f}" for k, v in got.items()), flush=True)
    finally:
        for node in nodes.values():
            node.stop()
        for redis in redises.values():
            redis.stop()

    def ratio(top: str, bottom: str) -> float:
        return median([x[top] / x[bottom] for x in rounds])

    def med(key: str) -> float:
        return median([x[key] for x in rounds])

    names = list(servers)
    figures = []
    for load, what in (("1", "one robot in lockstep"), ("n", f"{a.robots} robots in lockstep")):
        figures.append({
            "figure": f"openpi {what}: steps/s, " + ", ".join(names),
            "result": ", ".join(f"{med(f'sps_{load}_{n}'):.1f}" for n in names),
            "goal": "reported",
            "ok": True,
        })  # fmt: skip
        figures.append({
            "figure": f"openpi {what}: server CPU per step (every process), " + ", ".join(names),
            "result": ", ".join(f"{med(f'cpu_{load}_{n}'):.0f} µs" for n in names),
            "goal": "reported",
            "ok": True,
        })  # fmt: skip
        figures.append({
            "figure": f"openpi {what}: the core's CPU per step (the node's process alone), "
            + ", ".join(names),
            "result": ", ".join(f"{med(f'core_{load}_{n}'):.0f} µs" for n in names),
            "goal": "reported",
            "ok": True,
        })  # fmt: skip
        if "relay" in servers:
            sps = ratio(f"sps_{load}_decoded", f"sps_{load}_relay")
            per = ratio(f"cpu_{load}_decoded", f"cpu_{load}_relay")
            figures.append({
                "figure": f"openpi {what}, 2 fronts decoding / 2 fronts relaying "
                f"({a.against}): steps/s, CPU per step",
                "result": f"{sps:.2f}x, {per:.2f}x",
                "goal": "reported",
                "ok": True,
            })  # fmt: skip
        sps = ratio(f"sps_{load}_decoded", f"sps_{load}_one")
        per = ratio(f"cpu_{load}_decoded", f"cpu_{load}_one")
        figures.append({
            "figure": f"openpi {what}, 2 fronts decoding / one process: steps/s, CPU per step",
            "result": f"{sps:.2f}x, {per:.2f}x",
            "goal": "reported",
            "ok": True,
        })  # fmt: skip
    report("fronts_openpi", figures, {"rounds": rounds, "against": a.against,
                                      "cores": os.cpu_count(), "load": os.getloadavg(),
                                      "python": sys.version.split()[0]})  # fmt: skip


if __name__ == "__main__":
    main()
