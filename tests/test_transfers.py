"""The live hand-over's Redis side (affinity/transfers.py, affinity/lua/transfer.lua), on
fakeredis and a real redis-server: place reserves a slot on a device that serves the
episode's model and issues a token; commit moves the assignment only while the owner's
claim holds it unmarked, the owner's lease is live and the new owner marked its copy
installed; abort takes a reservation back; the new owner's settle confirms a committed
copy or makes sure it never will be."""

from __future__ import annotations

from typing import Any

import pytest

from affinity import NoCapacity, StaleToken
from affinity.transfers import NotPlaced, Placement, Transfers
from tests.conftest import Env, cpu_devices

pytestmark = pytest.mark.anyio


async def owned(env: Env, episode: str = "ep", capacity: int = 100) -> tuple[Any, str]:
    """A claim on a/0 (node a, instance ia); b/0 is the only other device taking one."""
    a_devices = cpu_devices(1, capacity=capacity, uuid_prefix="a")
    b_devices = cpu_devices(2, capacity=capacity, uuid_prefix="b")
    await env.registry.register("a", "http://a.test", a_devices, instance="ia")
    await env.registry.register("b", "http://b.test", b_devices, instance="ib")
    await env.registry.drain("b/1", "kept free")  # b/0 is the only place to go
    for _ in range(8):
        a = await env.claims.resolve(episode)
        if a.device == "a/0":
            return a, "ia"
        await env.claims.release(episode, a.token, owner=True)
    raise AssertionError("no claim on a/0")


async def test_place_then_commit_moves_the_assignment_and_its_slot(env: Env) -> None:
    a, ia = await owned(env)
    moves = Transfers(env.redis, env.settings)
    to = await moves.place("ep", a.token, a.claim, ia, hold_ms=5_000)
    assert isinstance(to, Placement) and (to.device, to.node) == ("b/0", "b")
    assert to.token > a.token and to.claim != a.claim and to.instance == "ib"
    # reserved: the slot counts on b/0, the assignment is still a's
    assert await env.redis.zrange(env.keys.load("b/0"), 0, -1) == ["ep"]
    assert (await env.claims.resolve("ep")).device == "a/0"
    # the commit needs the new owner's copy: the reservation marked installed
    assert await moves.commit("ep", a.token, a.claim, ia, to) == NotPlaced("copy")
    assert await moves.installed("ep", to.device, to.token, to.claim)
    assert await moves.commit("ep", a.token, a.claim, ia, to, size=96, reason="drain") is None
    assert await env.redis.get(env.keys.transfer("ep")) is None
    value = await env.redis.get(env.keys.episode("ep"))
    assert value.split(" ")[:3] == ["b/0", str(to.token), to.claim]
    assert await env.redis.zrange(env.keys.load("a/0"), 0, -1) == []
    hit = await env.claims.resolve("ep")
    assert (hit.status, hit.device, hit.token, hit.claim) == ("hit", "b/0", to.token, to.claim)
    moved = [f for _, f in await env.events.events() if f["type"] == "moved"]
    assert [(m["from"], m["to"], m["bytes"], m["reason"]) for m in moved] == [
        ("a/0", "b/0", "96", "drain")
    ]
    # the old claim is gone: a second commit, or a release under it, is refused
    assert await moves.commit("ep", a.token, a.claim, ia, to) == NotPlaced("stale")
    with pytest.raises(StaleToken):
        await env.claims.release("ep", a.token, owner=True)


async def test_a_commit_is_refused_without_the_owners_live_lease_or_claim(env: Env) -> None:
    a, ia = await owned(env)
    moves = Transfers(env.redis, env.settings)
    to = await moves.place("ep", a.token, a.claim, ia)
    assert isinstance(to, Placement)
    before = await env.redis.get(env.keys.episode("ep"))
    assert await moves.commit("ep", a.token, a.claim, "another", to) == NotPlaced("lease")
    assert await moves.commit("ep", a.token, "other-claim", ia, to) == NotPlaced("stale")
    await env.claims.release("ep", a.token, "operator")  # revoked: the owner lets go
    assert await moves.commit("ep", a.token, a.claim, ia, to) == NotPlaced("marked")
    await env.redis.set(env.keys.episode("ep"), before, keepttl=True)
    await env.lapse("a")  # a paused owner whose lease lapsed never moves anything
    assert await moves.commit("ep", a.token, a.claim, ia, to) == NotPlaced("lease")
    assert (await env.redis.get(env.keys.episode("ep"))) == before
    assert await moves.abort("ep", a.token, a.claim, ia, to)
    assert await env.redis.zrange(env.keys.load("b/0"), 0, -1) == []


async def test_place_takes_only_a_device_with_room_that_serves_the_model(env: Env) -> None:
    a, ia = await owned(env)
    moves = Transfers(env.redis, env.settings)
    await env.registry.drain("b/0", "full too")
    assert await moves.place("ep", a.token, a.claim, ia) == NotPlaced("none")
    await env.registry.undrain("b/0")
    assert await moves.place("ep", a.token, a.claim, ia, target="a") == NotPlaced("none")
    named = await moves.place("ep", a.token, a.claim, ia, target="b/0")
    assert isinstance(named, Placement) and named.device == "b/0"
    # an abort after a commit changes nothing
    assert await moves.installed("ep", named.device, named.token, named.claim)
    assert await moves.commit("ep", a.token, a.claim, ia, named) is None
    assert not await moves.abort("ep", a.token, a.claim, ia, named)
    assert await env.redis.zrange(env.keys.load("b/0"), 0, -1) == ["ep"]


async def test_a_reservation_expires_with_its_hold(env: Env) -> None:
    a, ia = await owned(env, capacity=1)  # a/0 is full with ep; b/0 takes one
    moves = Transfers(env.redis, env.settings)
    to = await moves.place("ep", a.token, a.claim, ia, hold_ms=60_000)
    assert isinstance(to, Placement)
    with pytest.raises(NoCapacity):  # the reservation takes b/0's one slot
        await env.claims.resolve("other")
    await env.redis.zadd(env.keys.load("b/0"), {"ep": 1})  # (its hold ran out)
    await env.redis.zadd(env.keys.full, {"b/0": 1}, xx=True)
    other = await env.claims.resolve("other")  # the sweep finds room on b/0 again
    assert other.device == "b/0"


async def test_a_settled_copy_can_never_be_committed(env: Env) -> None:
    """The new owner settles a copy whose commit has not landed: the mark and the slot go
    in the same step, and the late commit is refused (issue 41)."""
    a, ia = await owned(env)
    moves = Transfers(env.redis, env.settings)
    to = await moves.place("ep", a.token, a.claim, ia)
    assert isinstance(to, Placement)
    assert not await moves.installed("ep", to.device, to.token, "another-claim")
    assert await moves.installed("ep", to.device, to.token, to.claim)
    assert not await moves.settle("ep", to.device, to.token, to.claim)  # dropped
    assert await env.redis.get(env.keys.transfer("ep")) is None
    assert await env.redis.zrange(env.keys.load("b/0"), 0, -1) == []
    assert await moves.commit("ep", a.token, a.claim, ia, to) == NotPlaced("copy")
    assert (await env.redis.get(env.keys.episode("ep"))).startswith("a/0 ")
    # a committed copy settles as committed
    again = await moves.place("ep", a.token, a.claim, ia)
    assert isinstance(again, Placement)
    assert await moves.installed("ep", again.device, again.token, again.claim)
    assert await moves.commit("ep", a.token, a.claim, ia, again) is None
    assert await moves.settle("ep", again.device, again.token, again.claim)


async def test_a_commit_is_refused_onto_a_leaving_node_or_when_redis_lost_the_episode(
    env: Env,
) -> None:
    a, ia = await owned(env)
    moves = Transfers(env.redis, env.settings)
    to = await moves.place("ep", a.token, a.claim, ia)
    assert isinstance(to, Placement)
    assert await moves.installed("ep", to.device, to.token, to.claim)
    await env.registry.leave("b", "ib")
    assert await moves.commit("ep", a.token, a.claim, ia, to) == NotPlaced("target")
    await env.redis.delete(env.keys.episode("ep"))
    assert await moves.commit("ep", a.token, a.claim, ia, to) == NotPlaced("missing")
    assert await moves.place("ep", a.token, a.claim, ia) == NotPlaced("missing")


async def test_a_move_kept_where_it_was_writes_an_event(env: Env) -> None:
    a, _ = await owned(env)
    await Transfers(env.redis, env.settings).kept("ep", "drain", "none")
    kept = [f for _, f in await env.events.events() if f["type"] == "move-kept"]
    assert [(k["episode"], k["device"], k["reason"], k["why"]) for k in kept] == [
        ("ep", a.device, "drain", "none")
    ]
