"""Scored placement (issue 46): the claim takes the device with the lowest published step
time, moves its score by the episode's cost, refuses with ``slo`` past the control-period
gate, and prefers a re-claim's hashed device. fakeredis and a real Redis, same bodies."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from affinity import NoCapacity
from affinity.models import ModelId
from affinity.registry import DeviceScore
from tests.conftest import Env, cpu_devices

pytestmark = pytest.mark.anyio

DEMO1, DEMO2 = ModelId("demo", "v1"), ModelId("demo", "v2")


def point(text: str) -> int:
    """lib.lua's hash_of: djb2 over the bytes, then a multiplicative mix, mod 2^32."""
    h = 5381
    for b in text.encode():
        h = (h * 33 + b) % 2**32
    return (h * 2654435761) % 2**32


async def serve(
    env: Env, node: str, *models: ModelId, n: int = 2, capacity: int = 100, weight: int = 1
) -> None:
    devices = cpu_devices(n, capacity=capacity, weights=[weight] * n, uuid_prefix=node)
    await env.registry.register(
        node, f"http://{node}.test:8000", devices, version="t",
        models={m: '{"inputs": []}' for m in models},
    )  # fmt: skip


async def publish(env: Env, node: str, *scores: tuple[int, float, float]) -> None:
    renewal = await env.registry.renew(node, scores=[DeviceScore(*s) for s in scores])
    assert renewal is not None


async def claim(env: Env, episode: str, limit_ms: float | None = None, **kw: str):  # type: ignore[no-untyped-def]
    return await env.claims.resolve(
        episode, model="demo", placement="scored", limit_ms=limit_ms, **kw
    )


async def test_best_device_wins(env: Env) -> None:
    await serve(env, "a", DEMO1)
    await serve(env, "b", DEMO1)
    await publish(env, "a", (0, 30.0, 1.0), (1, 12.0, 1.0))
    await publish(env, "b", (0, 20.0, 1.0), (1, 8.0, 1.0))
    first = await claim(env, "e1")
    assert first.device == "b/1"
    index = env.keys.scores("demo@v1")
    # its score moved by the episode's cost, in the same script
    assert await env.redis.zscore(index, "b/1") == pytest.approx(9.0)
    # round-robin still takes the ring's stride, unchanged
    rr = await env.claims.resolve("r1", model="demo")
    assert rr.device == "a/0"


async def test_burst_spreads(env: Env) -> None:
    await serve(env, "a", DEMO1)
    await publish(env, "a", (0, 10.0, 2.0), (1, 11.0, 2.0))
    devices = [(await claim(env, f"e{i}")).device for i in range(10)]
    # a/0: 10, 12, 14, ... ; a/1: 11, 13, ...: they alternate, never pile on one
    assert devices == ["a/0", "a/1"] * 5


async def test_gate_refuses_with_slo(env: Env) -> None:
    await serve(env, "a", DEMO1)
    await publish(env, "a", (0, 45.0, 5.0), (1, 48.0, 5.0))
    # 20 Hz x 0.8 headroom: 40 ms; both predict more: refused, nothing written
    with pytest.raises(NoCapacity) as refused:
        await claim(env, "e1", limit_ms=40.0)
    assert refused.value.reason == "slo"
    assert await env.redis.get(env.keys.episode("e1")) is None
    slo = [f for _, f in await env.events.events() if f["type"] == "slo"]
    assert slo and slo[-1]["episode"] == "e1" and slo[-1]["limit_ms"] == "40.000"
    # a looser period qualifies a/0, whose score then passes the gate no more
    assert (await claim(env, "e2", limit_ms=49.0)).device == "a/0"
    assert (await claim(env, "e3", limit_ms=49.0)).device == "a/1"
    with pytest.raises(NoCapacity):
        await claim(env, "e4", limit_ms=49.0)
    # without a control rate the gate is off
    assert (await claim(env, "e5")).device == "a/0"


async def test_drained_down_and_full_devices_never_win(env: Env) -> None:
    await serve(env, "a", DEMO1, n=3, capacity=1)
    await publish(env, "a", (0, 1.0, 1.0), (1, 2.0, 1.0), (2, 50.0, 1.0))
    await env.registry.drain("a/0")
    await env.registry.set_state("a/1", "down", "test")
    index = env.keys.scores("demo@v1")
    assert await env.redis.zrange(index, 0, -1) == ["a/2"]
    # a renewal that publishes them again does not bring them back while they cannot serve
    await publish(env, "a", (0, 1.0, 1.0), (1, 2.0, 1.0), (2, 50.0, 1.0))
    assert await env.redis.zrange(index, 0, -1) == ["a/2"]
    assert (await claim(env, "e1")).device == "a/2"
    assert await env.redis.zrange(index, 0, -1) == []  # full: out of the index
    with pytest.raises(NoCapacity) as full:
        await claim(env, "e2")
    assert full.value.reason == "at_capacity"
    await env.registry.undrain("a/0")
    await publish(env, "a", (0, 1.0, 1.0))
    assert (await claim(env, "e3")).device == "a/0"


async def test_a_dead_nodes_devices_never_win(env: Env) -> None:
    await serve(env, "a", DEMO1)
    await serve(env, "b", DEMO1)
    await publish(env, "a", (0, 1.0, 1.0), (1, 1.0, 1.0))
    await publish(env, "b", (0, 9.0, 1.0), (1, 9.0, 1.0))
    await env.lapse("a")  # its lease ran out, nobody noticed yet
    assert {(await claim(env, f"e{i}")).device for i in range(4)} == {"b/0", "b/1"}
    assert set(await env.redis.zrange(env.keys.scores("demo@v1"), 0, -1)) == {"b/0", "b/1"}


async def test_weights_hold_their_shares(env: Env) -> None:
    await serve(env, "a", DEMO1, n=1, weight=3)
    await serve(env, "b", DEMO1, n=1, weight=1)
    await publish(env, "a", (0, 10.0, 1.0))
    await publish(env, "b", (0, 10.0, 1.0))
    # weighted scores 10/3 and 10: a/0 takes 20 (cost 1/3 each) until they meet, then
    # every 4 claims go 3 to a/0, 1 to b/0 (each one's cost / weight)
    first = [(await claim(env, f"e{i}")).device for i in range(20)]
    assert first == ["a/0"] * 20
    picks = Counter([(await claim(env, f"f{i}")).device for i in range(40)])
    assert picks == {"a/0": 30, "b/0": 10}
    # the gate judges the step time itself (score x weight), not the weighted score
    await publish(env, "a", (0, 30.0, 1.0))
    await publish(env, "b", (0, 10.0, 1.0))
    assert (await claim(env, "g", limit_ms=20.0)).device == "b/0"


async def test_rollouts_hold_their_shares(env: Env) -> None:
    await serve(env, "a", DEMO1)
    await serve(env, "b", DEMO2)
    await env.models.rollout("demo", "v1", 1)
    await env.models.rollout("demo", "v2", 3)
    await publish(env, "a", (0, 1.0, 0.1), (1, 1.0, 0.1))
    await publish(env, "b", (0, 50.0, 0.1), (1, 50.0, 0.1))
    picks = Counter([(await claim(env, f"e{i}")).model for i in range(40)])
    # the version first, by the operator's weights, whatever the versions' step times
    assert picks == {"demo@v1": 10, "demo@v2": 30}


async def test_a_node_that_stops_publishing_ages_out(env: Env) -> None:
    await serve(env, "a", DEMO1)
    await serve(env, "b", DEMO1)
    await publish(env, "a", (0, 5.0, 1.0), (1, 5.0, 1.0))
    await publish(env, "b", (0, 9.0, 1.0), (1, 9.0, 1.0))
    # a's scores expire with the lease it was granted when it published them
    for d in ("a/0", "a/1"):
        _, step, cost = (await env.redis.hget(env.keys.scored, d)).split(" ")
        await env.redis.hset(env.keys.scored, d, f"1 {step} {cost}")
    assert (await claim(env, "e1")).device == "b/0"
    # the claim removed the expired entries it met (at most a few: no scan)
    assert await env.redis.zrange(env.keys.scores("demo@v1"), 0, -1) == ["b/1", "b/0"]


async def test_scores_come_back_after_redis_restart(env: Env) -> None:
    await serve(env, "a", DEMO1)
    await publish(env, "a", (0, 5.0, 1.0), (1, 3.0, 1.0))
    await env.redis.flushall()  # Redis restarted empty
    assert await env.registry.renew("a") is None  # the node registers again
    await serve(env, "a", DEMO1)
    await publish(env, "a", (0, 5.0, 1.0), (1, 3.0, 1.0))  # its next renewal
    await env.redis.delete(env.keys.fleet)  # (the grace period is test_claims.py's)
    await env.registry.new_fleet()
    assert await env.redis.zrange(env.keys.scores("demo@v1"), 0, -1, withscores=True) == [
        ("a/1", 3.0),
        ("a/0", 5.0),
    ]
    assert (await claim(env, "e1")).device == "a/1"


async def test_reclaim_prefers_its_hashed_device_within_the_load_bound(env: Env) -> None:
    await serve(env, "a", DEMO1, n=4, capacity=10)
    await serve(env, "b", DEMO1, n=4, capacity=10)
    await publish(env, "a", *((i, 5.0, 0.0) for i in range(4)))
    await publish(env, "b", *((i, 5.0, 0.0) for i in range(4)))
    await env.redis.set(env.keys.view, json.dumps({"at": 0, "models": {"demo@v1": [0, 80]}}))
    first = await claim(env, "ep")
    # its owner fails over: the re-claim goes where the episode id hashes to
    await env.claims.handoff("ep", first.token)
    again = await claim(env, "ep")
    assert again.status == "reassigned"
    ring = await env.redis.zrange(env.keys.hash_ring("demo@v1"), 0, -1, withscores=True)
    h = point("ep")
    hashed = next((d for d, s in ring if s >= h), ring[0][0])
    assert again.device == hashed
    # over the bound (its load well above the fleet's average): the best score instead
    await env.claims.handoff("ep", again.token)
    for i in range(6):
        await env.redis.zadd(env.keys.load(hashed), {f"x{i}": 1 << 50})
    await env.redis.zadd(env.keys.scores("demo@v1"), {hashed: 100.0})
    third = await claim(env, "ep")
    assert third.status == "reassigned" and third.device != hashed


async def test_only_an_empty_index_falls_back_to_the_round_robin(env: Env) -> None:
    await serve(env, "a", DEMO1, n=1)
    await serve(env, "b", DEMO1, n=1)
    # nobody published yet: the ring's stride, without a gate
    assert (await claim(env, "e0", limit_ms=1.0)).device == "a/0"
    await publish(env, "a", (0, 60.0, 1.0))  # b has not renewed since it registered
    # a's score is over the gate and b, unscored, is not a candidate: refused, not b
    with pytest.raises(NoCapacity) as refused:
        await claim(env, "e1", limit_ms=40.0)
    assert refused.value.reason == "slo"
    await publish(env, "b", (0, 20.0, 1.0))
    assert (await claim(env, "e2", limit_ms=40.0)).device == "b/0"
