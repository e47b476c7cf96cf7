"""Live episode hand-over (issue 35) with real processes: an operator's drain with move
under the unmodified clients of every front door (affinity.Client on /act, tritonclient,
openpi-client), a graceful stop that moves a recurrent state of several MB, and a new
owner paused in the middle of a graceful stop (the move fails: one owner, the reset said).
With fronts (issue 43) the fronts of both nodes are killed and paused in the middle of a
graceful stop's steps and transfers.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from affinity import Client, Keys
from node.hop import ANSWERED
from node.models import DEMO_MODEL
from tests.models import big_state_policy, counter_policy
from tests.procs import (
    ROOT,
    Node,
    RedisServer,
    free_port,
    fronts_of,
    on_the_hop,
    pause,
    region_of,
    tcp_sockets,
    wait_until,
    worker_mid_step,
    workers_of,
)
from tests.rollout import reference_rollout
from tests.test_cluster import running

pytestmark = [
    pytest.mark.shapes,
    pytest.mark.integration,  # openpi-client connects as websockets deprecated, unmodified
    pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager"),
]
KEYS = Keys()


def observations(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, 8)).astype(np.float32) for _ in range(n)]


def cli(redis_url: str, *args: str) -> str:
    env = {**os.environ, "AFFINITY_REDIS_URL": redis_url}
    done = subprocess.run(
        [sys.executable, "-m", "affinity.cli", *args], cwd=ROOT, env=env, capture_output=True,
        text=True, check=True,
    )  # fmt: skip
    return done.stdout


def on_device(redis: RedisServer, episode: str) -> str:
    value = redis.client().get(KEYS.episode(episode))
    return "" if value is None else str(value).split(" ")[0]


def test_a_drain_with_move_carries_every_front_doors_episode_with_its_state(
    tmp_path: Path,
) -> None:
    """Four robots, one per front door, step episodes that a owns; ``affinity drain a/0
    --move`` moves them to b; the clients, none of them ours but the first, see no error
    and no reset, and every reply is the model after the episode's whole history."""
    redis = RedisServer(tmp_path)
    grpc_port = free_port()
    a = Node(tmp_path, "a", redis.url, devices="cpu:1", extra=["--grpc-port", str(grpc_port)])
    b = Node(tmp_path, "b", redis.url, devices="cpu:1", extra=["--grpc-port", str(free_port())])
    doors = ("act", "kserve", "grpc", "openpi")
    names = ("act-robot", "kserve:i:4242", "kserve:s:grpc-robot", "pi-robot")
    with running(redis, [a]):
        obs = {door: observations(i, 8) for i, door in enumerate(doors)}
        got: dict[str, list[np.ndarray]] = {door: [] for door in obs}
        fleet = Client([a.url], raise_on_reset=True)  # a StateReset would be an exception
        triton = th.InferenceServerClient(f"{a.host}:{a.port}")
        triton_grpc = tg.InferenceServerClient(f"{a.host}:{grpc_port}")
        robot = WebsocketClientPolicy(f"ws://{a.host}:{a.port}/?episode_id=pi-robot")

        def steps(i: int) -> None:
            got["act"].append(
                np.asarray(fleet.act("act-robot", {"obs": obs["act"][i]}).outputs["actions"])
            )
            x = th.InferInput("obs", [1, 8], "FP32").set_data_from_numpy(obs["kserve"][i])
            r = triton.infer("demo_policy", [x], sequence_id=4242, sequence_start=i == 0)
            assert r.get_response()["parameters"]["state_reset"] is False
            got["kserve"].append(r.as_numpy("actions"))
            g = tg.InferInput("obs", [1, 8], "FP32")
            g.set_data_from_numpy(obs["grpc"][i])
            rg = triton_grpc.infer("demo_policy", [g], sequence_id="grpc-robot",
                                   sequence_start=i == 0)  # fmt: skip
            params = rg.get_response().parameters
            assert params["state_reset"].bool_param is False
            got["grpc"].append(rg.as_numpy("actions"))
            reply = robot.infer({"obs": obs["openpi"][i][0]})
            assert reply["state_reset"] is False, reply
            got["openpi"].append(reply["actions"])

        try:
            for i in range(3):
                steps(i)
            b.proc.start()
            wait_until(b.ready, 60, "b ready")
            for name in names:
                assert on_device(redis, name) == "a/0"
            out = cli(redis.url, "drain", "a/0", "--move")  # waits for the moves
            assert "draining" in out
            assert f"moved {len(names)} of {len(names)} episodes with their state" in out, out
            wait_until(
                lambda: all(on_device(redis, n) == "b/0" for n in names),
                30,
                "every episode moved to b (at a's next renewal)",
            )
            for i in range(3, 8):  # the same clients, the same connections to a
                steps(i)
        finally:
            fleet.close()
            triton.close()
            triton_grpc.close()
            robot._ws.close()
        for door, history in obs.items():
            want = reference_rollout(DEMO_MODEL, history)
            for i, (g, w) in enumerate(zip(got[door], want, strict=True)):
                np.testing.assert_allclose(
                    np.asarray(g).reshape(w["actions"].shape), w["actions"], rtol=1e-5,
                    err_msg=f"{door} step {i}",
                )  # fmt: skip
        events = [f for _, f in redis.client().xrange(KEYS.events) if f.get("type") == "moved"]
        assert {e["episode"] for e in events} == set(names)
        assert {e["reason"] for e in events} == {"drain"}
        b.stop()


def test_a_graceful_stop_moves_a_state_of_several_megabytes(tmp_path: Path) -> None:
    model = big_state_policy(tmp_path)  # 4 MiB of recurrent state
    redis = RedisServer(tmp_path)
    extra = ["--model", str(model)]
    a = Node(tmp_path, "a", redis.url, devices="cpu:1", extra=extra)
    b = Node(tmp_path, "b", redis.url, devices="cpu:1", extra=extra)
    with running(redis, [a]):
        # the episode is claimed while a is the only node (b's address fails over to a)
        with Client([a.url, b.url], raise_on_reset=True) as fleet:
            for n in range(1, 4):
                step = fleet.act("big", {"obs": np.zeros((1, 8), np.float32)})
                assert (step.node, float(np.asarray(step.outputs["steps"]).item())) == ("a", n)
            b.proc.start()
            wait_until(b.ready, 60, "b ready")
            a.proc.send(signal.SIGTERM)
            assert a.proc.popen is not None and a.proc.popen.wait(60) == 0
            for n in range(4, 7):
                step = fleet.act("big", {"obs": np.zeros((1, 8), np.float32)})
                assert (step.node, float(np.asarray(step.outputs["steps"]).item())) == ("b", n)
        moved = [f for _, f in redis.client().xrange(KEYS.events) if f.get("type") == "moved"]
        assert len(moved) == 1 and int(moved[0]["bytes"]) >= 4 << 20
        b.stop()


def test_a_new_owner_paused_during_a_graceful_stop_leaves_one_owner_and_says_the_reset(
    tmp_path: Path,
) -> None:
    """b, the only place to go, is SIGSTOPped while a stops gracefully: the record cannot
    reach it, the reservation is taken back, the episode is handed over without its state;
    once b runs again the episode's next step there says state_reset, and the copy b may
    have installed meanwhile is never served (it was never committed)."""
    redis = RedisServer(tmp_path)
    a = Node(tmp_path, "a", redis.url, devices="cpu:1", extra=["--drain-timeout", "30"])
    b = Node(tmp_path, "b", redis.url, devices="cpu:1")
    with running(redis, [a]):
        body = {"episode_id": "paused-target", "inputs": {"obs": [[0.0] * 8]}}
        first = httpx.post(a.url + "/act", json=body, timeout=10).json()
        b.proc.start()
        wait_until(b.ready, 60, "b ready")
        b.proc.send(signal.SIGSTOP)
        try:
            a.proc.send(signal.SIGTERM)
            assert a.proc.popen is not None and a.proc.popen.wait(60) == 0
        finally:
            b.proc.send(signal.SIGCONT)
        assert "1 without" in a.proc.log() or "handed over 1 without" in a.proc.log(), a.proc.log()
        value = str(redis.client().get(KEYS.episode("paused-target")))
        assert value.endswith(" moved") and value.split(" ")[1] == str(first["token"])
        r = wait_until(
            lambda: (
                (x := httpx.post(b.url + "/act", json=body, timeout=10)).status_code == 200 and x
            ),
            30,
            "served on b",
        )
        after = r.json()
        assert (after["node"], after["routing"], after["state_reset"]) == ("b", "reassigned", True)
        assert after["seq"] == 1
        b.stop()


def test_affinity_move_to_a_named_device_carries_the_episode_with_its_state(
    tmp_path: Path,
) -> None:
    """``affinity move EP --to c/0`` on a fleet of three: the episode lands on the device
    named (not on b, which has room too), its next steps continue its history through any
    node, and a typo in the target is refused before anything is asked."""
    redis = RedisServer(tmp_path)
    a = Node(tmp_path, "a", redis.url, devices="cpu:1")
    b = Node(tmp_path, "b", redis.url, devices="cpu:1")
    c = Node(tmp_path, "c", redis.url, devices="cpu:1")
    with running(redis, [a]):
        obs = observations(7, 6)
        got: list[np.ndarray] = []
        with Client([a.url], raise_on_reset=True) as fleet:
            for i in range(3):
                got.append(np.asarray(fleet.act("moved-ep", {"obs": obs[i]}).outputs["actions"]))
            for node in (b, c):
                node.proc.start()
            for node in (b, c):
                wait_until(node.ready, 60, f"{node.node_id} ready")
            assert on_device(redis, "moved-ep") == "a/0"
            env = {**os.environ, "AFFINITY_REDIS_URL": redis.url}
            typo = subprocess.run(
                [sys.executable, "-m", "affinity.cli", "move", "moved-ep", "--to", "c/9"],
                cwd=ROOT, env=env, capture_output=True, text=True,
            )  # fmt: skip
            assert typo.returncode != 0 and "c/9" in typo.stderr, typo
            out = cli(redis.url, "move", "moved-ep", "--to", "c/0")
            assert "asked a to move moved-ep to c/0" in out, out
            wait_until(lambda: on_device(redis, "moved-ep") == "c/0", 30, "moved to c/0")
            for i in range(3, 6):  # the client still knows only a: a routes to c
                step = fleet.act("moved-ep", {"obs": obs[i]})
                assert step.node == "c", step
                got.append(np.asarray(step.outputs["actions"]))
        want = reference_rollout(DEMO_MODEL, obs)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            np.testing.assert_allclose(
                g.reshape(w["actions"].shape), w["actions"], rtol=1e-5, err_msg=f"step {i}"
            )
        moved = [f for _, f in redis.client().xrange(KEYS.events) if f.get("type") == "moved"]
        assert [(m["from"], m["to"], m["reason"]) for m in moved] == [("a/0", "c/0", "move")]
        for node in (b, c):
            node.stop()


@dataclass
class Robot:
    """A robot that numbers its steps (``seq``) and retries a failed one as it was, through
    any of the nodes it knows; each 200 judged against the counter policy: ``count`` is the
    steps its state has seen, so a reply must be ``seq - base`` (``base``: the seq before
    the last reset said; a reset is a new claim, whose steps are numbered afresh). A count
    that repeats or goes back is a silent reset or state kept nowhere, one that skips a step
    applied twice."""

    episode: str
    seq: int = 0
    base: int = 0
    tokens: list[int] = field(default_factory=list)
    replies: int = 0
    replayed: int = 0
    resets: int = 0
    retries: int = 0
    answers: dict[int, dict[str, Any]] = field(default_factory=dict)
    """The first 200 to each seq asked."""
    violations: list[str] = field(default_factory=list)

    def step(self, client: httpx.Client, url: str) -> bool:
        """One attempt at the next step; whether it was answered 200."""
        body = {"episode_id": self.episode, "inputs": {"obs": [[0.0] * 8]}, "seq": self.seq + 1}
        try:
            r = client.post(url + "/act", json=body)
        except httpx.HTTPError:
            self.retries += 1  # no reply: the retry carries the same seq
            return False
        if r.status_code != 200:
            if r.status_code not in (409, 503):  # moved, busy, owner unreachable: retried
                self.violations.append(f"{self.episode} seq {self.seq + 1}: {r.status_code} "
                                       f"{r.text[:200]}")  # fmt: skip
            return False
        got = r.json()
        self.answers.setdefault(self.seq + 1, got)
        count = int(np.asarray(got["outputs"]["count"]).reshape(-1)[0])
        where = f"{self.episode} seq {got['seq']} via {got['node']} token {got['token']}"
        if got["state_reset"]:  # a new claim, its steps numbered afresh (docs/protocols.md)
            self.resets += 1
            self.base = got["seq"] - 1
            if count != 1:
                self.violations.append(f"a reset said with count {count}: {where}")
        elif got["seq"] != self.seq + 1:
            self.violations.append(f"asked seq {self.seq + 1}, answered: {where}")
        elif count != got["seq"] - self.base:
            self.violations.append(f"count {count}, {got['seq'] - self.base} due: {where}")
        token = int(got["token"])
        if token in self.tokens[:-1]:
            self.violations.append(f"a superseded claim served again: {where}")
        if not self.tokens or self.tokens[-1] != token:
            self.tokens.append(token)
        self.seq = int(got["seq"])
        self.replies += 1
        self.replayed += bool(got["replayed"])
        return True


def answered(front: int, slots: list[int]) -> list[tuple[str, int]] | None:
    """(episode, seq) of each step the core applied and answered in ``slots`` of a paused
    front; None while one of them is not answered yet. A replayed reply applied nothing: the
    attempt that applied it decides (it is there when a forward held up in this front,
    paused by an earlier try, reaches the core after the robot's retry was served)."""
    with region_of(front) as region:
        if any(region.state(k) != ANSWERED for k in slots):
            return None
        steps = []
        for k in slots:
            _, meta, _ = region.read(k, copy=True)
            if "facts" in meta and not meta["facts"]["replayed"]:  # applied (not refused)
                steps.append((meta["facts"]["episode_id"], int(meta["facts"]["seq"])))
        return steps


def pause_mid_step(fronts: list[int], tries: int = 500) -> tuple[int, list[tuple[str, int]]]:
    """Pause (SIGSTOP) one of ``fronts`` while it has steps on its hop that the core then
    serves, their replies never read back; return it and (episode, seq) of those steps.
    Each try pauses one, looks, and lets it go on if it has none."""
    for i in range(tries):
        front = fronts[i % len(fronts)]
        pause(front)
        slots = on_the_hop(front)
        for _ in range(200 if slots else 0):  # the core answers them (the front is paused)
            steps = answered(front, slots)
            if steps is not None:
                if steps:
                    return front, steps
                break
            time.sleep(0.05)
        os.kill(front, signal.SIGCONT)
        time.sleep(0.005)
    raise AssertionError(f"no front of {fronts} had a step on its hop in {tries} tries")


@pytest.mark.shapes("fronts")
def test_fronts_killed_and_paused_mid_step_and_mid_transfer_leave_one_owner_and_each_step_once(
    tmp_path: Path,
) -> None:
    """Four robots step episodes that a owns, through a and b, with ``seq``. A front of a is
    paused (SIGSTOP) with a robot's step on its hop, a's other front and b's too; a is
    stopped gracefully (SIGTERM)
    and hands its episodes over to b while b's fronts hold its transfers (mid-transfer);
    then one front of each node is killed (``kill -9``) and the others resumed (SIGCONT).
    With a worker process per device (``[fronts2-workers]``) a has two devices, and the
    worker of one is paused too, with a robot's step in it, before the stop: its episodes'
    states are held there, so their hand-overs wait for it while the other device's
    episodes are transferred; then both of a's workers are killed (``kill -9``) once the
    transfers are under way (an episode whose state went with them is handed over without
    it, said); b's worker is paused while they are (mid-transfer: the robots' steps at b
    wait in it), then resumed with the fronts.
    a exits 0 and leaves no process; afterwards b alone owns every episode (Redis and b's
    own view agree), every reply continues its episode's count or says ``state_reset``, no
    step is applied twice, a retried step gets its kept reply; b killed with ``kill -9``
    leaves no process either."""
    redis = RedisServer(tmp_path)
    model = ["--model", str(counter_policy(tmp_path, repeats=8, width=128))]  # a few ms a step
    extra = [*model, "--drain-timeout", "30"]
    a = Node(tmp_path, "a", redis.url, devices="cpu:1", extra=extra)
    if a.device_workers:  # one device's worker paused, the other's episodes go meanwhile
        a = Node(tmp_path, "a", redis.url, devices="cpu:2", extra=extra)
    b = Node(tmp_path, "b", redis.url, devices="cpu:1", extra=model)
    robots = [Robot(f"fronts-{k}") for k in range(4)]
    done = threading.Event()

    def run(robot: Robot, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=5) as client:  # keep-alive: one front holds it
            for _ in range(50_000):  # (bounded; the test's phases end it: done)
                if done.is_set():
                    return
                if not robot.step(client, rng.choice([a.url, b.url])):
                    time.sleep(0.05)

    with running(redis, [a]), contextlib.ExitStack() as stack:
        stack.callback(b.stop)
        with httpx.Client(timeout=10) as client:
            for robot in robots:  # claimed while a is the only node
                assert robot.step(client, a.url) and robot.step(client, a.url), robot.violations
        b.proc.start()
        wait_until(b.ready, 60, "b ready")
        a_fronts, b_fronts = a.wait_fronts(), b.wait_fronts()
        core = a.pid()
        threads = [threading.Thread(target=run, args=(r, k), daemon=True)
                   for k, r in enumerate(robots)]  # fmt: skip
        for t in threads:
            t.start()
        try:
            wait_until(lambda: all(r.replies >= 5 for r in robots), 60, "robots stepping")
            mid_step, lost = pause_mid_step(a_fronts)  # steps on its hop, served by the core...
            rest = [pid for pid in a_fronts if pid != mid_step]
            a_workers, b_workers = a.workers(), b.workers()
            for pid in a_workers[:1]:  # ...one in a worker of a, stopped there...
                pause(pid)
                worker_mid_step(pid)
            for pid in rest + b_fronts:
                pause(pid)
            os.kill(core, signal.SIGTERM)  # ...and hands its episodes over to b...
            wait_until(
                lambda: tcp_sockets(core, b.port, "01", remote=True), 30, "a's transfer to b"
            )
            for pid in b_workers:
                pause(pid)
            os.kill(mid_step, signal.SIGKILL)  # ...while b's fronts hold the transfer
            os.kill(b_fronts[0], signal.SIGKILL)
            for pid in a_workers:  # its step fails (503): the robot retries it at b
                os.kill(pid, signal.SIGKILL)
            for pid in rest + b_fronts[1:] + b_workers:  # (a front paused past
                with contextlib.suppress(ProcessLookupError):  # --front-hang-timeout: killed)
                    os.kill(pid, signal.SIGCONT)
            assert a.proc.popen is not None and a.proc.popen.wait(60) == 0, a.proc.log()
            wait_until(lambda: not fronts_of(core) and not workers_of(core), 10,
                       "a's fronts and workers gone with a")  # fmt: skip
            after = [r.replies for r in robots]
            wait_until(lambda: all(r.replies >= n + 5 for r, n in zip(robots, after, strict=True)),
                       60, "robots stepping on b")  # fmt: skip
        finally:
            done.set()
            for t in threads:
                t.join(30)
        summary = (f"{sum(r.replies for r in robots)} replies, {sum(r.retries for r in robots)} "
                   f"retries, {sum(r.replayed for r in robots)} kept replies, "
                   f"{sum(r.resets for r in robots)} resets said")  # fmt: skip
        print(summary)
        violations = [v for r in robots for v in r.violations]
        assert not violations, f"{summary}\n" + "\n".join(violations) + "\n" + a.proc.log()
        # the steps on the killed front's hop were applied, their replies lost with the
        # front: each robot's retry (same seq) got the kept reply, or the reset was said (the
        # episode moved without its state)
        by_name = {r.episode: r for r in robots}
        for episode, seq in lost:
            got = by_name[episode].answers[seq]
            assert got["replayed"] or got["state_reset"], f"{lost}: {got}\n{a.proc.log()}"
        keys = redis.client()
        for robot in robots:  # one owner: Redis names b, with the claim that served last
            value = str(keys.get(KEYS.episode(robot.episode))).split(" ")
            assert (value[0], int(value[1])) == ("b/0", robot.tokens[-1]), (robot, value)
        devices = httpx.get(b.url + "/devices", timeout=10).json()
        held = sum(d["local"]["live_episodes"] for d in devices["devices"] if "local" in d)
        assert held == len(robots), devices  # b's own view: it holds every one
        b_core = b.pid()
        os.kill(b_core, signal.SIGKILL)  # the core alone: its fronts and workers go with it
        wait_until(lambda: not fronts_of(b_core) and not workers_of(b_core), 10,
                   "b's fronts and workers gone with b")  # fmt: skip
        b.stop()
