"""Owner-authoritative hits with real processes (issue 22): ``redis-server`` SIGSTOPped
while episodes step at their owners and through another node. Every step during the
pause is served, each from the state its episode's history left (the demo policy's
recurrent state tells the history apart); a new episode gets a 503 with Retry-After."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import numpy as np
import pytest

from node.policy import DEMO_MODEL, reference_rollout
from tests.procs import Node, RedisServer
from tests.test_cluster import running

pytestmark = pytest.mark.integration


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
