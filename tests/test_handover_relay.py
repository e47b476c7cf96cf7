"""A drain with ``--move`` whose old owner's link to Redis is slower than the new owner's
(issue 41, item 1), with real processes: a relay in the test delays node a's Redis traffic
by 25, 50 or 100 ms each way while ``affinity drain a/0 --move`` moves 120 episodes to b
and their robots keep stepping through both nodes (what a move could not carry stays on a
with its state, a ``move-kept`` event says so, and the drain is run again). Every episode
ends on b with its state: 0 stuck (every step answered within its retries), 0 resets, 0
steps applied twice (each reply is the model after the episode's exact history, its
``seq`` one on).

Run against the code before issue 41's change, the 50 and 100 ms cases failed (25 ms
passed that once): the new owner's flush dropped copies whose commit had not landed yet
and remembered their claims as ended; the late commit then gave each one to a claim its
owner refused: 503 ``owner_refused`` for as long as the robot retried.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from affinity import Keys
from node.models import DEMO_MODEL
from tests.procs import Forwarder, Node, RedisServer, wait_until
from tests.rollout import reference_rollout
from tests.test_handover_procs import cli

pytestmark = pytest.mark.integration
KEYS = Keys()
EPISODES = 120
RETRY_S = 30.0  # a step not answered 200 within this many seconds of retries is stuck


class Robots:
    """The robots: one episode each, stepping with ``seq`` through either node, retrying
    a 503 (as ``affinity.Client`` does) until :data:`RETRY_S`; what each saw."""

    def __init__(self, urls: list[str], count: int) -> None:
        self.urls = urls
        self.clients = [httpx.Client(base_url=u, timeout=10) for u in urls]
        self.rngs = {f"slow-{i}": np.random.default_rng(41 + i) for i in range(count)}
        self.obs: dict[str, list[np.ndarray]] = {ep: [] for ep in self.rngs}
        self.got: dict[str, list[np.ndarray]] = {ep: [] for ep in self.obs}
        self.resets: list[tuple[str, int]] = []
        self.stuck: list[tuple[str, int, str]] = []

    def step(self, ep: str, via: int) -> None:
        n = len(self.got[ep]) + 1
        if len(self.obs[ep]) < n:  # each robot's observations, drawn as it goes
            self.obs[ep].append(self.rngs[ep].standard_normal((1, 8)).astype(np.float32))
        body = {"episode_id": ep, "inputs": {"obs": self.obs[ep][n - 1].tolist()}, "seq": n}
        deadline = time.monotonic() + RETRY_S
        last = ""
        while time.monotonic() < deadline:
            try:
                r = self.clients[via % len(self.clients)].post("/act", json=body)
            except httpx.HTTPError as exc:
                last = repr(exc)
                time.sleep(0.05)
                continue
            if r.status_code == 200:
                reply = r.json()
                if reply["state_reset"]:
                    self.resets.append((ep, n))
                assert reply["seq"] == n, (ep, n, reply)
                self.got[ep].append(np.asarray(reply["outputs"]["actions"], np.float32))
                return
            last = r.text
            if r.status_code != 503:
                break
            time.sleep(0.05)
        self.stuck.append((ep, n, last[:300]))
        raise AssertionError(f"{ep} step {n} was never answered: {last[:300]}")

    def check(self) -> None:
        assert self.stuck == [] and self.resets == []
        for ep, got in self.got.items():
            want = reference_rollout(DEMO_MODEL, self.obs[ep][: len(got)])
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                np.testing.assert_allclose(
                    g.reshape(w["actions"].shape), w["actions"], rtol=1e-5,
                    err_msg=f"{ep} step {i + 1}",
                )  # fmt: skip

    def close(self) -> None:
        for c in self.clients:
            c.close()


@pytest.mark.parametrize("delay_ms", [25, 50, 100])
def test_a_drain_moves_every_episode_though_the_old_owners_redis_link_is_slow(
    tmp_path: Path, delay_ms: int
) -> None:
    redis = RedisServer(tmp_path).start()
    relay = Forwarder(redis.port)
    extra = ["--capacity", "256"]
    a = Node(tmp_path, "a", f"redis://127.0.0.1:{relay.port}/0", devices="cpu:1", extra=extra)
    b = Node(tmp_path, "b", redis.url, devices="cpu:1", extra=extra)
    robots = Robots([a.url], EPISODES)
    try:
        a.start(60)
        eps = list(robots.obs)
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda ep: robots.step(ep, 0), eps))  # all on a (alone)
        b.start(60)
        robots.close()
        robots.clients = [httpx.Client(base_url=u, timeout=10) for u in (a.url, b.url)]
        relay.delay_s = delay_ms / 1000  # a's link to Redis is slow from now on
        db = redis.client()

        def on_b() -> int:
            values = db.mget([KEYS.episode(ep) for ep in eps])
            return sum(str(v).startswith("b/0 ") for v in values)

        cli(redis.url, "drain", "a/0", "--move", "--wait", "0")
        rounds = 0
        with ThreadPoolExecutor(8) as pool:
            while rounds < 60 and (on_b() < len(eps) or rounds < 2):
                # every robot steps once a round, through a and b in turn, while the drain
                # moves them (at a's next renewal)
                list(pool.map(robots.step, eps, [i + rounds for i in range(len(eps))]))
                rounds += 1
                time.sleep(0.1)  # (a's renewal, ≤ a third of its lease, starts the moves)
                if rounds % 15 == 0 and on_b() < len(eps):
                    # what a move could not carry stays on a with its state (a move-kept
                    # event says so, e.g. a's slow link let a placement time out): the
                    # operator runs the drain again
                    cli(redis.url, "drain", "a/0", "--move", "--wait", "0")
            wait_until(lambda: on_b() == len(eps), 60, "every episode on b")
            for extra_round in range(2):  # and each goes on there
                list(pool.map(robots.step, eps, [i + extra_round for i in range(len(eps))]))
        robots.check()
        moved = [f for _, f in db.xrange(KEYS.events) if f.get("type") == "moved"]
        assert {m["episode"] for m in moved} == set(eps)
        kept = {f["episode"] for _, f in db.xrange(KEYS.events) if f.get("type") == "move-kept"}
        assert len(moved) == len(eps) and kept <= set(eps)  # each moved once
        assert not [f for _, f in db.xrange(KEYS.events) if f.get("type") == "reassign"]
    finally:
        robots.close()
        for node in (a, b):
            node.stop()
        relay.close()
        redis.stop()
