"""Scored placement at the node (issue 46): step times measured per batch size, scores
published at each renewal and again after Redis lost them, the claim's gate as 503 slo."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from affinity import Keys
from node.placement import COUNT_EVERY, NOMINAL_COST_MS, StepTimes
from tests.inproc import cluster, config

pytestmark = pytest.mark.anyio

KEYS = Keys()
OBS = {"obs": [[0.1] * 8]}


def test_step_times_per_batch_size() -> None:
    t = StepTimes(max_batch=4)
    assert t.score("d", 0, 0.0) == (0.0, NOMINAL_COST_MS)  # never measured: tried first
    t.ran("d", (1, 0.010))
    t.ran("d", (4, 0.016))
    assert t.run_ms("d", 1) == pytest.approx(10.0)
    assert t.run_ms("d", 2) == pytest.approx(12.0)  # between the sizes seen: linear
    t.ran("d", (1, 0.020))  # an EWMA: a new run weighs 0.2
    assert t.run_ms("d", 1) == pytest.approx(12.0)
    assert t.run_ms("d", 8) == pytest.approx(32.0)  # beyond: proportionally slower
    t.ran("d", (2, float("nan")))  # nothing measured: ignored
    assert t.run_ms("d", 2) == pytest.approx(12 + 4 / 3)


def test_runs_noted_on_many_threads_are_all_counted_in_order() -> None:
    t = StepTimes(max_batch=4)
    runs = [(1, 0.001 * (n % 7 + 1)) for n in range(COUNT_EVERY + 3)]
    for run in runs:  # past COUNT_EVERY: counted once without a read
        t.ran("d", run)
    expected = None
    for _, seconds in runs:  # the same EWMA, run by run
        ms = seconds * 1000
        expected = ms if expected is None else expected + 0.2 * (ms - expected)
    assert t.run_ms("d", 1) == pytest.approx(expected)

    def worker(device: str) -> None:
        for _ in range(3 * COUNT_EVERY):
            t.ran(device, (2, 0.004))

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(3)]
    for thread in threads:
        thread.start()
    for _ in range(50):  # reads while the workers note runs
        t.run_ms("w0", 2)
    for thread in threads:
        thread.join()
    scores = t.scores([(0, "w0"), (1, "w1"), (2, "w2")], lambda device: 1, capacity=4)
    assert len(scores) == 3
    assert all(t.run_ms(f"w{i}", 2) == pytest.approx(4.0) for i in range(3))


def test_step_time_follows_the_load_and_explodes_past_it() -> None:
    t = StepTimes(max_batch=4)
    t.ran("d", (1, 0.010))
    t.ran("d", (4, 0.016))  # t(b) = 8 + 2b ms
    # idle between steps (1 episode at 0.01 steps/ms): a batch of 1, its wait and its run
    assert t.step_ms("d", 1, 0.01) == pytest.approx(20.0)
    # 10 episodes at 20 Hz (0.2 steps/ms): b = 0.2 t(b) settles at 2.8, run as 3 (14 ms)
    assert t.step_ms("d", 10, 0.02) == pytest.approx(28.0)
    # 30 episodes: 0.6 x 16 = 9.6 steps arrive during a full run of 4: unbounded queue
    over = t.step_ms("d", 30, 0.02)
    assert over is not None and over > 2 * 32.0
    step, cost = t.score("d", 0, 0.02)
    assert step == pytest.approx(20.0) and cost == pytest.approx(10.0 / 4)  # t(1) / B


def test_scores_measure_each_episodes_step_rate() -> None:
    now = [0.0]
    t = StepTimes(max_batch=4, clock=lambda: now[0])
    t.ran("d", (1, 0.010))
    t.ran("d", (4, 0.016))
    for _ in range(399):  # 404 rows in 1 s over 20 episodes: about 20 Hz each
        t.ran("d", (1, 0.010))
    now[0] = 1.0
    live = {"d": 20, "e": 8}
    scores = t.scores([(0, "d"), (1, "e")], live.__getitem__, capacity=8 * 4)
    assert [s.index for s in scores] == [0, 1]
    assert scores[0].step_ms == pytest.approx(t.step_ms("d", 21, 404 / 1000 / 20))
    assert scores[1].step_ms == 0.0  # never ran: tried first
    full = t.scores([(0, "d")], {"d": 32}.__getitem__, capacity=32)
    assert full == []  # no room: nothing published


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
