"""Issue 41 item 8: a rollout survives Redis losing its data. Each node remembers what it
last read of its models' rollouts (node/rollouts.py) and puts it back
(affinity/lua/restore_rollout.lua): the versions' order ("newest") and the operator's
weights, with a ``rollout-restore`` event and a log line; never a rollout an operator
cleared while Redis kept its data."""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from affinity import Keys, Settings
from affinity.models import Models, Rollout
from node.rollouts import RolloutMemory
from tests.procs import Node, RedisServer, wait_until

KEYS = Keys()
DEMO = "demo_policy"


@pytest.mark.anyio
async def test_a_node_puts_back_the_order_and_weights_redis_lost_and_no_cleared_rollout(
    redis: Any, caplog: pytest.LogCaptureFixture
) -> None:
    models = Models(redis, Settings())
    await redis.zadd(KEYS.versions(DEMO), {"v1": 1000, "v2": 2000})
    await models.rollout(DEMO, "v1", 3)
    await models.rollout(DEMO, "v2", 1)
    memory = RolloutMemory(models, [DEMO, DEMO])
    await memory.sync()  # the first read: nothing to put back
    assert memory.last == {DEMO: Rollout({"v1": 1000, "v2": 2000}, {"v1": 3, "v2": 1})}
    # Redis restarts empty; v2's node re-registers first, v1's last: v1 is "newest" now
    await redis.flushdb()
    await redis.zadd(KEYS.versions(DEMO), {"v2": 5000}, nx=True)
    await redis.zadd(KEYS.versions(DEMO), {"v1": 6000}, nx=True)
    with caplog.at_level(logging.WARNING, "affinity.node"):
        await memory.sync()
    assert await redis.zrange(KEYS.versions(DEMO), 0, -1, withscores=True) == [
        ("v1", 1000),
        ("v2", 2000),
    ]
    assert await redis.hgetall(KEYS.rollout(DEMO)) == {"v1": "3", "v2": "1"}
    [event] = [f for _, f in await redis.xrange(KEYS.events) if f["type"] == "rollout-restore"]
    assert event == {"type": "rollout-restore", "model": DEMO,
                     "versions": "v1:1000,v2:2000", "weights": "v1=3,v2=1"}  # fmt: skip
    assert "Redis lost model demo_policy's rollout" in caplog.text
    # an operator clears the rollout, Redis keeps its data: never put back
    assert await models.clear_rollout(DEMO)
    await memory.sync()
    await memory.sync()
    assert await redis.hgetall(KEYS.rollout(DEMO)) == {}
    assert memory.last[DEMO].weights == {}
    assert (
        len([f for _, f in await redis.xrange(KEYS.events) if f["type"] == "rollout-restore"]) == 1
    )
    # an operator's rollout made after a loss, before the node put its memory back, wins
    await models.rollout(DEMO, "v2", 5)
    await memory.sync()
    await redis.flushdb()
    await redis.zadd(KEYS.versions(DEMO), {"v1": 7000, "v2": 7000})
    await redis.hset(KEYS.rollout(DEMO), "v1", "9")
    await memory.sync()
    assert await redis.hgetall(KEYS.rollout(DEMO)) == {"v1": "9"}
    assert await redis.zrange(KEYS.versions(DEMO), 0, -1, withscores=True) == [
        ("v1", 1000),
        ("v2", 2000),
    ]


@pytest.mark.integration
def test_a_canary_keeps_its_share_after_redis_restarts_empty(tmp_path: Path) -> None:
    """Real processes and a real redis-server killed and started empty: before, the
    weights were gone and the version that re-registered last took every new episode. Run
    without the node's hook (node/service.py), as before: the weights never came back."""
    redis = RedisServer(tmp_path).start()
    extra = ["--lease-ttl", "2"]
    old = Node(tmp_path, "old", redis.url, devices="cpu:1",
               extra=[*extra, "--model", f"{DEMO}=demo@v1"])  # fmt: skip
    new = Node(tmp_path, "new", redis.url, devices="cpu:1",
               extra=[*extra, "--model", f"{DEMO}=demo@v2"])  # fmt: skip
    try:
        old.start()
        new.start()
        r = redis.client()
        r.hset(KEYS.rollout(DEMO), mapping={"v1": 3, "v2": 1})  # as `affinity rollout` writes
        before = r.zrange(KEYS.versions(DEMO), 0, -1, withscores=True)
        assert [v for v, _ in before] == ["v1", "v2"]

        def renewed_twice(node: Node) -> Any:
            def count() -> float:
                text = httpx.get(node.url + "/metrics", timeout=2).text
                ok = 'affinity_lease_renewals_total{result="ok"}'
                lines = [s for s in text.splitlines() if s.startswith(ok)]
                return float(lines[0].split()[-1]) if lines else 0.0  # none yet

            start = count()
            return lambda: count() >= start + 2

        waits = [renewed_twice(n) for n in (old, new)]  # each read the weights since
        wait_until(lambda: all(w() for w in waits), 60, "two renewals on each node")
        redis.restart()  # empty: the nodes re-register, v1's may well be last
        wait_until(lambda: r.hgetall(KEYS.rollout(DEMO)) == {"v1": "3", "v2": "1"}, 60,
                   "the weights put back")  # fmt: skip
        assert r.zrange(KEYS.versions(DEMO), 0, -1, withscores=True) == before
        assert any(f["type"] == "rollout-restore" for _, f in r.xrange(KEYS.events))
        assert "Redis lost model demo_policy's rollout" in old.proc.log() + new.proc.log()
        got: Counter[str] = Counter()
        for i in range(4):  # after the grace period: 3 of 4 new episodes to v1
            for _ in range(60):
                step = {"episode_id": f"after-{i}", "model": DEMO, "inputs": {"obs": [[0.1] * 8]}}
                resp = httpx.post(old.url + "/act", timeout=10, json=step)
                if resp.status_code != 503:
                    break
                time.sleep(float(resp.headers.get("retry-after", "0.5")))
            assert resp.status_code == 200, resp.text
            got[resp.json()["model"]] += 1  # the version the new episode took
        assert got == {f"{DEMO}@v1": 3, f"{DEMO}@v2": 1}
    finally:
        old.stop()
        new.stop()
        redis.stop()
