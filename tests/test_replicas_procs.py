"""A lossy failover under real nodes with ``--redis-replicas 1`` (issue 22): a primary and
a replica ``redis-server`` on loopback, two ``affinity-node`` processes that reach the
primary through a TCP forwarder the test re-points, as a failover re-points clients.

The replica is SIGSTOPped and its link cut (``CLIENT KILL TYPE replica``), so it misses
every write from then on (a stopped replica alone would read them from its socket's
buffer once resumed: no loss); a claim made then is
answered 503 ``not_replicated`` and never served. Then the primary is SIGKILLed with
those writes, the replica resumes and is promoted (``REPLICAOF NO ONE``), a new replica
joins it and the forwarder points at it. Every step is checked against a counting model
of its episode (the demo policy's recurrent state tells every history apart): the
acknowledged episodes go on at their owners with no reset and no step lost or applied
twice, and the unacknowledged one is claimed cleanly, once."""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis

from affinity import Keys
from node.models import DEMO_MODEL
from tests.procs import Forwarder, Node, RedisServer, wait_until
from tests.rollout import reference_rollout
from tests.test_replicas import SYNC, calls, replica_of

pytestmark = [pytest.mark.integration, pytest.mark.shapes]

KEYS = Keys()
LEASE = 15.0  # far longer than the failover takes, even on a busy machine
EPISODES = 8
STEPS = 40


class Model:
    """Each episode's observations, the ones applied (in order) and every reply."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.obs = {
            f"e{i}": [rng.standard_normal((1, 8)).astype(np.float32) for _ in range(STEPS)]
            for i in range(EPISODES)
        }
        self.obs["late"] = [rng.standard_normal((1, 8)).astype(np.float32) for _ in range(STEPS)]
        self.applied: dict[str, list[np.ndarray]] = {ep: [] for ep in self.obs}
        self.replies: dict[str, list[dict[str, Any]]] = {ep: [] for ep in self.obs}

    def step(self, client: httpx.Client, url: str, ep: str) -> httpx.Response:
        """Send the episode's next step to ``url``; a 200 must be the counting model's next
        action (its whole history applied once each, in order, on one state)."""
        i = len(self.applied[ep])
        body: dict[str, Any] = {"episode_id": ep, "inputs": {"obs": self.obs[ep][i].tolist()}}
        if self.replies[ep]:
            body["token"] = self.replies[ep][-1]["token"]
        r = client.post(url + "/act", json=body)
        if r.status_code == 200:
            doc = r.json()
            assert not doc["state_reset"], (ep, doc)
            self.applied[ep].append(self.obs[ep][i])
            self.replies[ep].append(doc)
            want = reference_rollout(DEMO_MODEL, self.applied[ep])[-1]["actions"]
            np.testing.assert_allclose(doc["outputs"]["actions"], want, rtol=1e-4, atol=1e-6)
        return r

    def owner(self, ep: str) -> str:
        return str(self.replies[ep][-1]["node"])

    def places(self, ep: str) -> set[tuple[str, str, int]]:
        return {(d["node"], d["device"], d["token"]) for d in self.replies[ep]}


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[RedisServer]]:
    """Started by the test; every one is killed at the end."""
    started: list[RedisServer] = []
    yield started
    for s in started:
        s.stop()


def test_a_lossy_failover_never_makes_two_owners(
    tmp_path: Path, servers: list[RedisServer]
) -> None:
    primary = RedisServer(tmp_path, extra=SYNC)
    servers.append(primary)
    primary.start()
    replica = replica_of(tmp_path, primary)
    servers.append(replica)
    forwarder = Forwarder(primary.port)
    url = f"redis://127.0.0.1:{forwarder.port}/0"
    # a generous WAIT: on a busy machine the replica still acknowledges every write in
    # time (the stopped one never does; only the steps that show it wait this long)
    extra = ["--lease-ttl", str(LEASE), "--redis-replicas", "1", "--redis-wait", "1",
             "--capacity", "50", "--act-deadline", "8"]  # fmt: skip
    env = {"AFFINITY_CLUSTER_SECRET": "s", "AFFINITY_REDIS_TIMEOUT": "3",
           "AFFINITY_REDIS_DEADLINE": "6"}  # fmt: skip
    nodes = [Node(tmp_path, n, url, devices="cpu:2", extra=extra, env=env) for n in ("a", "b")]
    urls = {n.node_id: n.url for n in nodes}
    model = Model(22)
    rng = random.Random(22)
    acked = [f"e{i}" for i in range(EPISODES)]
    try:
        for n in nodes:
            n.start(timeout=60)
        with httpx.Client(timeout=15) as client:
            # (a) claims and steps through any node, every claim WAITed
            before = (calls(primary.client(), "evalsha"), calls(primary.client(), "wait"))
            for ep in acked:
                r = model.step(client, rng.choice(list(urls.values())), ep)
                assert r.status_code == 200 and r.json()["routing"] == "claimed", r.text
            assert calls(primary.client(), "wait") - before[1] >= EPISODES
            for _ in range(3):
                for ep in acked:
                    assert (
                        model.step(client, rng.choice(list(urls.values())), ep).status_code == 200
                    )

            # steps at their owners issue no Redis command. Every command the request
            # path sends is a script, and so is each background write: a renewal, at most
            # one flush per node, and one renewal per node in flight as the window closes
            # (not yet counted). Forty steps against that: one script a step would show.
            renewals = sum(renewed(n) for n in nodes)
            watch = primary.client()  # one connection: its own handshake is not counted
            stats = commandstats(watch)
            for _ in range(5):
                for ep in acked:
                    assert model.step(client, urls[model.owner(ep)], ep).status_code == 200
            after = commandstats(watch)
            renewals = sum(renewed(n) for n in nodes) - renewals
            ran = {k: d for k, v in after.items() if (d := v - stats.get(k, 0))}
            assert ran.get("evalsha", 0) <= renewals + 2 * len(nodes), (ran, renewals)
            assert ran.get("wait", 0) <= ran.get("evalsha", 0), ran

            # (b) the replica misses every write from now on: stopped, and cut off (what was
            # sent before is in its socket's buffer; nothing after is sent at all)
            replica.proc.send(signal.SIGSTOP)
            primary.client().client_kill_filter(_type="replica")
            wait_until(lambda: not primary.client().info("replication")["connected_slaves"],
                       30, "the replica cut off")  # fmt: skip
            r = model.step(client, urls["a"], "late")
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "not_replicated"
            assert int(r.headers["retry-after"]) >= 1
            assert primary.client().get(KEYS.episode("late")) is None  # released again
            for ep in acked:  # the owners go on from memory
                assert model.step(client, urls[model.owner(ep)], ep).status_code == 200

            # the failover: the primary dies with what the replica missed
            primary.stop()
            replica.proc.send(signal.SIGCONT)
            replica.client().replicaof("no", "one")
            wait_until(lambda: replica.client().info("replication")["role"] == "master", 30,
                       "the replica promoted")  # fmt: skip
            replica.client().config_set("repl-diskless-sync-delay", "0")
            servers.append(replica_of(tmp_path, replica))
            forwarder.point(replica.port)

            for _ in range(4):
                for ep in [*acked, "late"]:
                    via = rng.choice(list(urls.values()))
                    for _ in range(100):  # bounded: until the nodes reach the new primary
                        r = model.step(client, via, ep)
                        if r.status_code == 200:
                            break
                        assert r.status_code == 503, r.text
                        time.sleep(0.1)
                    assert r.status_code == 200, r.text
            for _ in range(3):
                for ep in [*acked, "late"]:
                    assert (
                        model.step(client, rng.choice(list(urls.values())), ep).status_code == 200
                    )
        new = replica.client()
        for ep in acked:  # one owner, one device, one claim, all along
            assert len(model.places(ep)) == 1, (ep, model.places(ep))
            _, device, token = model.places(ep).pop()
            assert new.get(KEYS.episode(ep)).startswith(f"{device} {token} ")
        late = model.replies["late"]
        assert late[0]["routing"] == "claimed" and len(model.places("late")) == 1
        assert [d["seq"] for d in late] == list(range(1, len(late) + 1))
    finally:
        forwarder.close()
        for n in nodes:
            n.stop()


def renewed(node: Node) -> int:
    """The renewals ``node`` counted (every result)."""
    text = httpx.get(node.url + "/metrics", timeout=5).text
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("affinity_lease_renewals_total{")
    )


def commandstats(r: redis.Redis) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in r.info("commandstats").items()}
