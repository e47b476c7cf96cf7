"""The claim protocol, every outcome, on fakeredis and a real Redis (same bodies)."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace

import pytest

from affinity import (
    InvalidArgument,
    NoCapacity,
    Recovering,
    Released,
    Settings,
    StaleToken,
    UnknownDevice,
    UnknownEpisode,
)
from tests.conftest import Env, cpu_devices

pytestmark = pytest.mark.anyio


async def test_claim_then_hit_is_sticky(env: Env) -> None:
    await env.node("a", 2)
    first = await env.claims.resolve("ep-1")
    assert first.status == "claimed"
    assert first.device in ("a/0", "a/1") and first.node == "a"
    assert first.url == "http://a.test:8000" and first.previous is None
    for _ in range(5):
        again = await env.claims.resolve("ep-1")
        assert (again.status, again.device, again.token) == ("hit", first.device, first.token)
    value = f"{first.device} {first.token} {first.claim}"
    assert await env.redis.get(env.keys.episode("ep-1")) == value
    assert len(first.claim) == 16 and again.claim == first.claim


async def test_round_robin_over_new_episodes(env: Env) -> None:
    await env.node("a", 2)
    await env.node("b", 2)
    devices = [(await env.claims.resolve(f"ep-{i}")).device for i in range(8)]
    assert devices == ["a/0", "a/1", "b/0", "b/1"] * 2


async def test_sliding_ttl(env: Env) -> None:
    await env.node("a", 1)
    await env.claims.resolve("ep")
    key = env.keys.episode("ep")
    await env.redis.pexpire(key, 500)  # as if the episode had been idle a while
    assert await env.redis.pttl(key) <= 500
    await env.claims.resolve("ep")
    assert await env.redis.pttl(key) > 59_000
    ((_, deadline),) = await env.redis.zrange(env.keys.load("a/0"), 0, -1, withscores=True)
    now = await env.redis.time()
    assert deadline > now[0] * 1000 + 59_000


async def test_real_ttl_expiry_frees_capacity(env: Env) -> None:
    """Redis' own expiry (the backstop nobody slid) frees the slot: the key's expiry and
    its load-set deadline are brought forward to 0.15 s (the backstop is minutes long)."""
    claims = env.claims
    await env.node("a", 1, capacity=1)
    await claims.resolve("ep-1")
    with pytest.raises(NoCapacity):
        await claims.resolve("ep-2")
    soon = int((await env.redis.time())[0] * 1000 + 150)
    await env.redis.pexpireat(env.keys.episode("ep-1"), soon)
    await env.redis.zadd(env.keys.load("a/0"), {"ep-1": soon})
    await env.redis.zadd(env.keys.full, {"a/0": soon})
    await asyncio.sleep(0.3)
    assert await env.redis.get(env.keys.episode("ep-1")) is None
    assert (await claims.resolve("ep-2")).status == "claimed"
    assert await env.redis.zrange(env.keys.load("a/0"), 0, -1) == ["ep-2"]


async def test_expiry_frees_capacity(env: Env) -> None:
    await env.node("a", 1, capacity=1)
    await env.claims.resolve("ep-1")
    with pytest.raises(NoCapacity):
        await env.claims.resolve("ep-2")
    await env.expire("ep-1")
    assert (await env.claims.resolve("ep-2")).device == "a/0"
    events = [f for _, f in await env.registry.events()]
    assert {"type": "expire", "device": "a/0", "count": "1"} in events


async def test_reassigned_when_lease_lapses(env: Env) -> None:
    await env.node("a", 1)
    await env.node("b", 1)
    first = await env.claims.resolve("ep")
    assert first.device == "a/0"
    await env.lapse("a")
    moved = await env.claims.resolve("ep")
    assert (moved.status, moved.device, moved.previous) == ("reassigned", "b/0", "a/0")
    assert moved.token > first.token
    assert await env.redis.zrange(env.keys.load("a/0"), 0, -1) == []
    assert await env.redis.zrange(env.keys.load("b/0"), 0, -1) == ["ep"]
    assert (await env.claims.resolve("ep")).status == "hit"
    # the claim noticed the lapse: one node-down, and none more when the node is back
    for _ in range(2):
        downs = [f["node"] for _, f in await env.registry.events() if f["type"] == "node-down"]
        assert downs == ["a"]
        await env.node("a", 1)


async def test_reassigned_when_device_down(env: Env) -> None:
    await env.node("a", 2)
    first = await env.claims.resolve("ep")
    await env.registry.set_state(first.device, "down", "3 model failures")
    moved = await env.claims.resolve("ep")
    assert moved.status == "reassigned" and moved.device != first.device
    assert moved.token > first.token


async def test_reassigned_when_node_drops_device(env: Env) -> None:
    await env.node("a", 2)
    await env.claims.resolve("ep-0")
    on_a1 = await env.claims.resolve("ep-1")
    assert on_a1.device == "a/1"
    await env.node("a", 1)  # restarted with one GPU fewer
    moved = await env.claims.resolve("ep-1")
    assert (moved.status, moved.device) == ("reassigned", "a/0")
    assert "a/1" not in [d.device for d in await env.registry.devices()]


async def test_drain_keeps_episodes_takes_no_new(env: Env) -> None:
    await env.node("a", 2)
    kept = await env.claims.resolve("ep-0")
    assert kept.device == "a/0"
    assert await env.registry.drain("a/0", "maintenance") == ("active", True, "draining")
    assert (await env.claims.resolve("ep-0")).status == "hit"
    news = {(await env.claims.resolve(f"new-{i}")).device for i in range(5)}
    assert news == {"a/1"}
    await env.registry.undrain("a/0")
    assert "a/0" in {(await env.claims.resolve(f"later-{i}")).device for i in range(4)}


async def test_full_writes_nothing(env: Env) -> None:
    await env.node("a", 1, capacity=1)
    await env.claims.resolve("ep-1")
    before = await env.snapshot()
    with pytest.raises(NoCapacity, match="ep-2"):
        await env.claims.resolve("ep-2")
    assert await env.snapshot() == before


async def test_full_when_no_node(env: Env) -> None:
    with pytest.raises(NoCapacity):
        await env.claims.resolve("ep")
    assert await env.snapshot() == {env.keys.fleet: "0"}  # the new fleet's marker only


async def test_reassign_with_nowhere_to_go_writes_nothing(env: Env) -> None:
    await env.node("a", 1)
    a = await env.claims.resolve("ep")
    await env.lapse("a")
    with pytest.raises(NoCapacity) as err:
        await env.claims.resolve("ep")  # notices the lapse: node-down, nothing else
    assert err.value.reason == "no_nodes"
    assert await env.redis.get(env.keys.episode("ep")) == f"a/0 {a.token} {a.claim}"
    assert [f["type"] for _, f in await env.registry.events()][-1] == "node-down"
    before = await env.snapshot()
    with pytest.raises(NoCapacity):
        await env.claims.resolve("ep")
    assert await env.snapshot() == before


async def test_release_right_and_stale_token(env: Env) -> None:
    await env.node("a", 1, capacity=1)
    a = await env.claims.resolve("ep")
    before = await env.snapshot()
    with pytest.raises(StaleToken) as err:
        await env.claims.release("ep", a.token - 1)
    assert err.value.current == a.token and err.value.device == "a/0"
    assert await env.snapshot() == before
    assert await env.claims.release("ep", a.token, owner=True) == Released("a/0", False)
    assert await env.redis.get(env.keys.episode("ep")) is None
    assert await env.redis.zcard(env.keys.load("a/0")) == 0
    with pytest.raises(UnknownEpisode):
        await env.claims.release("ep", a.token, owner=True)
    # the slot is free again
    assert (await env.claims.resolve("ep-2")).status == "claimed"


async def test_a_release_by_anyone_but_the_owner_waits_for_the_owner(env: Env) -> None:
    """An operator's release of an episode whose owner holds a live lease revokes it: the
    value is marked, the slot stays taken, the owner is told at its renewal and still
    serves it (a resolve is a hit there) until its renewal says it let go; then the next
    resolve reassigns it (state_reset). Without a live owner it is deleted at once."""
    await env.node("a", 1, capacity=2)
    a = await env.claims.resolve("ep")
    done = await env.claims.release("ep", a.token, "operator")
    assert done == Released("a/0", True)
    assert (await env.redis.get(env.keys.episode("ep"))).endswith(" revoked")
    assert await env.redis.zcard(env.keys.load("a/0")) == 1  # still the owner's
    assert await env.claims.release("ep", a.token, "operator") == done  # idempotent
    hit = await env.claims.resolve("ep")
    assert (hit.status, hit.token) == ("hit", a.token)  # the owner still serves it
    info = await env.claims.lookup("ep")
    assert info is not None and info.revoked and not info.moved
    renewal = await env.registry.renew("a", "", [("ep", a.token)])  # the owner let go
    assert renewal is not None and renewal.revoked == []
    assert (await env.redis.get(env.keys.episode("ep"))).endswith(" moved")
    assert await env.redis.zcard(env.keys.load("a/0")) == 0
    again = await env.claims.resolve("ep")
    assert (again.status, again.previous) == ("reassigned", "a/0") and again.token > a.token
    types = [f["type"] for _, f in await env.registry.events()]
    assert types[-3:] == ["revoke", "release", "reassign"]
    # the owner's lease lapsed: nobody serves it from memory, so it goes at once
    b = await env.claims.resolve("other-node-gone")
    await env.lapse("a")
    assert await env.claims.release("other-node-gone", b.token, "operator") == Released(
        "a/0", False
    )
    assert await env.redis.get(env.keys.episode("other-node-gone")) is None


async def test_lookup_is_read_only(env: Env) -> None:
    await env.node("a", 1)
    assert await env.claims.lookup("ep") is None
    a = await env.claims.resolve("ep")
    await env.redis.pexpire(env.keys.episode("ep"), 5000)
    before = await env.snapshot()
    info = await env.claims.lookup("ep")
    assert info is not None
    assert (info.device, info.token, info.node, info.alive, info.state) == (
        "a/0",
        a.token,
        "a",
        True,
        "active",
    )
    assert 0 < info.ttl_ms <= 5000
    assert await env.snapshot() == before
    await env.lapse("a")
    info = await env.claims.lookup("ep")
    assert info is not None and not info.alive


async def test_tokens_strictly_increase(env: Env) -> None:
    await env.node("a", 2)
    tokens = [(await env.claims.resolve(f"ep-{i}")).token for i in range(20)]
    assert tokens == sorted(tokens) and len(set(tokens)) == 20
    # max(last + 1, TIME in us): even a token far in the future is never undercut
    await env.redis.set(env.keys.token, str(tokens[-1] + 10**12))
    nxt = (await env.claims.resolve("ep-x")).token
    assert nxt == tokens[-1] + 10**12 + 1


async def test_events_are_appended(env: Env) -> None:
    await env.node("a", 1)
    a = await env.claims.resolve("ep")
    await env.registry.drain("a/0", "why")
    await env.claims.release("ep", a.token, owner=True)
    types = [f["type"] for _, f in await env.registry.events()]
    assert types == ["node-up", "claim", "drain", "release"]


async def test_script_cache_flushed_between_calls(env: Env) -> None:
    await env.node("a", 1)
    await env.claims.resolve("ep")
    await env.redis.script_flush()
    assert (await env.claims.resolve("ep")).status == "hit"
    await env.redis.script_flush()
    assert await env.claims.lookup("ep") is not None
    await env.redis.script_flush()
    await env.registry.drain("a/0")
    await env.redis.script_flush()
    assert await env.registry.flush("a", "", [], [("ep", 1)]) is not None  # the owner's batch


BAD_EPISODES = [
    "",
    "x" * 513,
    "é" * 257,
    b"\xff\xfe",
    "\ud800",
    42,
    None,
    "a\x1bb",
    "\x00",
    "z\x7f",
]


@pytest.mark.parametrize("bad", BAD_EPISODES)
async def test_bad_episode_ids_write_nothing(env: Env, bad: object) -> None:
    await env.node("a", 1)
    before = await env.snapshot()
    with pytest.raises(InvalidArgument) as err:
        await env.claims.resolve(bad)  # type: ignore[arg-type]
    assert "episode id" in str(err.value)
    with pytest.raises(InvalidArgument):
        await env.claims.release(bad, 1)  # type: ignore[arg-type]
    assert await env.snapshot() == before


async def test_episode_id_limit_is_inclusive(env: Env) -> None:
    await env.node("a", 1)
    assert (await env.claims.resolve("x" * 512)).status == "claimed"
    assert (await env.claims.resolve("é" * 256)).status == "claimed"


async def test_bad_registry_input_writes_nothing(env: Env) -> None:
    from affinity import DeviceRegistration

    await env.node("a", 1)
    before = await env.snapshot()
    for kwargs, field in [
        ({"capacity": 0}, "capacity"),
        ({"weight": 0}, "weight"),
        ({"weight": -2}, "weight"),
        ({"capacity": 1.5}, "capacity"),
    ]:
        with pytest.raises(InvalidArgument, match=field):
            DeviceRegistration(
                index=0, kind="cpu", name="c", uuid="u", arch="cpu", memory_mb=0, **kwargs
            )  # type: ignore[arg-type]
    with pytest.raises(UnknownDevice, match="nope/0"):
        await env.registry.drain("nope/0")
    with pytest.raises(InvalidArgument, match="state"):
        await env.registry.set_state("a/0", "sleeping")
    with pytest.raises(InvalidArgument, match="node id"):
        await env.registry.register("bad node", "http://x", [])
    assert await env.snapshot() == before


async def test_weighted_round_robin_window(env: Env) -> None:
    devices = cpu_devices(weights=[3, 1, 2], capacity=1000)
    await env.registry.register("w", "http://w", devices)
    await env.claims.resolve("warm-up")  # the window may start anywhere
    picks = [(await env.claims.resolve(f"ep-{i}")).device for i in range(12)]
    for start in range(0, 7):
        assert Counter(picks[start : start + 6]) == {"w/0": 3, "w/1": 1, "w/2": 2}


async def test_reregister_keeps_drain_not_down(env: Env) -> None:
    await env.node("a", 2)
    await env.registry.drain("a/0", "bad fan")
    await env.registry.set_state("a/1", "down", "crashes")
    await env.registry.deregister("a")
    await env.node("a", 2)
    states = {d.device: (d.state, d.reason) for d in await env.registry.devices()}
    assert states == {"a/0": ("draining", "bad fan"), "a/1": ("active", "")}


async def test_drain_follows_the_gpu_uuid_not_the_index(env: Env) -> None:
    await env.node("a", 2)
    await env.registry.drain("a/1", "bad fan")
    # after a reboot the GPUs at indexes 0 and 1 swapped places
    swapped = cpu_devices(2, uuid_prefix="a")
    swapped = [replace(swapped[0], uuid=swapped[1].uuid), replace(swapped[1], uuid=swapped[0].uuid)]
    await env.registry.register("a", "http://a.test:8000", swapped)
    states = {d.device: (d.state, d.uuid) for d in await env.registry.devices()}
    assert states["a/1"] == ("active", "a-cpu-0")
    await env.registry.drain("a/0", "bad fan")  # the operator follows the GPU
    await env.registry.register("a", "http://a.test:8000", swapped)
    assert {d.device: d.state for d in await env.registry.devices()}["a/0"] == "draining"


async def test_deregister_hands_episodes_over(env: Env) -> None:
    await env.node("a", 1)
    await env.node("b", 1)
    on_a = [e for e in [await env.claims.resolve(f"ep-{i}") for i in range(4)] if e.node == "a"]
    assert await env.registry.deregister("a") == len(on_a) == 2
    for e in on_a:
        key = env.keys.episode(e.episode)
        assert await env.redis.get(key) == f"a/0 {e.token} {e.claim} moved"
        assert 0 < await env.redis.pttl(key) <= env.settings.backstop_ms  # as before
        moved = await env.claims.resolve(e.episode)
        assert (moved.status, moved.device, moved.previous) == ("reassigned", "b/0", "a/0")
        assert moved.token > e.token
    nodes = {n.node: (n.state, n.alive) for n in await env.registry.nodes()}
    assert nodes == {"a": ("left", False), "b": ("up", True)}
    events = [f for _, f in await env.registry.events()]
    assert {
        "type": "node-down",
        "node": "a",
        "reason": "deregistered",
        "handed_over": "2",
    } in events
    assert [f["from"] for f in events if f["type"] == "reassign"] == ["a/0", "a/0"]


async def test_renew_after_loss_asks_to_register(env: Env) -> None:
    await env.node("a", 1)
    assert await env.registry.renew("a") is not None
    await env.redis.flushdb()
    assert await env.registry.renew("a") is None


async def test_only_if_guard(env: Env) -> None:
    await env.node("a", 1)
    await env.registry.drain("a/0")
    assert await env.registry.set_state("a/0", "active", only_if="down") == (
        "draining",
        False,
        "draining",
    )
    assert (await env.registry.devices())[0].state == "draining"


async def test_listing(env: Env) -> None:
    await env.node("a", 2, capacity=3)
    await env.node("b", 1)
    for i in range(3):
        await env.claims.resolve(f"ep-{i}")
    devs = {d.device: d for d in await env.registry.devices()}
    assert {k: (v.load, v.capacity, v.alive) for k, v in devs.items()} == {
        "a/0": (1, 3, True),
        "a/1": (1, 3, True),
        "b/0": (1, 100, True),
    }
    await env.lapse("b")
    assert not {d.device: d for d in await env.registry.devices()}["b/0"].alive
    rows = await env.registry.episodes(node="a")
    assert sorted((r.episode, r.device) for r in rows) == [("ep-0", "a/0"), ("ep-1", "a/1")]
    with pytest.raises(UnknownDevice):
        await env.registry.episodes(device="zz/9")


async def test_crash_down_and_up_keeps_an_operators_drain(env: Env) -> None:
    await env.node("a", 2)
    await env.registry.drain("a/0", "flaky fan")
    await env.registry.set_state("a/0", "down", "3 model failures")  # crash tracker
    assert await env.registry.set_state("a/0", "active", only_if="down") == (
        "down",
        True,
        "draining",
    )
    d = {x.device: x for x in await env.registry.devices()}["a/0"]
    assert (d.state, d.reason) == ("draining", "flaky fan")
    assert {(await env.claims.resolve(f"e{i}")).device for i in range(3)} == {"a/1"}
    # undrain does not revive a crashed device; re-registering restores the drain
    await env.registry.set_state("a/0", "down", "again")
    assert await env.registry.undrain("a/0") == ("down", False, "down")
    # a drain asked while down keeps it down, and waits for it to come back
    assert await env.registry.drain("a/0", "swap it") == ("down", True, "down")
    await env.node("a", 2)
    d = {x.device: x for x in await env.registry.devices()}["a/0"]
    assert (d.state, d.reason) == ("draining", "swap it")


async def test_one_node_id_one_live_process(env: Env) -> None:
    from affinity import NodeConflict

    devices = cpu_devices(1)
    await env.registry.register("a", "http://a-first", devices, instance="first")
    before = await env.snapshot()
    with pytest.raises(NodeConflict, match="'a'"):
        await env.registry.register("a", "http://a-second", devices, instance="second")
    # the process that lost the node id learns it at its next renewal, and must exit
    for call in (env.registry.renew, env.registry.deregister, env.registry.leave):
        with pytest.raises(NodeConflict):
            await call("a", "second")
    assert await env.snapshot() == before
    assert await env.registry.renew("a", "first") is not None
    await env.lapse("a")  # once the first one's lease lapsed, the id is free
    await env.registry.register("a", "http://a-second", devices, instance="second")
    with pytest.raises(NodeConflict):  # the first one must stop serving and exit
        await env.registry.renew("a", "first")
    assert await env.registry.renew("a", "second") is not None


async def test_a_namespace_with_quotes_and_backslashes(env: Env) -> None:
    """The scripts carry the namespace's key names as Lua literals: any namespace works."""
    from affinity import Claims, Registry

    odd = env.settings.with_(namespace="o'k\\x]]--")
    registry, claims = Registry(env.redis, odd), Claims(env.redis, odd)
    assert await registry.new_fleet()
    await registry.register("a", "http://a", cpu_devices(1))
    a = await claims.resolve("ep")
    assert (a.status, a.device) == ("claimed", "a/0")
    assert await env.redis.get(odd.keys.episode("ep")) == f"a/0 {a.token} {a.claim}"
    assert (await claims.resolve("ep")).status == "hit"
    assert (await claims.release("ep", a.token, owner=True)).device == "a/0"
    assert await env.redis.keys("{affinity}:*") == [env.keys.fleet]  # the fixture's marker


async def test_a_silent_redis_is_bounded_by_the_deadline() -> None:
    """A Redis that accepts the connection and never answers: every call ends with
    BackendUnavailable at its deadline (the client here has no socket timeout of its own);
    the caller's task is left usable, and a cancellation from outside stays a
    cancellation."""
    import redis.asyncio

    from affinity import BackendUnavailable, Claims, Registry, Settings

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(-1)
        writer.close()

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = redis.asyncio.Redis(port=port, decode_responses=True)
    settings = Settings(redis_deadline_s=0.2)
    try:
        async with asyncio.timeout(60):  # a hang fails the test instead of blocking CI
            with pytest.raises(BackendUnavailable, match=r"did not answer within 0\.2s"):
                await Claims(client, settings).resolve("ep")
            with pytest.raises(BackendUnavailable):
                await Registry(client, settings).devices()
            await asyncio.sleep(0)  # the task carries no pending cancellation
            task = asyncio.create_task(
                Claims(client, settings.with_(redis_deadline_s=30)).resolve("ep")
            )
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()


async def test_each_call_ends_at_its_own_deadline() -> None:
    """Calls in flight together on one event loop, each with its own deadline: the one
    with the earlier deadline ends first, a quick call in between is not disturbed."""
    import fakeredis
    import redis.asyncio

    from affinity import BackendUnavailable, Claims, Registry, Settings

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(-1)
        writer.close()

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    silent = redis.asyncio.Redis(port=server.sockets[0].getsockname()[1])
    quick = fakeredis.aioredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
    short, long = Settings(redis_deadline_s=0.1), Settings(redis_deadline_s=0.5)
    try:
        async with asyncio.timeout(60):
            slow = asyncio.create_task(Claims(silent, long).resolve("a"))
            fast = asyncio.create_task(Claims(silent, short).resolve("b"))
            await Registry(quick, short).new_fleet()
            await Registry(quick, short).register("n", "http://n", cpu_devices(1))
            assert (await Claims(quick, short).resolve("c")).status == "claimed"
            done, _ = await asyncio.wait({slow, fast}, return_when=asyncio.FIRST_COMPLETED)
            assert fast in done
            for task in (fast, slow):
                with pytest.raises(BackendUnavailable):
                    await task
    finally:
        await silent.aclose()
        await quick.aclose()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(
    ("changes", "field", "message"),
    [
        ({"lease_ttl_s": 0.0}, "lease_ttl_s", "invalid lease TTL 0.0: must be more than 0.001"),
        ({"episode_ttl_s": -1}, "episode_ttl_s", "invalid episode TTL -1: must be more than"),
        ({"events_maxlen": 0}, "events_maxlen", "invalid event stream length 0: must be >= 1"),
        ({"redis_retries": -1}, "redis_retries", "invalid Redis retries -1: must be >= 0"),
    ],
)
def test_settings_errors_name_what_a_person_sets(
    changes: dict[str, float], field: str, message: str
) -> None:
    with pytest.raises(InvalidArgument) as raised:
        Settings(**changes)
    assert raised.value.field == field and str(raised.value).startswith(message)
    assert field not in str(raised.value)  # the settings field is for programs


async def test_a_resolve_that_never_claims_refuses_an_unknown_episode(env: Env) -> None:
    await env.node("a", 1)
    before = await env.snapshot()
    with pytest.raises(UnknownEpisode):
        await env.claims.resolve("never-seen", claim=False)
    assert await env.snapshot() == before, "nothing written"
    a = await env.claims.resolve("known")
    again = await env.claims.resolve("known", claim=False)
    assert (again.status, again.token) == ("hit", a.token)
    await env.claims.release("known", a.token, owner=True)
    with pytest.raises(UnknownEpisode):
        await env.claims.resolve("known", claim=False)


async def test_the_owners_flush_slides_releases_and_answers_what_it_lost(env: Env) -> None:
    from affinity.registry import Held

    await env.registry.register("a", "http://a", cpu_devices(1, capacity=2), instance="i")
    one, two = await env.claims.resolve("one"), await env.claims.resolve("two")
    with pytest.raises(NoCapacity):
        await env.claims.resolve("three")
    key = env.keys.episode("one")
    await env.redis.pexpire(key, 1000)
    held = [
        Held("one", one.device, one.token, one.claim),
        Held("two", two.device, two.token, "another-claim"),
    ]
    done = await env.registry.flush("a", "i", held, [])
    assert done is not None and done.lost == ["two"] and done.grace_ms == 0
    assert await env.redis.pttl(key) > 1000  # slid back to the backstop
    # a release with another token changes nothing; with its own it frees the slot at once
    assert await env.registry.flush("a", "i", [], [("two", two.token + 1)]) is not None
    assert await env.redis.get(env.keys.episode("two")) is not None
    assert await env.registry.flush("a", "i", [], [("two", two.token)]) is not None
    assert await env.redis.get(env.keys.episode("two")) is None
    assert (await env.claims.resolve("three")).status == "claimed"
    # another instance of the node id writes nothing
    before = await env.snapshot()
    assert await env.registry.flush("a", "other", [], [("one", one.token)]) is None
    assert await env.snapshot() == before


async def test_a_claim_during_the_grace_period_writes_nothing_but_hits_go_on(env: Env) -> None:
    await env.node("a", 1)
    await env.claims.resolve("kept")
    await env.redis.delete(env.keys.fleet)  # Redis lost its data (the marker with it)
    with pytest.raises(Recovering) as info:
        await env.claims.resolve("new")
    assert 0 < info.value.retry_after_s <= env.settings.lease_ttl_s
    assert await env.redis.get(env.keys.episode("new")) is None
    assert (await env.claims.resolve("kept")).status == "hit"
    with pytest.raises(Recovering):  # the grace period runs on
        await env.claims.resolve("new")
    await env.redis.set(env.keys.fleet, "1")  # ... until its end (long past)
    assert (await env.claims.resolve("new")).status == "claimed"


async def test_a_claim_soon_after_redis_lost_its_data_is_a_reassignment(env: Env) -> None:
    """For one backstop after the grace period, Redis cannot tell an episode it never saw
    from one it lost with an owner that died meanwhile: the claim is a reassignment (its
    client is told state_reset), never a silent fresh start; afterwards, a claim again."""
    await env.node("a", 1)
    await env.redis.delete(env.keys.fleet)  # Redis lost its data
    with pytest.raises(Recovering):
        await env.claims.resolve("lost-or-new")
    grace_end, doubt_end = map(int, (await env.redis.get(env.keys.fleet)).split(" "))
    assert doubt_end - grace_end == env.settings.backstop_ms
    await env.redis.set(env.keys.fleet, f"1 {doubt_end}")  # the grace period is over
    a = await env.claims.resolve("lost-or-new")
    assert (a.status, a.previous) == ("reassigned", None)
    assert (await env.claims.resolve("lost-or-new")).status == "hit"
    await env.redis.set(env.keys.fleet, "1 2")  # the doubt is over too
    assert (await env.claims.resolve("brand-new")).status == "claimed"
