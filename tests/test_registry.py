"""Node lifecycle on fakeredis and a real Redis (same bodies): devices a node no longer has,
leases that lapse (noticed once), dead nodes kept visible, states carried by registration,
graceful leave and hand-over, restarts of an episode, absolute expiries, and why a claim
found no capacity."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from affinity import (
    Claims,
    InvalidArgument,
    NoCapacity,
    NodeConflict,
    Registry,
    UnknownNode,
)
from affinity.registry import (
    FORK_SERVER_ROLE,
    MAX_DEVICES_PER_NODE,
    MAX_FRONTS,
    MAX_HELPERS,
    ONE_PROCESS,
    NodeProcess,
    NodeProcesses,
    StateChange,
)
from tests.conftest import Env, cpu_devices

pytestmark = pytest.mark.anyio


async def events(env: Env, kind: str) -> list[dict[str, str]]:
    return [f for _, f in await env.events.events() if f["type"] == kind]


# -- devices a node no longer has (issue 10 #1) ---------------------------------------------


async def test_a_crashed_node_back_with_fewer_devices_loses_the_others(env: Env) -> None:
    await env.node("a", 2)
    await env.claims.resolve("ep-0")
    on_a1 = await env.claims.resolve("ep-1")
    assert on_a1.device == "a/1"
    # a crash: the lease lapses, and its record may be gone too (a lease TTL on the node
    # hash used to take it along)
    await env.lapse("a")
    await env.redis.delete(env.keys.node("a"))
    await env.node("a", 1)
    moved = await env.claims.resolve("ep-1")
    assert (moved.status, moved.device, moved.previous) == ("reassigned", "a/0", "a/1")
    assert [d.device for d in await env.inventory.devices()] == ["a/0"]
    assert await env.redis.exists(env.keys.device("a/1"), env.keys.load("a/1")) == 0
    assert (await env.claims.resolve("ep-1")).status == "hit"


async def test_a_stopped_node_back_with_fewer_devices_loses_the_others(env: Env) -> None:
    await env.node("a", 2)
    await env.claims.resolve("ep-0")
    assert (await env.claims.resolve("ep-1")).device == "a/1"
    await env.registry.deregister("a")  # SIGTERM: the node hash says "left"
    await env.node("a", 1)
    moved = await env.claims.resolve("ep-1")
    assert (moved.status, moved.device, moved.previous) == ("reassigned", "a/0", "a/1")
    assert [d.device for d in await env.inventory.devices()] == ["a/0"]


# -- one process per node id (issue 10 #3) --------------------------------------------------


async def test_renewal_after_an_empty_restart_tells_the_loser_to_exit(env: Env) -> None:
    devices = cpu_devices(1)
    await env.registry.register("a", "http://a", devices, instance="first")
    await env.redis.flushdb()  # Redis restarts empty...
    await env.registry.register("a", "http://a", devices, instance="second")  # ...a duplicate
    with pytest.raises(NodeConflict, match="'a'"):
        await env.registry.renew("a", "first")
    assert await env.registry.renew("a", "second") is not None


# -- absolute expiries (issue 10 #5) --------------------------------------------------------


async def test_expiries_are_the_load_deadlines_exactly(env: Env) -> None:
    await env.node("a", 2, capacity=1000)
    episodes = [f"ep-{i}" for i in range(60)]
    for _ in range(2):  # claims, then hits
        for ep in episodes:
            await env.claims.resolve(ep)
    for ep in episodes:
        device = (await env.redis.get(env.keys.episode(ep))).split(" ")[0]
        expiry = await env.redis.pexpiretime(env.keys.episode(ep))
        assert expiry == await env.redis.zscore(env.keys.load(device), ep), ep
    # a node's record has no TTL of its own: its lease is the deadline in {ns}:nodes
    assert await env.redis.pttl(env.keys.node("a")) == -1


# -- registration carries the crash trackers' states (issue 10 #7) --------------------------


async def test_registration_carries_down_states_and_keeps_drains(env: Env) -> None:
    await env.node("a", 3)
    await env.registry.drain("a/2", "bad fan")
    devices = cpu_devices(3, uuid_prefix="a")
    devices[1] = replace(devices[1], state="down", reason="3 model failures")
    devices[2] = replace(devices[2], state="down", reason="hung")
    await env.registry.register("a", "http://a.test:8000", devices)
    states = {d.device: (d.state, d.reason) for d in await env.inventory.devices()}
    assert states == {
        "a/0": ("active", ""),
        "a/1": ("down", "3 model failures"),
        "a/2": ("down", "hung"),
    }
    assert {(await env.claims.resolve(f"ep-{i}")).device for i in range(4)} == {"a/0"}
    # back up: a/1 takes episodes again, a/2 returns to the operator's drain
    assert (await env.registry.set_state("a/1", "active", only_if="down")).state == "active"
    assert await env.registry.set_state("a/2", "active", only_if="down") == (
        "down",
        True,
        "draining",
    )
    assert {(await env.claims.resolve(f"ep-{i}")).device for i in range(4, 8)} == {"a/0", "a/1"}
    with pytest.raises(InvalidArgument, match="state"):
        replace(devices[0], state="draining")


# -- a lapse is noticed once; dead nodes stay visible (issue 10 #11, #12) -------------------


async def test_a_lapse_writes_one_node_down_by_whoever_notices_first(env: Env) -> None:
    await env.node("a", 1)
    await env.node("b", 1)
    await env.lapse("a")
    assert await events(env, "node-down") == []
    assert await env.registry.renew("b") is not None  # b's renewal notices a's lapse
    (down,) = await events(env, "node-down")
    assert (down["node"], down["reason"], down["lease"]) == ("a", "lease lapsed", "1")
    for i in range(4):  # later claims do not write it again, nor place anything on a
        assert (await env.claims.resolve(f"ep-{i}")).device == "b/0"
    assert await env.registry.renew("a") is None  # a must register again
    assert len(await events(env, "node-down")) == 1
    nodes = {n.node: n for n in await env.inventory.nodes()}
    a = nodes["a"]
    assert (a.url, a.devices, a.alive, a.state, a.version) == (
        "http://a.test:8000",
        ("a/0",),
        False,
        "down",
        "t",
    )
    assert a.lease_ms < 0 and nodes["b"].alive and nodes["b"].state == "up"


async def test_a_repeated_drain_writes_no_event(env: Env) -> None:
    await env.node("a", 1)
    first = await env.registry.drain("a/0", "bad fan")
    again = await env.registry.drain("a/0", "bad fan")
    assert (first.changed, again) == (True, StateChange("draining", False, "draining"))
    assert len(await events(env, "drain")) == 1
    other = await env.registry.drain("a/0", "worse fan")  # a new reason is recorded
    assert other.changed and len(await events(env, "drain")) == 2
    assert (await env.registry.undrain("a/0")).changed
    assert not (await env.registry.undrain("a/0")).changed  # not draining: left alone
    assert len(await events(env, "undrain")) == 1


async def test_forget_a_dead_node(env: Env) -> None:
    await env.node("a", 2)
    await env.node("b", 1)
    await env.registry.drain("a/1", "bad fan")
    await env.claims.resolve("ep")
    await env.lapse("a")
    with pytest.raises(InvalidArgument, match="current lease"):
        await env.registry.forget("b")
    with pytest.raises(UnknownNode, match="'zz'"):
        await env.registry.forget("zz")
    await env.registry.forget("a")
    assert [n.node for n in await env.inventory.nodes()] == ["b"]
    assert [d.device for d in await env.inventory.devices()] == ["b/0"]
    assert (await env.claims.resolve("ep")).previous == "a/0"
    with pytest.raises(UnknownNode):
        await env.registry.forget("a")
    assert [e["devices"] for e in await events(env, "node-forget")] == ["a/0,a/1"]


# -- why a claim found no device (issue 18 #3) ----------------------------------------------


async def test_no_capacity_says_whether_any_node_is_alive(env: Env) -> None:
    with pytest.raises(NoCapacity, match="no node is registered") as err:
        await env.claims.resolve("ep-0")
    assert err.value.reason == "no_nodes"
    await env.node("a", 1, capacity=1)
    await env.claims.resolve("ep-0")
    with pytest.raises(NoCapacity, match="at capacity") as err:
        await env.claims.resolve("ep-1")
    assert err.value.reason == "at_capacity"
    await env.claims.release("ep-0", (await env.claims.resolve("ep-0")).token, owner=True)
    await env.registry.drain("a/0")
    with pytest.raises(NoCapacity) as err:
        await env.claims.resolve("ep-1")
    assert err.value.reason == "at_capacity"
    await env.lapse("a")
    with pytest.raises(NoCapacity) as err:
        await env.claims.resolve("ep-1")
    assert err.value.reason == "no_nodes"


# -- graceful stop: leave, hand over, deregister (issues 10 #4, 18 #1) ----------------------


async def test_leave_takes_no_new_episodes_and_handoff_moves_each(env: Env) -> None:
    await env.node("a", 1)
    await env.node("b", 1)
    on_a = await env.claims.resolve("ep-a")
    assert on_a.device == "a/0"
    assert await env.registry.leave("a") == 1
    assert {(await env.claims.resolve(f"new-{i}")).device for i in range(3)} == {"b/0"}
    assert (await env.claims.resolve("ep-a")).status == "hit"  # its episodes stay
    assert await env.registry.renew("a") is not None  # the lease goes on while it hands over

    before = await env.snapshot()
    assert await env.claims.handoff("ep-a", on_a.token - 1) is False
    assert await env.snapshot() == before
    assert await env.claims.handoff("ep-a", on_a.token) is True
    assert await env.redis.get(env.keys.episode("ep-a")) == f"a/0 {on_a.token} {on_a.claim} moved"
    info = await env.claims.lookup("ep-a")
    assert info is not None and info.moved and info.device == "a/0"
    assert await env.claims.handoff("ep-a", on_a.token) is False  # once
    assert await env.redis.zrange(env.keys.load("a/0"), 0, -1) == []

    moved = await env.claims.resolve("ep-a")
    assert (moved.status, moved.device, moved.previous) == ("reassigned", "b/0", "a/0")
    assert moved.token > on_a.token
    (handoff,) = await events(env, "handoff")
    assert (handoff["episode"], handoff["device"]) == ("ep-a", "a/0")
    assert (await events(env, "reassign"))[-1]["from"] == "a/0"
    await env.node("a", 1)  # registering again undoes the leave
    assert "a/0" in {(await env.claims.resolve(f"later-{i}")).device for i in range(2)}


async def test_a_stopped_node_is_listed_as_left_with_its_devices(env: Env) -> None:
    await env.node("a", 2)
    await env.node("b", 1)
    await env.claims.resolve("ep")
    await env.registry.deregister("a")
    nodes = {n.node: n for n in await env.inventory.nodes()}
    assert (nodes["a"].state, nodes["a"].alive, nodes["a"].devices) == (
        "left",
        False,
        ("a/0", "a/1"),
    )
    assert nodes["b"].state == "up"
    devices = {d.device: d for d in await env.inventory.devices()}
    assert {d for d, s in devices.items() if s.node == "a"} == set(nodes["a"].devices)
    assert not any(devices[d].alive for d in nodes["a"].devices)
    await env.lapse("b")  # a lapse noticed later does not turn "left" into "down"
    assert {n.node: n.state for n in await env.inventory.nodes()} == {"a": "left", "b": "down"}
    await env.registry.forget("a")
    assert [n.node for n in await env.inventory.nodes()] == ["b"]
    assert not any(d.node == "a" for d in await env.inventory.devices())
    await env.node("a", 1)  # or it comes back up
    assert {n.node: n.state for n in await env.inventory.nodes()}["a"] == "up"


async def test_episodes_lists_handed_over_episodes_as_show_does(env: Env) -> None:
    await env.node("a", 1)
    await env.node("b", 1)
    claimed = [await env.claims.resolve(f"ep-{i}") for i in range(4)]
    on_a = sorted(c.episode for c in claimed if c.node == "a")
    token = {c.episode: c.token for c in claimed}
    await env.claims.handoff(on_a[0], token[on_a[0]])  # one by hand, the rest by the stop
    await env.registry.deregister("a")
    rows = {r.episode: r for r in await env.inventory.episodes(node="a")}
    assert sorted(rows) == on_a and all(r.moved and r.device == "a/0" for r in rows.values())
    for ep in on_a:
        info = await env.claims.lookup(ep)
        assert info is not None and info.moved and rows[ep].token == info.token
    assert all(not r.moved for r in await env.inventory.episodes(node="b"))
    moved = await env.claims.resolve(on_a[0])  # claimed anew: listed where it is now
    assert moved.status == "reassigned" and moved.device == "b/0"
    assert on_a[0] not in {r.episode for r in await env.inventory.episodes(node="a")}
    assert on_a[0] in {r.episode for r in await env.inventory.episodes(device="b/0") if not r.moved}
    await env.registry.forget("a")
    assert await env.redis.exists(env.keys.moved("a/0")) == 0


async def test_a_handed_over_slot_is_free_at_once(env: Env) -> None:
    await env.node("a", 1, capacity=1)
    first = await env.claims.resolve("ep-0")
    with pytest.raises(NoCapacity):
        await env.claims.resolve("ep-1")
    assert await env.claims.handoff("ep-0", first.token)
    assert (await env.claims.resolve("ep-1")).device == "a/0"


async def test_a_handed_over_episode_can_still_be_released(env: Env) -> None:
    await env.node("a", 1)
    a = await env.claims.resolve("ep")
    await env.claims.handoff("ep", a.token)
    assert (await env.claims.release("ep", a.token, owner=True)).device == "a/0"
    assert (await env.claims.resolve("ep")).status == "claimed"


# -- restart of an episode (KServe sequence_start) ------------------------------------------


async def test_restart_writes_a_fresh_assignment(env: Env) -> None:
    await env.node("a", 1, capacity=1)
    first = await env.claims.resolve("ep")
    again = await env.claims.resolve("ep", restart=True)  # the full device takes it again
    assert (again.status, again.device, again.previous) == ("claimed", "a/0", None)
    assert again.token > first.token
    assert await env.redis.zrange(env.keys.load("a/0"), 0, -1) == ["ep"]
    assert (await env.claims.resolve("ep")).token == again.token
    assert [e["from"] for e in await events(env, "claim")] == ["", "a/0"]


# -- the ring ---------------------------------------------------------------------------------


async def test_a_device_joining_takes_its_turns_from_now_on(env: Env) -> None:
    await env.node("a", 1)
    for i in range(30):
        await env.claims.resolve(f"warm-{i}")
    await env.node("b", 1)  # it does not get the next 30 claims to catch up
    picks = [(await env.claims.resolve(f"ep-{i}")).device for i in range(6)]
    assert sorted(picks) == ["a/0"] * 3 + ["b/0"] * 3
    assert picks[0::2] == [picks[0]] * 3


async def test_a_full_device_leaves_the_ring_and_comes_back_when_freed(env: Env) -> None:
    await env.node("a", 2, capacity=1)
    a0 = await env.claims.resolve("ep-0")
    assert await env.redis.zrange(env.keys.ring, 0, -1) == ["a/1"]
    assert await env.redis.zscore(env.keys.full, "a/0") == await env.redis.zscore(
        env.keys.load("a/0"), "ep-0"
    )
    await env.claims.release("ep-0", a0.token, owner=True)
    assert sorted(await env.redis.zrange(env.keys.ring, 0, -1)) == ["a/0", "a/1"]
    assert await env.redis.zcard(env.keys.full) == 0
    await env.claims.resolve("ep-1")
    await env.claims.resolve("ep-2")
    await env.expire("ep-1")  # expires passively: the next claim finds the room
    assert (await env.claims.resolve("ep-3")).status == "claimed"


async def test_rebase_keeps_the_order_of_turns(env: Env) -> None:
    """Once the virtual time is large, a renewal shifts every score back by a whole number
    of turns; the picks that follow are the same as without the shift."""
    shifted = env.settings.with_(namespace="shifted")
    other = (Claims(env.redis, shifted), Registry(env.redis, shifted))
    runs = []
    await other[1].new_fleet()
    for claims, registry in ((env.claims, env.registry), other):
        await registry.register("w", "http://w", cpu_devices(weights=[3, 1, 2], capacity=1000))
        for i in range(7):
            await claims.resolve(f"warm-{i}")
        runs.append((claims, registry))
    k = shifted.keys
    big = 2**21
    for device, score in await env.redis.zrange(k.ring, 0, -1, withscores=True):
        w = {"w/0": 3, "w/1": 1, "w/2": 2}[device]
        await env.redis.zadd(k.ring, {device: (round(score * w) + big * w) / w})
    assert await other[1].renew("w") is not None
    assert all(s < 100 for _, s in await env.redis.zrange(k.ring, 0, -1, withscores=True))
    picks = [[(await c.resolve(f"ep-{i}")).device for i in range(12)] for c, _ in runs]
    assert picks[0] == picks[1]


# -- a node's processes in its record (issue 43) --------------------------------------------


FOUR_FRONTS = NodeProcesses(
    4,
    (
        NodeProcess("core", 4101, 1_795_983_839_120, 0, 1.0),
        NodeProcess("0", 4187, 1_795_983_840_310, 0, 2.5),
        NodeProcess("1", 5213, 1_795_984_521_775, 2, math.inf),
        NodeProcess("2", 4189, 1_795_983_840_330),
    ),
)


async def test_registration_and_renewals_publish_the_nodes_processes(env: Env) -> None:
    await env.registry.register("p", "http://p:8000", cpu_devices(1), processes=FOUR_FRONTS)
    (listed,) = await env.inventory.nodes()
    assert listed.processes == FOUR_FRONTS
    doc = listed.to_json()
    assert doc["fronts"] == 4 and len(doc["processes"]) == 4
    assert doc["processes"][1] == {
        "role": "0", "pid": 4187, "since_ms": 1_795_983_840_310, "restarts": 0, "lag_p99_ms": 2.5
    }  # fmt: skip
    assert doc["processes"][2]["lag_p99_ms"] is None  # past the largest bound: JSON null
    assert "lag_p99_ms" not in doc["processes"][3]  # no sample since the last renewal
    assert json.loads(json.dumps(doc)) == doc  # plain JSON: no Infinity
    # a renewal replaces it (front 1 restarted once more, with a new pid), in the same call
    restarted = replace(
        FOUR_FRONTS,
        processes=(*FOUR_FRONTS.processes[:2], NodeProcess("1", 6001, 1_795_984_600_000, 3)),
    )
    assert await env.registry.renew("p", processes=restarted) is not None
    (listed,) = await env.inventory.nodes()
    assert listed.processes == restarted and listed.processes.restarts == 3
    # one without processes (the second renewal that says revocations) leaves them as they are
    assert await env.registry.renew("p") is not None
    assert (await env.inventory.nodes())[0].processes == restarted


async def test_a_record_without_processes_reads_as_one_process(env: Env) -> None:
    """A node of an older version publishes nothing: it is one process (what it is)."""
    await env.node("old", 1)
    (listed,) = await env.inventory.nodes()
    assert listed.processes == ONE_PROCESS
    assert (listed.processes.fronts, listed.processes.processes) == (1, ())
    doc = listed.to_json()
    assert (doc["fronts"], doc["processes"]) == (1, [])
    # a multi-process node that re-registers publishes its shape again; an unreadable
    # field (written by hand, or by a version this one cannot read) reads as one process
    await env.registry.register("old", "http://old:8000", cpu_devices(1), processes=FOUR_FRONTS)
    assert (await env.inventory.nodes())[0].processes == FOUR_FRONTS
    for bad in ("{nope", '{"fronts": 99, "processes": []}', '{"fronts": 2}', "[1]", '"x"'):
        await env.redis.hset(env.keys.node("old"), "procs", bad)
        assert (await env.inventory.nodes())[0].processes == ONE_PROCESS, bad
    # a registration without processes keeps none from before (the record is written anew)
    await env.registry.register("old", "http://old:8000", cpu_devices(1))
    assert (await env.inventory.nodes())[0].processes == ONE_PROCESS


def test_the_description_of_processes_is_bounded() -> None:
    core = NodeProcess("core", 1, 0)
    big = [NodeProcess(str(k), 4_194_304, 1_795_983_840_310, 99_999, 2500.0) for k in range(64)]
    workers = [NodeProcess(f"dev{k}", 4_194_304, 1_795_983_840_310, 99_999) for k in range(64)]
    helpers = (NodeProcess(FORK_SERVER_ROLE, 4_194_304, 1_795_983_840_310, 99_999),) * MAX_HELPERS
    most = NodeProcesses(MAX_FRONTS, (core, *big, *workers), MAX_DEVICES_PER_NODE, helpers)
    assert len(most.encode()) < 12 * 1024  # ~10 KiB at most, written once a renewal
    with pytest.raises(InvalidArgument):
        NodeProcesses(MAX_FRONTS + 1)
    with pytest.raises(InvalidArgument):
        NodeProcesses(1, (core, NodeProcess("0", 2, 0)))  # more processes than the shape has
    with pytest.raises(InvalidArgument):
        NodeProcesses(2, (NodeProcess("x" * 9, 1, 0),))
    assert NodeProcesses.decode(most.encode()) == most
    # device workers: 0 to MAX_DEVICES_PER_NODE, each one more process the shape may list
    for bad in (-1, MAX_DEVICES_PER_NODE + 1, True):
        with pytest.raises(InvalidArgument):
            NodeProcesses(1, (), bad)
    assert NodeProcesses(1, (core, *workers[:2]), 2).processes[2].role == "dev1"
    with pytest.raises(InvalidArgument):
        NodeProcesses(1, (core, *workers[:3]), 2)
    with pytest.raises(InvalidArgument):
        NodeProcesses(4, (core, *big[:4], *workers[:3]), 2)
    assert NodeProcesses(4, (core, *big[:4], *workers[:2]), 2).restarts == 6 * 99_999


def test_device_workers_in_the_description() -> None:
    """With ``--device-workers process`` a node lists a worker per device (``dev<index>``,
    no loop lag); ``workers`` is written only when there are some, so an older reader sees
    the record it knows, and a record without it reads as none."""
    both = NodeProcesses(4, (*FOUR_FRONTS.processes, NodeProcess("dev0", 4102, 7, 1)), 2)
    doc = json.loads(both.encode())
    assert doc["workers"] == 2 and doc["processes"][-1] == {
        "role": "dev0", "pid": 4102, "since_ms": 7, "restarts": 1
    }  # fmt: skip
    assert NodeProcesses.decode(both.encode()) == both
    assert (both.fronts_down, both.workers_down, both.restarts) == (1, 1, 3)
    assert [p.is_worker for p in both.processes] == [False] * 4 + [True]
    assert "workers" not in json.loads(FOUR_FRONTS.encode())
    assert NodeProcesses.decode(FOUR_FRONTS.encode()).workers == 0
    old = '{"fronts":2,"processes":[{"role":"core","pid":1,"since_ms":0,"restarts":0}]}'
    assert NodeProcesses.decode(old) == NodeProcesses(2, (NodeProcess("core", 1, 0),))
    only = NodeProcesses(1, (NodeProcess("core", 1, 0), NodeProcess("dev1", 3, 0)), 2)
    assert (only.fronts_down, only.workers_down) == (0, 1)
    assert NodeProcesses(1, (), 2).workers_down == 0  # none listed: nothing known
    for bad in ('{"fronts":1,"workers":65,"processes":[]}', '{"fronts":1,"workers":"x",'
                '"processes":[]}'):  # fmt: skip
        assert NodeProcesses.decode(bad) == ONE_PROCESS, bad


def test_the_fork_server_is_a_helper_listed_apart() -> None:
    """The fronts' fork server (``node/forkserver.py``) is a process of the node, listed
    under ``helpers``: a key of its own, so a reader of an older version (which counts
    ``processes`` as the core, fronts and workers) still counts the fronts down right; its
    restarts count with the node's."""
    forks = NodeProcess(FORK_SERVER_ROLE, 4100, 1_795_983_839_200, 1)
    four = NodeProcesses(4, (*FOUR_FRONTS.processes, NodeProcess("3", 4190, 9)), helpers=(forks,))
    doc = json.loads(four.encode())
    assert doc["helpers"] == [
        {"role": "forksrv", "pid": 4100, "since_ms": 1_795_983_839_200, "restarts": 1}
    ]  # fmt: skip
    assert FORK_SERVER_ROLE not in [p["role"] for p in doc["processes"]]
    assert NodeProcesses.decode(four.encode()) == four
    assert (four.fronts_down, four.restarts) == (0, 3)  # front 1's two, the server's one
    old_reader = NodeProcesses(int(doc["fronts"]), tuple(map(NodeProcess.from_json,
                                                             doc["processes"])))  # fmt: skip
    assert old_reader.fronts_down == 0  # (were the server a front, 4 would seem 5)
    assert "helpers" not in json.loads(FOUR_FRONTS.encode())
    assert NodeProcesses.decode(FOUR_FRONTS.encode()).helpers == ()
    with pytest.raises(InvalidArgument):
        NodeProcesses(2, helpers=(forks,) * (MAX_HELPERS + 1))
    with pytest.raises(InvalidArgument):
        NodeProcesses(2, helpers=(NodeProcess("x" * 9, 1, 0),))
    # helpers a reader need not understand (a later version's) are left out, never the record
    later = json.loads(four.encode())
    later["helpers"] = [{"role": "forksrv"}, {"role": "x" * 9, "pid": 1, "since_ms": 0},
                        *later["helpers"] * (MAX_HELPERS + 2)]  # fmt: skip
    read = NodeProcesses.decode(json.dumps(later))
    assert read == replace(four, helpers=(forks,) * MAX_HELPERS)
    for odd in ('"x"', "[1]", "null"):
        assert NodeProcesses.decode(four.encode()[:-1] + f',"helpers":{odd}}}').helpers == ()
