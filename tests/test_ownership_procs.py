"""Owner-authoritative hits with real processes (issue 22): ``redis-server`` SIGSTOPped
while episodes step at their owners and through another node. Every step during the
pause is served, each from the state its episode's history left (the demo policy's
recurrent state tells the history apart); a new episode gets a 503 with Retry-After."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from node.models import DEMO_MODEL
from tests.procs import Node, RedisServer
from tests.rollout import reference_rollout
from tests.test_cluster import running

pytestmark = [pytest.mark.integration, pytest.mark.shapes]


def test_steps_at_owners_and_through_routers_go_on_while_redis_is_paused(
    tmp_path: Path,
) -> None:
    redis = RedisServer(tmp_path)
    lease = ["--lease-ttl", "10"]
    a = Node(tmp_path, "a", redis.url, devices="cpu:1", extra=lease)
    b = Node(tmp_path, "b", redis.url, devices="cpu:1", extra=lease)
    rng = np.random.default_rng(22)
    obs = {f"p{i}": [rng.standard_normal((1, 8)).astype(np.float32) for _ in range(40)]
           for i in range(4)}  # fmt: skip
    history: dict[str, list[np.ndarray]] = {ep: [] for ep in obs}
    owner: dict[str, str] = {}
    urls = {"a": a.url, "b": b.url}
    with running(redis, [a, b]), httpx.Client(timeout=10) as client:

        def step(ep: str, i: int, via: str) -> None:
            body = {"episode_id": ep, "inputs": {"obs": obs[ep][i].tolist()}}
            r = client.post(urls[via] + "/act", json=body)
            assert r.status_code == 200, (ep, i, via, r.text)
            doc = r.json()
            assert not doc["state_reset"], doc
            owner[ep] = doc["node"]
            history[ep].append(obs[ep][i])
            want = reference_rollout(DEMO_MODEL, history[ep])[-1]["actions"]
            np.testing.assert_allclose(doc["outputs"]["actions"], want, rtol=1e-5)

        def other(node: str) -> str:
            return "b" if node == "a" else "a"

        # p0, p1 step at their owners; p2, p3 through the other node (which finds the owner
        # once, then forwards without asking Redis)
        for i in range(3):
            for n, ep in enumerate(obs):
                via = owner.get(ep, "a")
                step(ep, i, via if n < 2 else other(via))
        redis.proc.send(signal.SIGSTOP)
        try:
            for i in range(3, 30):
                for n, ep in enumerate(obs):
                    step(ep, i, owner[ep] if n < 2 else other(owner[ep]))
            new = client.post(
                a.url + "/act", json={"episode_id": "new", "inputs": {"obs": [[0] * 8]}}
            )
            assert new.status_code == 503 and new.json()["error"]["code"] in ("redis", "busy")
            assert int(new.headers["retry-after"]) >= 1
        finally:
            redis.proc.send(signal.SIGCONT)
        for i in range(30, 40):
            for n, ep in enumerate(obs):
                step(ep, i, owner[ep] if n < 2 else other(owner[ep]))


def test_a_redis_restarted_from_an_older_snapshot_has_the_owner_drop_what_it_lost(
    tmp_path: Path,
) -> None:
    """Redis restarts from a snapshot taken before the claim of ``lost`` (the fleet marker
    survives: no grace period), so another node may claim ``lost`` again while its owner
    serves it from memory. The owner's next renewal sees another ``run_id`` and its next
    flush checks every record: ``lost`` is dropped there (its steps go to the claim Redis
    holds), ``kept`` goes on at its owner with its state."""
    redis = RedisServer(tmp_path)
    lease = ["--lease-ttl", "6"]
    a = Node(tmp_path, "a", redis.url, devices="cpu:1", extra=lease)
    b = Node(tmp_path, "b", redis.url, devices="cpu:1", extra=lease)
    rng = np.random.default_rng(7)
    urls = {"a": a.url, "b": b.url}
    history: dict[str, list[np.ndarray]] = {}
    with running(redis, [a, b]), httpx.Client(timeout=10) as client:

        def step(ep: str, via: str) -> dict[str, object]:
            """One step (no token echoed: the client does not help); checked against the
            history of the claim that served it (each claim has its own state)."""
            x = rng.standard_normal((1, 8)).astype(np.float32)
            body = {"episode_id": ep, "inputs": {"obs": x.tolist()}}
            r = client.post(urls[via] + "/act", json=body)
            assert r.status_code == 200, (ep, via, r.text)
            doc: dict[str, object] = r.json()
            claim = f"{ep} {doc['device']} {doc['token']}"
            history.setdefault(claim, []).append(x)
            want = reference_rollout(DEMO_MODEL, history[claim])[-1]["actions"]
            got = np.asarray(doc["outputs"]["actions"])  # type: ignore[index]
            np.testing.assert_allclose(got, want, rtol=1e-5)
            return doc

        def claim_at_a(prefix: str) -> str:
            for i in range(50):
                if step(f"{prefix}{i}", "a")["node"] == "a":
                    return f"{prefix}{i}"
            raise AssertionError("no episode landed on a")

        kept = claim_at_a("kept-")
        r = redis.client()
        assert r.save()  # the snapshot: kept's claim is in it
        lost = claim_at_a("lost-")
        for _ in range(3):
            assert step(kept, "a")["routing"] == "hit"
            assert step(lost, "a")["routing"] == "hit"
        time.sleep(2.5)  # a's first flush slid both: their next slides are minutes away
        r.close()
        redis.proc.stop(signal.SIGKILL)
        redis.start(new_fleet=False)  # loads the older snapshot: lost's claim is gone
        r = redis.client()
        assert r.exists(f"{{affinity}}:episode:{kept}") and not r.exists(
            f"{{affinity}}:episode:{lost}"
        )
        # a/0 takes no new episodes (drain moves none), so b's claim lands on b/0
        drained = subprocess.run(
            [sys.executable, "-m", "affinity.cli", "--redis", redis.url, "drain", "a/0"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert drained.returncode == 0, drained.stderr
        again = step(lost, "b")  # b claims it anew: Redis knows no owner
        assert (again["routing"], again["device"]) == ("claimed", "b/0")
        holder = str(r.get(f"{{affinity}}:episode:{lost}")).split()
        # a drops its record at its next renewal + flush (a third of the lease + 1 s);
        # until then a step sent to a may still be served there from memory
        deadline = time.monotonic() + 60
        while True:
            doc = step(lost, "a")
            if doc["device"] == holder[0] and str(doc["token"]) == holder[1]:
                break
            assert doc["node"] == "a" and time.monotonic() < deadline, doc
            time.sleep(0.2)
        for _ in range(3):
            doc = step(lost, "a")
            assert (doc["device"], str(doc["token"])) == (holder[0], holder[1])
            assert step(kept, "a")["state_reset"] is False
        assert "another Redis server answers now" in a.proc.log()
        r.close()
