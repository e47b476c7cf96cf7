"""Live hand-over under load: a drain that moves every episode of a node, and a rolling
restart of every node of a 3-node fleet, while 64 robots step at 20 Hz (issue 35).

Real redis-server, real nodes (the demo policy, ``--max-batch 1`` so that a step's output
does not depend on which steps shared its run, and can be compared exactly), robots driven
from several processes (msgpack ``/act`` with ``seq``, through random nodes, paced at the
control rate; on a small machine they share its cores with the nodes, which is why each
phase is measured against the same run's steady state before it):

- resets said, failed steps, steps applied twice (a ``seq`` the owner applied twice shows
  in the outputs), and every reply equal (``np.array_equal``) to the episode replayed on
  one CPU session without ever moving;
- the time between two replies of an episode (p50, p99, max) and how late a step was
  beyond its control period (p99), in the phase and before it;
- records moved, bytes per record, the move's time (the node's ``affinity_move_seconds``)
  against a step's time.

Usage: python -m bench.handover [--episodes 64] [--hz 20] [--seconds 4] [--procs 4]
"""

from __future__ import annotations

import collections
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from affinity import Keys, wire
from bench.common import ROOT, Node, RedisServer, options, pct, report, tmpdir, wait_until
from node.models import DEMO_MODEL
from tests.rollout import reference_rollout

KEYS = Keys()
MSGPACK = {"content-type": "application/msgpack", "accept": "application/msgpack"}


def robots(service: str, episodes: list[str], hz: float, stop: Any, seed: int, out: Any) -> None:
    """One process's robots: each steps its episode at ``hz`` through random nodes (the
    URLs in the file ``service``: the fleet as a load balancer sees it) until ``stop`` is set,
    retrying a failed step (same seq, same observation) on another node."""
    import asyncio

    urls = Path(service).read_text().split()
    seen = os.stat(service).st_mtime_ns

    def fleet_now() -> list[str]:
        """The load balancer's current backends (re-read when the file changed)."""
        nonlocal urls, seen
        mtime = os.stat(service).st_mtime_ns
        if mtime != seen:
            seen, urls = mtime, Path(service).read_text().split() or urls
        return urls

    async def one(client: httpx.AsyncClient, episode: str, rng: random.Random) -> dict[str, Any]:
        period = 1.0 / hz
        obs_rng = np.random.default_rng(rng.randrange(2**32))
        tick = time.monotonic() + rng.random() * period
        seq, log = 0, {"obs": [], "replies": [], "failed": [], "late": []}
        deadline = time.monotonic() + 600  # bounded, should the bench never stop them
        while not stop.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(max(0.0, tick - time.monotonic()))
            sent = time.monotonic()
            late = max(0.0, sent - tick)
            tick += period
            x = obs_rng.standard_normal((1, 8)).astype(np.float32)
            body = wire.encode({"episode_id": episode, "inputs": {"obs": x}, "seq": seq + 1})
            for _ in range(200):  # bounded: a robot retries the step until it is served
                try:
                    url = rng.choice(fleet_now())
                    r = await client.post(url + "/act", content=body, headers=MSGPACK)
                except httpx.HTTPError as exc:
                    log["failed"].append((time.monotonic(), type(exc).__name__))
                    await asyncio.sleep(0.01)
                    continue
                if r.status_code == 200:
                    break
                log["failed"].append((time.monotonic(), f"{r.status_code} {r.text[:240]}"))
                await asyncio.sleep(0.01)
            else:
                raise AssertionError(f"{episode}: step never served")
            reply = wire.decode(r.content)
            seq = int(reply["seq"])
            log["obs"].append(x)
            log["replies"].append(
                (sent, time.monotonic(), reply["outputs"]["actions"], reply["state_reset"],
                 reply["node"], reply["replayed"])
            )  # fmt: skip
            log["late"].append(late)
        return {episode: log}

    async def main() -> dict[str, Any]:
        rng = random.Random(seed)
        limits = httpx.Limits(max_connections=len(episodes) * 2)
        async with httpx.AsyncClient(timeout=10, limits=limits) as client:
            logs = await asyncio.gather(*(one(client, ep, rng) for ep in episodes))
        merged: dict[str, Any] = {}
        for part in logs:
            merged.update(part)
        return merged

    out.put(asyncio.run(main()))


def publish(service: Path, urls: list[str]) -> None:
    """The load balancer's addresses, replaced at once (robots never read half a file)."""
    staged = service.with_suffix(".new")
    staged.write_text(" ".join(urls))
    os.replace(staged, service)


def drive(service: Path, episodes: list[str], hz: float, procs: int) -> Any:
    """Start the robots (``procs`` processes); returns ``stop``, which stops them and
    returns their logs."""
    ctx = mp.get_context("spawn")
    queue, halt = ctx.Queue(), ctx.Event()
    parts = [episodes[i::procs] for i in range(procs)]
    workers = [
        ctx.Process(target=robots, args=(str(service), part, hz, halt, i, queue))
        for i, part in enumerate(parts)
    ]
    for w in workers:
        w.start()

    def stop() -> dict[str, Any]:
        halt.set()
        logs: dict[str, Any] = {}
        for _ in workers:
            logs.update(queue.get(timeout=120))
        for w in workers:
            w.join(30)
        return logs

    return stop


def judge(logs: dict[str, Any], phase: tuple[float, float], period: float) -> dict[str, Any]:
    """Figures of the replies received within ``phase`` (monotonic start, end), and the
    exactness of every episode's whole run."""
    gaps, lates, steps, resets, replays, mismatched, moved_eps = [], [], [], 0, 0, 0, 0
    failures = [
        why for log in logs.values() for t, why in log["failed"] if phase[0] <= t < phase[1]
    ]
    for log in logs.values():
        replies = log["replies"]
        want = reference_rollout(DEMO_MODEL, log["obs"])
        for reply, ref in zip(replies, want, strict=True):
            if not np.array_equal(np.asarray(reply[2]), ref["actions"]):
                mismatched += 1
        nodes = {r[4] for r in replies if phase[0] <= r[1] < phase[1]}
        moved_eps += len(nodes) > 1
        for (_, r0, *_), (s1, r1, _, reset, _, replayed), late in zip(
            replies, replies[1:], log["late"][1:], strict=False
        ):
            if phase[0] <= r1 < phase[1]:
                gaps.append(r1 - r0)
                steps.append(r1 - s1)
                lates.append(r1 - s1 + late)
                resets += bool(reset)
                replays += bool(replayed)
    return {
        "replies": len(gaps),
        "attempts_retried": len(failures),
        "why_retried": dict(collections.Counter(failures).most_common(5)),
        "resets": resets,
        "replayed": replays,
        "outputs_not_equal_to_unmoved": mismatched,
        "episodes_that_changed_node": moved_eps,
        "gap_p50_ms": pct(gaps, 50) * 1000,
        "gap_p99_ms": pct(gaps, 99) * 1000,
        "gap_max_ms": max(gaps) * 1000 if gaps else float("nan"),
        "late_p99_ms": pct(lates, 99) * 1000,
        "step_p50_ms": pct(steps, 50) * 1000,
        "period_ms": period * 1000,
    }


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def run(episodes: int, hz: float, seconds: float, procs: int) -> dict[str, Any]:
    tmp = tmpdir()
    redis = RedisServer(tmp).start()
    extra = ["--max-batch", "1", "--capacity", str(episodes), "--lease-ttl", "5"]
    names = ["h0", "h1", "h2"]
    nodes = {n: Node(tmp, n, redis.url, devices="cpu:2", extra=extra) for n in names}
    out: dict[str, Any] = {}
    try:
        nodes["h0"].start()
        period = 1.0 / hz
        # ---- phase 1: drain h0 (both devices) with --move ------------------------------
        # Every episode starts on h0 (the only node when the robots start); h1 and h2 join
        # the fleet and the load balancer before h0 drains.
        service = tmp / "service"  # the fleet's addresses, as a load balancer has them
        publish(service, [nodes["h0"].url])
        eps = [f"hand-{i}" for i in range(episodes)]
        stop = drive(service, eps, hz, procs)
        r = redis.client()
        wait_until(lambda: all(r.exists(KEYS.episode(ep)) for ep in eps), 60, "claims on h0")
        for n in ("h1", "h2"):
            nodes[n].start()
        publish(service, [n.url for n in nodes.values()])
        time.sleep(seconds)
        started = time.monotonic()
        env = {**os.environ, "AFFINITY_REDIS_URL": redis.url}
        subprocess.run([sys.executable, "-m", "affinity.cli", "drain", "h0/0", "h0/1", "--move"],
                       cwd=ROOT, env=env, check=True, capture_output=True)  # fmt: skip
        wait_until(lambda: metric(nodes["h0"].url, "affinity_moves_total") >= episodes, 60, "moves")
        moved_at = time.monotonic()
        time.sleep(seconds)
        logs = stop()
        before = judge(logs, (started - seconds, started), period)
        during = judge(logs, (started, moved_at + 1.0), period)
        moves = metric(nodes["h0"].url, 'affinity_moves_total{outcome="moved",reason="drain"}')
        seconds_sum = metric(nodes["h0"].url, "affinity_move_seconds_sum")
        bytes_sum = metric(nodes["h0"].url, "affinity_move_bytes_sum")
        out["drain"] = {
            "before": before,
            "during": during,
            "moved": moves,
            "bytes_per_record": bytes_sum / max(moves, 1),
            "move_ms_mean": seconds_sum / max(moves, 1) * 1000,
            "drain_s": moved_at - started,
        }
        # ---- phase 2: a rolling restart of every node --------------------------------------
        for device in ("h0/0", "h0/1"):
            subprocess.run([sys.executable, "-m", "affinity.cli", "undrain", device],
                           cwd=ROOT, env=env, check=True, capture_output=True)  # fmt: skip
        # new episodes (a robot's seq and state go on only within its episode), claimed
        # round-robin over the three nodes
        eps = [f"roll-{i}" for i in range(episodes)]
        stop = drive(service, eps, hz, procs)
        time.sleep(seconds)
        started = time.monotonic()
        for i, old in enumerate(names):
            new = Node(tmp, f"r{i}", redis.url, devices="cpu:2", extra=extra).start()
            nodes[new.node_id] = new
            live = [
                n for n in nodes.values()
                if n.node_id != old and n.proc.popen and n.proc.popen.poll() is None
            ]  # fmt: skip
            publish(service, [n.url for n in live])  # the old one out of the load balancer
            nodes[old].proc.send(signal.SIGTERM)
            assert nodes[old].proc.popen is not None
            assert nodes[old].proc.popen.wait(60) == 0
        rolled_at = time.monotonic()
        time.sleep(seconds)
        logs = stop()
        out["rolling"] = {
            "before": judge(logs, (started - seconds, started), period),
            "during": judge(logs, (started, rolled_at), period),
            "restart_s": rolled_at - started,
        }
        return out
    finally:
        for n in nodes.values():
            n.stop()
        redis.stop()


def main() -> None:
    a = options(episodes=64, hz=20.0, seconds=4.0, procs=4)
    out = run(a.episodes, a.hz, a.seconds, a.procs)
    figures = []
    for phase in ("drain", "rolling"):
        before, during = out[phase]["before"], out[phase]["during"]
        period = during["period_ms"]
        figures.append({
            "figure": f"{phase}: resets said / steps applied twice or lost / outputs != unmoved",
            "result": f"{during['resets']} / {during['replayed']} replays, "
                      f"{during['outputs_not_equal_to_unmoved']} outputs differ "
                      f"({during['replies']} replies, "
                      f"{during['episodes_that_changed_node']} episodes changed node)",
            "goal": "0 / 0 / 0",
            "ok": during["resets"] == 0 and during["outputs_not_equal_to_unmoved"] == 0,
        })  # fmt: skip
        figures.append({
            "figure": f"{phase}: failed attempts (503 or unreachable, retried)",
            "result": f"{during['attempts_retried']} (before: {before['attempts_retried']}) "
                      f"{during['why_retried'] or ''}",
            "goal": "0",
            "ok": during["attempts_retried"] == 0,
        })  # fmt: skip
        figures.append({
            "figure": f"{phase}: p99 gap between replies of an episode",
            "result": f"{during['gap_p99_ms']:.1f} ms = {during['gap_p99_ms'] / period:.2f} "
                      f"periods ({during['gap_p99_ms'] / max(before['gap_p99_ms'], 1e-9):.2f}x "
                      f"the {before['gap_p99_ms']:.1f} ms before; "
                      f"max {during['gap_max_ms']:.1f} ms)",
            "goal": "a step late by at most one control period: <= 2 periods",
            "ok": during["gap_p99_ms"] <= 2 * period,
        })  # fmt: skip
    drain = out["drain"]
    figures.append({
        "figure": "drain: bytes per record moved, a move's time",
        "result": f"{drain['bytes_per_record']:.0f} B, {drain['move_ms_mean']:.2f} ms mean = "
                  f"{drain['move_ms_mean'] / max(drain['before']['step_p50_ms'], 1e-9):.2f}x "
                  f"the {drain['before']['step_p50_ms']:.2f} ms p50 step before "
                  f"({drain['moved']:.0f} records in {drain['drain_s']:.2f} s)",
        "goal": "reported",
        "ok": True,
    })  # fmt: skip
    report("handover", figures, out)


if __name__ == "__main__":
    main()
