"""A random chaos run checked against a reference model (issue 33): three real nodes with
different lease TTLs, robots stepping live episodes through random nodes, and, at random,
kills (then a restart under the same node id), graceful stops (each moves its episodes
with their state), pauses under and past the lease, empty Redis restarts, operators'
releases, ends, moves of one episode and drains of a node with ``--move``. Each node reaches
Redis through a relay of its own (``tests/procs.py``'s ``Forwarder``), so a drain with
``--move`` may run while its node's link is slow (25 to 100 ms each way), and Redis may be
restarted empty, or from a snapshot taken just before moves, while the moves run
(issue 41). In the shape with fronts (``[fronts2]``, issue 43) a node's front processes are
killed (``kill -9``) and paused (SIGSTOP, then SIGCONT) too, alone and while their node or
the node its episodes move to stops gracefully (mid-step, mid-transfer); a kill takes the
node's process alone, and its fronts must go with it: no orphan, after every stop. In the
shape with device workers too (``[fronts2-workers]``) a device's worker process is killed
(``kill -9``) and paused (SIGSTOP, then SIGCONT, under or past ``--act-deadline``, where the
node kills it as hung) with a step in it, alone and while its node or the node its episodes
move to stops gracefully; it must go with its node as well.

The probe policy counts exactly the steps its episode has seen (``counter_policy``), so
each reply is checked against the last one of its episode:

- ``count == last + 1`` (it continues), or
- ``state_reset`` said (the count starts again from what the reply says), or
- ``count == 1`` for a step sent after an end of its episode returned (a new episode).

Anything else is a violation: a count that repeats or goes back is a 200 whose state was
kept nowhere (or a second owner serving older state), one that skips is a step applied
twice, a fresh count without ``state_reset`` is a silent reset. Once a claim (token) has
been superseded by another, it must never serve again, but within the documented bound
after Redis went back to an older snapshot (:data:`SNAPSHOT_BOUND_S`: the owners notice
the other server at a renewal and check their records at the next flush). A robot is never
refused ``owner_refused`` (its owner refuses a claim Redis names) for longer than
:data:`REFUSED_BOUND_S` in a row. And no node process exits but the ones this test stops.
Every loop is bounded in count and time; the run is seeded.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from affinity import Claims, Registry, Settings, StaleToken, UnknownEpisode
from affinity.registry import MoveRequest
from tests.models import counter_policy
from tests.procs import (
    Forwarder,
    Node,
    RedisServer,
    fronts_of,
    wait_until,
    worker_mid_step,
    workers_of,
)
from tests.procs import pause as freeze  # hit() has a parameter named pause

pytestmark = [pytest.mark.integration, pytest.mark.shapes]

SECONDS = float(os.environ.get("AFFINITY_CHAOS_SECONDS", "45"))
EPISODES = 6
OBS = {"obs": [[0.0] * 8]}
LEASES = {"c0": 3.0, "c1": 3.0, "c2": 5.0}  # mixed lease TTLs
SNAPSHOT_BOUND_S = max(LEASES.values()) + 2.0
"""Two owners may serve an episode this long after Redis was restored from an older
snapshot: a renewal (a third of a lease) notices the other server, the next flush (≤ 1 s)
drops what Redis no longer names; generous for a busy machine."""
REFUSED_BOUND_S = 3 * max(LEASES.values())
"""A lease is the documented bound on ``owner_refused`` in a row; three, for a busy
machine (before issue 41 it lasted for the rest of the run)."""
RESTORES: list[float] = []  # when Redis was restored from an older snapshot (monotonic)


@dataclass
class Episode:
    name: str
    with_seq: bool  # its robot numbers its steps (seq) and retries a failed one as it was
    last: int = 0  # the count of its last 200 (0: none yet)
    seq: int = 0  # the seq of its last 200
    token: int | None = None
    prev_sent: float = float("-inf")  # when the request of its last 200 was sent
    fresh_sent: float = float("-inf")  # when the request of its last fresh start was sent
    ends: list[list[float]] = field(default_factory=list)  # [started, returned] of each end
    skipped: int = 0  # steps applied whose reply reached nobody, seen as a skip (no seq)
    lost: bool = False  # an attempt since its last 200 got no reply (timed out, cut off)
    lost_attempts: int = 0  # how many attempts since its last 200 got no reply
    lost_resets: int = 0  # of those, a reset whose reply reached nobody (no seq)
    replies: int = 0
    resets: int = 0
    restored: int = 0  # replies of two owners within the bound after a snapshot restore
    tolerated: list[str] = field(default_factory=list)  # the first few of them
    latest: float = 0.0  # the latest of them, seconds after its restore
    refused_since: float | None = None  # the first owner_refused of the failures in a row
    superseded: set[int] = field(default_factory=set)
    violations: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def judge(self, sent: float, received: float, reply: dict[str, Any]) -> None:
        count = int(np.asarray(reply["outputs"]["count"]).reshape(-1)[0])
        token = int(reply["token"])
        with self.lock:
            self.replies += 1
            where = (
                f"{self.name} via {reply['node']} token {token} routing {reply['routing']} "
                f"sent {sent:.1f} seq {reply['seq']}"
            )
            # within the bound after Redis went back to an older snapshot, two owners may
            # serve (docs/guarantees.md): what they answer then is counted, not a violation
            window = any(r - 1.0 < received and sent < r + SNAPSHOT_BOUND_S for r in RESTORES)
            violations = len(self.violations)
            if token in self.superseded:
                self.violations.append(f"a superseded claim served again: {where}")
            if self.token is not None and token != self.token:
                self.superseded.add(self.token)
            # an end that returned before this step was sent, and began after the last
            # fresh start: this step must start afresh (a new episode under the same id)
            after_end = any(s > self.fresh_sent and d < sent for s, d in self.ends)
            # an end that ran between the last reply's request and this reply: a fresh
            # start without state_reset is the new episode the client asked for
            racing_end = any(s < received and d > self.prev_sent for s, d in self.ends)
            # without seq, an attempt that got no reply may still be applied after the end
            # (held in a paused front until after it; docs/guarantees.md): each such one
            # starts or advances the new episode, its reply gone with the client's timeout
            stale = 0 if self.with_seq else self.lost_attempts
            if after_end and not 1 <= count <= 1 + stale:
                self.violations.append(f"served from before its end: count {count}: {where}")
            elif after_end and count > 1:  # the new episode, its first steps' replies lost
                self.skipped += count - 1
                self.fresh_sent = sent
            elif reply["state_reset"]:
                self.resets += 1
            elif count == self.last + 1 or (count == 1 and racing_end):
                pass
            elif not self.with_seq and self.last + 2 <= count <= self.last + 1 + max(
                1, self.lost_attempts
            ):
                # its previous step was applied and its reply lost with the router that
                # carried it (killed, or paused while the robot went on elsewhere): without
                # seq nobody can tell a retry from the next step (docs/guarantees.md). Each
                # attempt that got no reply may be one: e.g. one whose reply a front read
                # back as it was killed (delivered, to the node), then one whose router was
                # paused with its reply (its undo comes after the next step: that step's
                # successor says state_reset). Never more steps than the robot sent.
                self.skipped += count - self.last - 1
            elif count == 2 and not self.with_seq and self.lost:
                # the same, where the lost step started the state over (it said so, to
                # nobody): its retry ran on top before the undo came, and the step after
                # says state_reset (docs/guarantees.md)
                self.lost_resets += 1
            else:
                self.violations.append(f"count {count} after {self.last}: {where}")
            if window and len(self.violations) > violations:
                after = max(received - r for r in RESTORES if r - 1.0 < received)
                self.latest = max(self.latest, after)
                if len(self.tolerated) < 3:
                    self.tolerated += [f"{v} ({after:.1f}s after a restore)"
                                       for v in self.violations[violations:]]  # fmt: skip
                del self.violations[violations:]
                self.restored += 1
            if count == 1 or reply["state_reset"]:
                self.fresh_sent = sent
            self.last, self.token, self.seq = count, token, int(reply["seq"])
            self.prev_sent = sent
            self.lost = False
            self.lost_attempts = 0


def robot(ep: Episode, urls: list[str], until: float, seed: int) -> None:
    """Step ``ep`` through random nodes until ``until`` (one step at a time, a robot's
    loop): a 200 is judged; anything else is retried after a short pause (the same step,
    with seq, by a robot that numbers its steps)."""
    rng = random.Random(seed)
    with httpx.Client(timeout=4) as client:
        while time.monotonic() < until:
            sent = time.monotonic()
            body: dict[str, Any] = {"episode_id": ep.name, "inputs": OBS}
            if ep.with_seq:
                body["seq"] = ep.seq + 1
            try:
                r = client.post(rng.choice(urls) + "/act", json=body)
            except httpx.HTTPError:  # no reply: the step may have been applied
                with ep.lock:
                    ep.lost = True
                    ep.lost_attempts += 1
                time.sleep(0.05)
                continue
            if r.status_code == 200:
                ep.judge(sent, time.monotonic(), r.json())
                ep.refused_since = None
                continue
            if r.status_code == 503 and "owner_refused" in r.text:
                now = time.monotonic()
                if ep.refused_since is None:
                    ep.refused_since = now
                elif now - ep.refused_since > REFUSED_BOUND_S:
                    with ep.lock:
                        ep.violations.append(
                            f"{ep.name}: refused owner_refused for {now - ep.refused_since:.1f}s "
                            f"in a row: {r.text[:200]}"
                        )
                    ep.refused_since = None
            if r.status_code == 409 and r.json()["error"]["code"] == "seq_conflict":
                with ep.lock:  # a step that raced its end: numbered afresh
                    ep.seq = 0
            elif r.status_code not in (409, 503):  # 409: a step raced its end
                with ep.lock:
                    ep.violations.append(f"{ep.name}: {r.status_code} {r.text[:200]}")
            time.sleep(0.05)


class Chaos:
    def __init__(self, tmp: Path, seed: int) -> None:
        self.rng = random.Random(seed)
        self.redis = RedisServer(tmp)
        self.snapshot = tmp / "dump.rdb"  # where SAVE writes and a start reads it
        model = counter_policy(tmp)
        self.relays = {n: Forwarder(self.redis.port) for n in LEASES}  # each node's link
        self.nodes = {
            n: Node(
                tmp, n, f"redis://127.0.0.1:{self.relays[n].port}/0", devices="cpu:2",
                extra=["--lease-ttl", str(t), "--act-deadline", "3", "--model", str(model)],
            )
            for n, t in LEASES.items()
        }  # fmt: skip
        self.stopped: set[str] = set()  # nodes this test stopped (killed, or gracefully)
        self.log: list[str] = []
        first = next(iter(self.nodes.values()))
        self.fronts = first.front_doors > 1  # the [fronts2] shapes
        self.workers = first.device_workers  # the [fronts2-workers] shape
        self.mid_step = 0  # workers hit with a step in them

    def urls(self) -> list[str]:
        return [n.url for n in self.nodes.values()]

    def alive_as_expected(self) -> None:
        for name, node in self.nodes.items():
            popen = node.proc.popen
            assert popen is not None
            if name not in self.stopped:
                assert popen.poll() is None, f"{name} exited by itself:\n{node.proc.log()}"

    def restart(self, name: str) -> None:
        node = self.nodes[name]
        node.proc.start()
        wait_until(node.ready, 60, f"{name} ready again")
        self.stopped.discard(name)

    def no_orphan(self, core: int) -> None:
        """The fronts and device workers of a node process that ended end with it
        (``PR_SET_PDEATHSIG``)."""
        left = wait_until(lambda: not fronts_of(core) and not workers_of(core), 10,
                          f"the fronts and workers of {core} gone")  # fmt: skip
        assert left, f"outlived their node {core}: {fronts_of(core)} {workers_of(core)}"

    def hit(self, name: str, pause: bool, kind: str) -> int | None:
        """Kill one front (``kind`` "front") or device worker ("worker") of ``name`` (it is
        restarted), or pause it (:meth:`resume`); which (none when it has none running now).
        A worker is paused first and hit once a step is in it (waited for, bounded: a device
        whose episodes all moved away gets none, and is hit idle)."""
        node = self.nodes[name]
        pids = node.fronts() if kind == "front" else node.workers()
        if not pids:
            return None
        pid = self.rng.choice(pids)
        how = ""
        with contextlib.suppress(ProcessLookupError):
            if kind == "worker":
                freeze(pid)
                try:
                    worker_mid_step(pid, timeout=3)
                    self.mid_step += 1
                    how = " mid-step"
                except AssertionError:
                    how = " idle"
            os.kill(pid, signal.SIGSTOP if pause else signal.SIGKILL)
        self.log.append(f"  {kind} {pid} of {name} {'paused' if pause else 'killed'}{how}")
        return pid

    def resume(self, name: str) -> None:
        for pid in self.nodes[name].fronts() + self.nodes[name].workers():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def act(self, episodes: list[Episode]) -> None:
        name = self.rng.choice(list(self.nodes))
        node = self.nodes[name]
        what = self.rng.choice(
            ["kill", "term", "pause_under", "pause_past", "redis", "release", "end", "end",
             "move", "drain_move", "slow_drain_move", "redis_snapshot"]
            + ["front_kill", "front_pause", "term_fronts"] * self.fronts
            + ["worker_kill", "worker_pause", "worker_pause_past", "term_workers"] * self.workers
        )  # fmt: skip
        self.log.append(f"{time.monotonic():.1f} {what} {name}")
        if what == "kill":
            self.stopped.add(name)
            core = node.pid()
            if self.fronts:  # the node's process alone: its fronts must die with it
                node.proc.popen.kill()  # type: ignore[union-attr]
                node.proc.popen.wait(10)  # type: ignore[union-attr]
                self.no_orphan(core)
            node.stop(signal.SIGKILL)
            time.sleep(self.rng.uniform(0, 2))
            self.restart(name)
        elif what == "term":
            self.stopped.add(name)
            core = node.pid()
            node.stop(signal.SIGTERM)
            if self.fronts:
                self.no_orphan(core)
            self.restart(name)
        elif what in ("term_fronts", "term_workers"):
            # a graceful stop while a front of another node (where episodes move, through
            # its fronts) is paused, before the stop (its transfers wait in that front) or
            # during it (it may be relaying one), then resumed or killed; and a front of the
            # stopping node (holding robots' steps) is killed: mid-transfer and mid-step.
            # The same with device workers: the other node's paused with a step in it (the
            # robots' steps there wait), the stopping node's killed with one
            kind = "front" if what == "term_fronts" else "worker"
            other = self.rng.choice([n for n in self.nodes if n != name])
            self.stopped.add(name)
            core = node.pid()
            early = self.rng.random() < 0.5
            paused = self.hit(other, pause=True, kind=kind) if early else None
            assert node.proc.popen is not None
            os.kill(core, signal.SIGTERM)
            if not early:
                time.sleep(self.rng.uniform(0, 0.3))
                paused = self.hit(other, pause=True, kind=kind)
            time.sleep(self.rng.uniform(0, 0.5))
            self.hit(name, pause=False, kind=kind)
            time.sleep(self.rng.uniform(0, 1))
            if paused is not None and self.rng.random() < 0.5:
                self.log.append(f"  paused {kind} {paused} of {other} killed")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(paused, signal.SIGKILL)
            self.resume(other)
            try:
                node.proc.popen.wait(30)
            except subprocess.TimeoutExpired:  # as node.stop does: a stop is then a kill
                self.log.append(f"  {name} still stopping after 30 s: killed")
            node.stop(signal.SIGKILL)
            self.no_orphan(core)
            self.restart(name)
        elif what in ("front_kill", "front_pause", "worker_kill", "worker_pause",
                      "worker_pause_past"):  # fmt: skip
            kind, _, how = what.partition("_")
            self.hit(name, pause=how != "kill", kind=kind)
            if how != "kill":
                # past --act-deadline (3 s) the node kills a paused worker as hung
                pause = self.rng.uniform(4, 5) if how == "pause_past" else self.rng.uniform(0.2, 2)
                try:
                    time.sleep(pause)
                finally:
                    self.resume(name)
        elif what in ("pause_under", "pause_past"):
            lease = LEASES[name]
            pause = lease * (self.rng.uniform(0.2, 0.6) if what == "pause_under" else 1.5)
            node.proc.send(signal.SIGSTOP)
            try:
                time.sleep(pause)
            finally:
                node.proc.send(signal.SIGCONT)
        elif what == "redis":  # restarted empty (its snapshot, if any, gone)
            self.snapshot.unlink(missing_ok=True)
            self.redis.restart()
        elif what == "slow_drain_move":  # a drain whose old owner's link to Redis is slow
            delay = self.rng.choice([0.025, 0.05, 0.1])
            self.log.append(f"  {name}'s link +{delay * 1000:.0f} ms each way")
            self.relays[name].delay_s = delay
            devices = [f"{name}/0", f"{name}/1"]
            try:
                self.operator(lambda r, c: self._drain(r, devices, move=True))
                time.sleep(self.rng.uniform(1, 4))
                self.operator(lambda r, c: self._drain(r, devices, move=False))
            finally:
                self.relays[name].delay_s = 0.0
        elif what == "redis_snapshot":  # Redis goes back to a snapshot from before moves
            with contextlib.suppress(Exception):
                self.redis.client().save()
            devices = [f"{name}/0", f"{name}/1"]
            self.operator(lambda r, c: self._drain(r, devices, move=True))
            time.sleep(self.rng.uniform(0.5, 3))  # the moves, at the node's next renewal
            self.redis.proc.stop(signal.SIGKILL)
            self.redis.start(new_fleet=False)  # from the snapshot, when SAVE made one
            RESTORES.append(time.monotonic())
            self.snapshot.unlink(missing_ok=True)
        elif what == "move":  # an operator's `affinity move EP` (to any device with room)
            ep = self.rng.choice(episodes)
            self.log.append(f"  move of {ep.name}")
            self.operator(lambda r, c: self._move(r, c, ep.name))
        elif what == "drain_move":  # `affinity drain N/0 N/1 --move`, undrained a while later
            devices = [f"{name}/0", f"{name}/1"]
            self.operator(lambda r, c: self._drain(r, devices, move=True))
            time.sleep(self.rng.uniform(1, 4))
            self.operator(lambda r, c: self._drain(r, devices, move=False))
        elif what == "release":  # an operator's `affinity release`
            ep = self.rng.choice(episodes)
            self.log.append(f"  release of {ep.name}")
            self.release(ep.name)
        else:  # an end through a random node (as POST /episodes/<id>/end)
            ep = self.rng.choice(episodes)
            self.log.append(f"  end of {ep.name}")
            interval = [time.monotonic(), float("inf")]
            with ep.lock:
                ep.ends.append(interval)
            ended = False
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.post(f"{node.url}/episodes/{ep.name}/end", timeout=4)
                ended = r.status_code == 200 and r.json().get("released") is True
            with ep.lock:
                if ended:  # (one that failed may have ended it all the same: it stays open)
                    interval[1] = time.monotonic()
            self.log.append(f"  ended {ended} {interval[0]:.1f}-{interval[1]:.1f}")
        time.sleep(self.rng.uniform(0.3, 1.5))

    @staticmethod
    async def _move(registry: Any, claims: Any, episode: str) -> None:
        info = await claims.lookup(episode)
        if info is not None and info.alive:
            await registry.request_move(info.node, MoveRequest(episode=episode))

    @staticmethod
    async def _drain(registry: Any, devices: list[str], *, move: bool) -> None:
        for device in devices:
            await (registry.drain(device, "chaos") if move else registry.undrain(device))
        if move:
            node = devices[0].rpartition("/")[0]
            for device in devices:
                await registry.request_move(node, MoveRequest(device=device))

    def operator(self, action: Any) -> None:
        """Run ``action(registry, claims)`` as the CLI would (Redis may be restarting: then
        nothing happens, as for an operator whose command failed)."""
        import asyncio

        async def go() -> None:
            import redis.asyncio

            client = redis.asyncio.Redis.from_url(self.redis.url, decode_responses=True)
            try:
                await action(Registry(client, Settings()), Claims(client, Settings()))
            finally:
                await client.aclose()

        with contextlib.suppress(Exception):
            asyncio.run(go())

    def release(self, episode: str) -> None:
        import asyncio

        async def go() -> None:
            import redis.asyncio

            client = redis.asyncio.Redis.from_url(self.redis.url, decode_responses=True)
            try:
                claims = Claims(client, Settings())
                info = await claims.lookup(episode)
                if info is not None:
                    with contextlib.suppress(StaleToken, UnknownEpisode):
                        await claims.release(episode, info.token, "operator")
            finally:
                await client.aclose()

        with contextlib.suppress(Exception):  # Redis may be restarting: the next one then
            asyncio.run(go())


def test_chaos_never_two_owners_never_a_silent_reset_never_state_kept_nowhere(
    tmp_path: Path,
) -> None:
    seed = int(os.environ.get("AFFINITY_CHAOS_SEED", "20261204"))
    chaos = Chaos(tmp_path, seed)
    chaos.redis.start()
    threads: list[threading.Thread] = []
    try:
        for node in chaos.nodes.values():
            node.proc.start()
        for node in chaos.nodes.values():
            wait_until(node.ready, 60, f"{node.node_id} ready")
        episodes = [Episode(f"chaos-{i}", with_seq=i % 2 == 1) for i in range(EPISODES)]
        until = time.monotonic() + SECONDS
        threads = [
            threading.Thread(target=robot, args=(ep, chaos.urls(), until, seed + i), daemon=True)
            for i, ep in enumerate(episodes)
        ]
        for t in threads:
            t.start()
        actions = 0
        while time.monotonic() < until - 3 and actions < 200:
            chaos.act(episodes)
            chaos.alive_as_expected()
            actions += 1
        for t in threads:
            t.join(SECONDS + 60)
            assert not t.is_alive(), "a robot never finished"
        chaos.alive_as_expected()
        violations = [v for ep in episodes for v in ep.violations]
        summary = (
            f"seed {seed}, {actions} actions, "
            f"{sum(ep.replies for ep in episodes)} steps, "
            f"{sum(ep.resets for ep in episodes)} resets said, "
            f"{sum(ep.skipped for ep in episodes)} lost replies of steps without seq "
            f"({sum(ep.lost_resets for ep in episodes)} of them resets), "
            f"{sum(ep.restored for ep in episodes)} replies of two owners within "
            f"{SNAPSHOT_BOUND_S:g}s of a snapshot restore (the latest "
            f"{max(ep.latest for ep in episodes):.1f}s after it); "
            f"{chaos.mid_step} device workers hit with a step in them; "
            f"actions: {' '.join(sorted(line.split()[1] for line in chaos.log if line[0] != ' '))}"
        )
        print(summary)
        print("\n".join(t for ep in episodes for t in ep.tolerated))
        assert not violations, f"{summary}\n" + "\n".join(violations + chaos.log)
        assert all(ep.replies for ep in episodes), "an episode was never served"
        for node in chaos.nodes.values():
            assert "this one stops" not in node.proc.log(), node.proc.log()
    finally:
        for node in chaos.nodes.values():
            node.stop(signal.SIGKILL)
        for relay in chaos.relays.values():
            relay.close()
        chaos.redis.stop()
        RESTORES.clear()
