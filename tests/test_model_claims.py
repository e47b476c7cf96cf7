"""Model-aware claims (issue 24): one ring per (name, version), an episode keeps its model,
versions chosen newest-first or by the operator's rollout weights. fakeredis and a real
Redis, same bodies."""

from __future__ import annotations

from collections import Counter

import pytest

from affinity import ModelConflict, ModelId, NoCapacity, Recovering, UnknownModel
from affinity.registry import HeldEpisode
from tests.conftest import Env, cpu_devices

pytestmark = pytest.mark.anyio

DEMO1, DEMO2, VLA = ModelId("demo", "v1"), ModelId("demo", "v2"), ModelId("vla", "v1")


async def serve(env: Env, node: str, *models: ModelId, n: int = 2, capacity: int = 100) -> None:
    devices = cpu_devices(n, capacity=capacity, uuid_prefix=node)
    await env.registry.register(
        node, f"http://{node}.test:8000", devices, version="t",
        models={m: '{"inputs": []}' for m in models},
    )  # fmt: skip


async def fleet(env: Env) -> None:
    """A: demo; B: demo and vla; C: vla (the issue's three nodes)."""
    await serve(env, "a", DEMO1)
    await serve(env, "b", DEMO1, VLA)
    await serve(env, "c", VLA)


async def test_each_model_has_its_own_round_robin(env: Env) -> None:
    await fleet(env)
    demo = [await env.claims.resolve(f"d{i}", model="demo") for i in range(8)]
    vla = [await env.claims.resolve(f"v{i}", model="vla") for i in range(8)]
    assert [a.device for a in demo] == ["a/0", "a/1", "b/0", "b/1"] * 2
    assert [a.device for a in vla] == ["b/0", "b/1", "c/0", "c/1"] * 2
    assert {a.model for a in demo} == {"demo@v1"} and {a.model for a in vla} == {"vla@v1"}
    value = await env.redis.get(env.keys.episode("d0"))
    assert value == f"a/0 {demo[0].token} {demo[0].claim} demo@v1"
    again = await env.claims.resolve("d0", model="demo")
    assert (again.status, again.device, again.model) == ("hit", "a/0", "demo@v1")
    # a step that does not name its model keeps the episode's
    assert (await env.claims.resolve("v0")).model == "vla@v1"
    claims = [f for _, f in await env.events.events() if f["type"] == "claim"]
    assert Counter(f["model"] for f in claims) == {"demo@v1": 8, "vla@v1": 8}


async def test_capacity_is_the_devices_across_models(env: Env) -> None:
    await serve(env, "b", DEMO1, VLA, n=1, capacity=1)
    await env.claims.resolve("d", model="demo")
    with pytest.raises(NoCapacity):
        await env.claims.resolve("v", model="vla")
    assert await env.redis.zrange(env.keys.model_ring("vla@v1"), 0, -1) == []
    assert await env.redis.zrange(env.keys.full, 0, -1) == ["b/0"]
    await env.claims.release("d", (await env.claims.lookup("d")).token, owner=True)  # type: ignore[union-attr]
    assert (await env.claims.resolve("v", model="vla")).device == "b/0"


async def test_unknown_model_and_version_write_nothing(env: Env) -> None:
    await fleet(env)
    before = await env.snapshot()
    with pytest.raises(UnknownModel, match="'pi0'"):
        await env.claims.resolve("e", model="pi0")
    with pytest.raises(UnknownModel, match="demo@v9"):
        await env.claims.resolve("e", model="demo", version="v9")
    assert await env.snapshot() == before


async def test_another_version_or_name_is_a_conflict(env: Env) -> None:
    await fleet(env)
    await serve(env, "d", DEMO2)
    first = await env.claims.resolve("e", model="demo", version="v1")
    before = await env.snapshot()
    for kwargs in ({"model": "demo", "version": "v2"}, {"model": "vla"}):
        with pytest.raises(ModelConflict, match="demo@v1") as err:
            await env.claims.resolve("e", **kwargs)
        assert err.value.held == "demo@v1"
    assert await env.snapshot() == before
    # a restart is a new episode under the same id: it may name another version
    again = await env.claims.resolve("e", model="demo", version="v2", restart=True)
    assert (again.status, again.device, again.model) == ("claimed", "d/0", "demo@v2")
    assert first.model == "demo@v1"


async def test_newest_version_takes_new_episodes_old_ones_keep_theirs(env: Env) -> None:
    await serve(env, "a", DEMO1)
    await serve(env, "b", DEMO1)
    old = [await env.claims.resolve(f"old{i}", model="demo") for i in range(4)]
    await serve(env, "n", DEMO2)  # a new version, registered later: the newest
    new = [await env.claims.resolve(f"new{i}", model="demo") for i in range(4)]
    assert {a.model for a in old} == {"demo@v1"}
    assert {(a.node, a.model) for a in new} == {("n", "demo@v2")}
    # node a dies: its episodes are reassigned, on their own version (b), never v2's n
    await env.lapse("a")
    moved = [await env.claims.resolve(a.episode, model="demo") for a in old if a.node == "a"]
    assert moved and {(a.status, a.node, a.model) for a in moved} == {
        ("reassigned", "b", "demo@v1")
    }


async def test_a_full_newest_version_passes_new_episodes_to_the_next(env: Env) -> None:
    await serve(env, "a", DEMO1)
    await serve(env, "n", DEMO2, n=1, capacity=1)
    first = await env.claims.resolve("first", model="demo")
    spill = await env.claims.resolve("spill", model="demo")
    assert (first.node, first.model, spill.node, spill.model) == ("n", "demo@v2", "a", "demo@v1")
    with pytest.raises(NoCapacity):  # a version named is that version or nothing
        await env.claims.resolve("named", model="demo", version="v2")


async def test_rollout_weights_are_exact_and_running_episodes_stay(env: Env) -> None:
    await serve(env, "a", DEMO1)
    await serve(env, "b", DEMO2)
    running = await env.claims.resolve("running", model="demo")
    assert running.model == "demo@v2"
    await env.models.rollout("demo", "v1", 3)
    await env.models.rollout("demo", "v2", 1)
    got = [(await env.claims.resolve(f"e{i}", model="demo")).model for i in range(40)]
    assert Counter(got) == {"demo@v1": 30, "demo@v2": 10}
    assert all(Counter(got[i : i + 4]) == {"demo@v1": 3, "demo@v2": 1} for i in range(0, 40, 4))
    assert (await env.claims.resolve("running", model="demo")).model == "demo@v2"
    await env.models.rollout("demo", "v2", 0)
    got = [(await env.claims.resolve(f"f{i}", model="demo")).model for i in range(6)]
    assert set(got) == {"demo@v1"}
    statuses = {(m.version, m.weight, m.newest, m.nodes) for m in await env.inventory.models()}
    assert statuses == {("v1", 3, False, ("a",)), ("v2", 0, True, ("b",))}
    assert await env.models.clear_rollout("demo")
    assert (await env.claims.resolve("g", model="demo")).model == "demo@v2"
    with pytest.raises(UnknownModel):
        await env.models.rollout("demo", "v7", 1)
    kinds = [f for _, f in await env.events.events() if f["type"] == "rollout"]
    assert [(f["version"], f["weight"]) for f in kinds] == [
        ("v1", "3"),
        ("v2", "1"),
        ("v2", "0"),
        ("", ""),
    ]


async def test_a_named_version_is_served_by_that_version(env: Env) -> None:
    await serve(env, "a", DEMO1)
    await serve(env, "b", DEMO2)
    assert (await env.claims.resolve("x", model="demo", version="v1")).node == "a"
    assert (await env.claims.resolve("y", model="demo", version="v2")).node == "b"


async def test_reregistering_with_other_models_leaves_the_old_rings(env: Env) -> None:
    await serve(env, "b", DEMO1, VLA)
    await serve(env, "b", VLA)
    assert await env.redis.zrange(env.keys.model_ring("demo@v1"), 0, -1) == []
    assert await env.redis.zrange(env.keys.model_ring("vla@v1"), 0, -1) == ["b/0", "b/1"]
    with pytest.raises(NoCapacity):
        await env.claims.resolve("d", model="demo")
    (node,) = await env.inventory.nodes()
    assert node.models == ("vla@v1",)
    assert {d.models for d in await env.inventory.devices()} == {("vla@v1",)}


async def test_drain_and_lapse_take_a_device_out_of_every_ring(env: Env) -> None:
    await serve(env, "b", DEMO1, VLA, n=1)
    await env.registry.drain("b/0")
    for m in ("demo@v1", "vla@v1"):
        assert await env.redis.zrange(env.keys.model_ring(m), 0, -1) == []
    await env.registry.undrain("b/0")
    for m in ("demo@v1", "vla@v1"):
        assert await env.redis.zrange(env.keys.model_ring(m), 0, -1) == ["b/0"]
    await env.lapse("b")
    with pytest.raises(NoCapacity):
        await env.claims.resolve("v", model="vla")
    for m in ("demo@v1", "vla@v1"):
        assert await env.redis.zrange(env.keys.model_ring(m), 0, -1) == []


async def test_one_version_per_name_per_node(env: Env) -> None:
    from affinity import InvalidArgument

    with pytest.raises(InvalidArgument, match="one version per name"):
        await serve(env, "a", DEMO1, DEMO2)


async def test_a_renewal_rebases_each_ring_of_its_models(env: Env) -> None:
    await serve(env, "b", DEMO1, VLA)
    for m in ("demo@v1", "vla@v1"):
        ring = env.keys.model_ring(m)
        await env.redis.zadd(ring, {"b/0": 2**21, "b/1": 2**21 + 1})
    assert await env.registry.renew("b") is not None
    for m in ("demo@v1", "vla@v1"):
        assert await env.redis.zrange(env.keys.model_ring(m), 0, -1, withscores=True) == [
            ("b/0", 0.0),
            ("b/1", 1.0),
        ]
    # b/1 was one turn ahead and still is: b/0 takes two turns before it
    got = [(await env.claims.resolve(f"e{i}", model="vla")).device for i in range(3)]
    assert got == ["b/0", "b/0", "b/1"]


async def test_a_node_that_stops_serving_a_model_loses_its_episodes_of_it(env: Env) -> None:
    await serve(env, "a", DEMO1)
    await serve(env, "b", DEMO1, VLA)
    on_b = [a for a in [await env.claims.resolve(f"e{i}", model="demo") for i in range(4)]
            if a.node == "b"]  # fmt: skip
    await serve(env, "b", VLA)  # restarted without demo
    for a in on_b:
        again = await env.claims.resolve(a.episode, model="demo")
        assert (again.status, again.node, again.previous) == ("reassigned", "a", a.device)
    assert (
        await env.redis.zcard(env.keys.load("b/0")) + await env.redis.zcard(env.keys.load("b/1"))
        == 0
    )


async def owner(env: Env, *models: ModelId) -> None:
    """Node b, one device of capacity 1 serving ``models``, registered as instance "i"."""
    await env.registry.register(
        "b", "http://b.test:8000", cpu_devices(1, capacity=1, uuid_prefix="b"), version="t",
        instance="i", models={m: '{"inputs": []}' for m in models},
    )  # fmt: skip


async def rings(env: Env, *models: ModelId) -> list[list[str]]:
    return [await env.redis.zrange(env.keys.model_ring(str(m)), 0, -1) for m in models]


async def test_the_owners_flush_keeps_the_model_and_frees_a_device_onto_all_its_rings(
    env: Env,
) -> None:
    await owner(env, DEMO1, VLA)
    d = await env.claims.resolve("d", model="demo")
    assert await rings(env, DEMO1, VLA) == [[], []]  # full: out of both rings
    value = await env.redis.get(env.keys.episode("d"))
    assert value == f"b/0 {d.token} {d.claim} demo@v1"
    held = HeldEpisode("d", d.device, d.token, d.claim, d.model)
    done = await env.registry.flush("b", "i", [held], [])
    assert done is not None and done.lost == []
    assert await env.redis.get(env.keys.episode("d")) == value  # slid, model kept
    other = await env.registry.flush("b", "i", [held._replace(model="demo@v2")], [])
    assert other is not None and other.lost == ["d"]  # another model's claim: not this one
    assert await env.redis.get(env.keys.episode("d")) == value
    done = await env.registry.flush("b", "i", [], [("d", d.token)])  # ended idle at b
    assert done is not None and await env.redis.get(env.keys.episode("d")) is None
    assert await rings(env, DEMO1, VLA) == [["b/0"], ["b/0"]]
    assert await env.redis.zrange(env.keys.full, 0, -1) == []
    assert (await env.claims.resolve("v", model="vla")).device == "b/0"


async def test_a_reassert_keeps_each_episodes_model_and_counts_it_in_the_load(env: Env) -> None:
    await owner(env, DEMO1, VLA)
    d = await env.claims.resolve("d", model="demo")
    value = await env.redis.get(env.keys.episode("d"))
    for key in await env.redis.keys("{affinity}:*"):  # Redis lost its data
        await env.redis.delete(key)
    with pytest.raises(Recovering):  # the grace period holds claims of every model back
        await env.claims.resolve("v", model="vla")
    held = HeldEpisode("d", d.device, d.token, d.claim, d.model)
    other = HeldEpisode("x", d.device, d.token + 1, "abc", "pi0@v1")  # a model b does not serve
    await env.redis.set(env.keys.fleet, "99999999999999")  # a grace period that runs on
    done = await env.registry.register(
        "b", "http://b.test:8000", cpu_devices(1, capacity=1, uuid_prefix="b"), version="t",
        instance="i", models={m: '{"inputs": []}' for m in (DEMO1, VLA)},
        episodes=[held, other],
    )  # fmt: skip
    assert done.lost == ["x"] and done.grace_ms > 0
    assert await env.redis.get(env.keys.episode("d")) == value
    assert await env.redis.get(env.keys.episode("x")) is None
    assert await env.redis.zrange(env.keys.load("b/0"), 0, -1) == ["d"]
    assert await rings(env, DEMO1, VLA) == [[], []]  # the re-asserted episode fills b/0
    assert await env.redis.zrange(env.keys.full, 0, -1) == ["b/0"]
    for model in ("demo", "vla"):
        with pytest.raises(Recovering):
            await env.claims.resolve(f"new-{model}", model=model)
    await env.redis.set(env.keys.fleet, "1")  # the grace period is over
    with pytest.raises(NoCapacity):  # b/0 is full with the re-asserted episode
        await env.claims.resolve("new", model="vla")
    hit = await env.claims.resolve("d", model="demo")
    assert (hit.status, hit.token, hit.model) == ("hit", d.token, "demo@v1")
