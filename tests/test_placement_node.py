"""Scored placement at the node (issue 46): step times measured per batch size, scores
published at each renewal and again after Redis lost them, the claim's gate as 503 slo."""

from __future__ import annotations

from typing import Any

import pytest

from affinity import Keys
from node.placement import NOMINAL_COST_MS, StepTimes
from tests.inproc import cluster, config

pytestmark = pytest.mark.anyio

KEYS = Keys()
OBS = {"obs": [[0.1] * 8]}


def test_step_times_per_batch_size() -> None:
    t = StepTimes(max_batch=4)
    assert t.score("d", 0) == (0.0, NOMINAL_COST_MS)  # never measured: tried, then measured
    t.ran("d", (1, 0.010))
    t.ran("d", (4, 0.016))
    assert t.run_ms("d", 1) == pytest.approx(10.0)
    assert t.run_ms("d", 2) == pytest.approx(12.0)  # between the sizes seen: linear
    t.ran("d", (1, 0.020))  # an EWMA: a new run weighs 0.2
    assert t.run_ms("d", 1) == pytest.approx(12.0)
    # 5 episodes in batches of 4: two runs at batch 4
    assert t.step_ms("d", 5) == pytest.approx(32.0)
    step, cost = t.score("d", 1)  # one held: a new one sees batch 2
    assert step == pytest.approx(12 + 4 / 3) and cost == pytest.approx(4 / 3)
    scores = t.scores([(0, "d"), (1, "e")], {"d": 3, "e": 8}.__getitem__, capacity=8)
    assert [s.index for s in scores] == [0]  # e is full: not published
    t.ran("d", (2, float("nan")))  # nothing measured: ignored
    assert t.run_ms("d", 2) == pytest.approx(12 + 4 / 3)


async def test_renewal_publishes_measured_scores_and_again_after_redis_restart(
    redis: Any,
) -> None:
    async with cluster(redis, [config("a", placement="scored")]) as (nodes, _):
        n = nodes[0]
        s = n.service
        r = await n.act(episode_id="ep", inputs=OBS)
        assert r.status_code == 200
        device = r.json()["device"]
        await s.lease.renew_once()
        _, step, cost = (await redis.hget(KEYS.scored, device)).split(" ")
        assert float(step) > 0 and float(cost) > 0  # measured: its model ran
        index = await redis.keys(KEYS.score_prefix + "*")
        assert len(index) == 1 and set(await redis.zrange(index[0], 0, -1)) == set(s.device_ids)
        await redis.flushall()  # Redis restarted empty
        assert await s.lease.renew_once()  # registers again
        await s.lease.renew_once()  # the next renewal publishes again
        assert set(await redis.zrange(index[0], 0, -1)) == set(s.device_ids)
        assert await redis.hget(KEYS.scored, device)
