"""Live episode hand-over (issue 35), in process on fakeredis and a real redis-server: an
episode moves to another node with everything its owner remembers — recurrent state,
``seq`` and the stored reply, the action buffer, the chunk real-time chunking sent — and
its robot notices nothing; each step of the transfer failing leaves one owner."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from affinity import BackendUnavailable, Keys
from affinity.registry import MoveRequest
from node.models import DEMO_MODEL
from tests.inproc import InProcNode, cluster, config
from tests.rollout import reference_rollout

pytestmark = pytest.mark.anyio
KEYS = Keys()


def observations(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, 8)).astype(np.float32) for _ in range(n)]


def expect(history: list[np.ndarray], reply: dict[str, Any]) -> None:
    want = reference_rollout(DEMO_MODEL, history)[-1]["actions"]
    got = np.asarray(reply["outputs"]["actions"], np.float32).reshape(want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-5)


async def on(node: str, via: InProcNode, prefix: str, obs: np.ndarray) -> dict[str, Any]:
    """The first step of an episode that landed on ``node``."""
    for i in range(16):
        r = (await via.act(episode_id=f"{prefix}-{i}", inputs={"obs": obs.tolist()})).json()
        if r["node"] == node:
            return dict(r)
    raise AssertionError(f"nothing landed on {node}")


def held(node: InProcNode, episode: str) -> Any:
    """The record ``node`` holds for ``episode``, or else the copy a move installed."""
    table = node.service.table
    return table.get(episode) or table.copy_of(episode)


def two() -> list[Any]:
    return [config("a", devices="cpu:1"), config("b", devices="cpu:1")]


async def test_a_moved_episode_goes_on_with_its_state_through_either_node(redis: Any) -> None:
    obs = observations(1, 6)
    async with cluster(redis, two()) as ([a, b], _):
        first = await on("a", a, "move", obs[0])
        ep = first["episode_id"]
        second = (await b.act(episode_id=ep, inputs={"obs": obs[1].tolist()}, seq=2)).json()
        assert (second["node"], second["seq"]) == ("a", 2)
        assert await a.service.owner.handovers.hand_over(ep, "move") == "moved"
        assert a.service.table.get(ep) is None
        record = held(b, ep)
        assert record is not None and record.seq == 2
        value = (await redis.get(KEYS.episode(ep))).split(" ")
        assert (value[0], int(value[1]), value[2]) == ("b/0", record.token, record.claim)
        retry = (await a.act(episode_id=ep, inputs={"obs": obs[1].tolist()}, seq=2)).json()
        assert retry["replayed"] and retry["node"] == "b"  # its stored reply moved too
        history = obs[:2]
        for i, via in ((2, a), (3, b), (4, a), (5, b)):
            history = obs[: i + 1]
            r = (await via.act(episode_id=ep, inputs={"obs": obs[i].tolist()})).json()
            assert (r["node"], r["seq"], r["state_reset"]) == ("b", i + 1, False), r
            expect(history, r)
        moved = [f for _, f in await redis.xrange(KEYS.events) if f["type"] == "moved"]
        assert [(m["from"], m["to"], m["reason"]) for m in moved] == [("a/0", "b/0", "move")]
        assert int(moved[0]["bytes"]) > 0
        moves = a.service.metrics.moves.labels("move", "moved")._value.get()
        assert moves == 1


async def test_steps_that_arrive_during_a_move_wait_and_reach_the_new_owner(redis: Any) -> None:
    obs = observations(2, 3)
    async with cluster(redis, two()) as ([a, b], _):
        ep = (await on("a", a, "wait", obs[0]))["episode_id"]
        table = a.service.table
        assert table.begin_move(ep)  # a hand-over is under way
        waiting = asyncio.create_task(a.act(episode_id=ep, inputs={"obs": obs[1].tolist()}))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # it waits for the hand-over
        table.end_move(ep)  # (this one moved nothing: the step goes on at a)
        r = (await waiting).json()
        assert (r["node"], r["seq"]) == ("a", 2)
        move = asyncio.create_task(a.service.owner.handovers.hand_over(ep, "move"))
        during = asyncio.create_task(b.act(episode_id=ep, inputs={"obs": obs[2].tolist()}))
        assert await move == "moved"
        r = (await during).json()
        assert (r["node"], r["seq"], r["state_reset"]) == ("b", 3, False), r
        expect(obs, r)


async def test_with_nowhere_to_go_a_stop_hands_over_without_state_and_says_so(
    redis: Any,
) -> None:
    async with cluster(redis, [config("a", devices="cpu:1")]) as ([a], _):
        obs = observations(3, 3)
        ep = (await a.act(episode_id="alone", inputs={"obs": obs[0].tolist()})).json()
        assert await a.service.owner.handovers.hand_over("alone", "drain") == "kept"  # stays, as is
        r = (await a.act(episode_id="alone", inputs={"obs": obs[1].tolist()})).json()
        assert (r["seq"], r["state_reset"]) == (2, False)
        assert await a.service.owner.handovers.hand_over("alone", "stop") == "reset"
        assert (await redis.get(KEYS.episode("alone"))).endswith(" moved")
        r = (await a.act(episode_id="alone", inputs={"obs": obs[2].tolist()})).json()
        assert (r["routing"], r["state_reset"]) == ("reassigned", True)
        assert r["token"] != ep["token"]


async def test_a_move_whose_record_cannot_be_sent_leaves_the_old_owner_serving(
    redis: Any,
) -> None:
    """The new owner is unreachable: the reservation is taken back. A drain's move leaves
    the episode where it was, with its state (a drain never resets anything); a graceful
    stop's hands it over without its state, said."""
    obs = observations(4, 4)
    async with cluster(redis, two()) as ([a, b], router):
        ep = (await on("a", a, "unsent", obs[0]))["episode_id"]
        router.down.add("b.test")
        assert await a.service.owner.handovers.hand_over(ep, "drain") == "kept"
        assert await redis.zrange(KEYS.load("b/0"), 0, -1) == []  # the reservation is gone
        assert held(b, ep) is None
        r = (await a.act(episode_id=ep, inputs={"obs": obs[1].tolist()})).json()
        assert (r["node"], r["seq"], r["state_reset"]) == ("a", 2, False), r
        expect(obs[:2], r)
        assert await a.service.owner.handovers.hand_over(ep, "stop") == "reset"
        assert await redis.zrange(KEYS.load("b/0"), 0, -1) == []
        router.down.clear()
        r = (await b.act(episode_id=ep, inputs={"obs": obs[2].tolist()})).json()
        assert (r["routing"], r["state_reset"]) == ("reassigned", True)


async def test_a_node_that_left_routes_the_steps_still_sent_to_it(redis: Any) -> None:
    """After a graceful stop deregistered a, a step a load balancer still sent to a (in
    flight while it left) is routed to its owner, not refused 503 ``fenced``; a stateless
    one is refused ``leaving`` (it would run on a device that is going away)."""
    obs = observations(10, 3)
    async with cluster(redis, two()) as ([a, _b], _):
        ep = (await on("b", a, "straggler", obs[0]))["episode_id"]
        await a.service.owner.leave()
        r = await a.act(episode_id=ep, inputs={"obs": obs[1].tolist()})
        assert r.status_code == 200, r.text
        assert (r.json()["node"], r.json()["seq"], r.json()["state_reset"]) == ("b", 2, False)
        r = await a.act(inputs={"obs": obs[2].tolist()})
        assert (r.status_code, r.json()["error"]["code"]) == (503, "leaving")


async def test_a_commit_refused_keeps_one_owner_and_nothing_is_served_from_the_copy(
    redis: Any,
) -> None:
    """The old owner's lease lapsed before its commit (a pause): Redis refuses the commit,
    the copy the new owner installed is never served from memory (and is dropped), the
    episode stays the old claim's for Redis' own rules to decide."""
    obs = observations(5, 3)
    async with cluster(redis, two()) as ([a, b], _):
        ep = (await on("a", a, "fenced", obs[0]))["episode_id"]
        commit = a.service.owner.mover.transfers.commit

        async def lease_gone(*args: Any, **kw: Any) -> Any:
            await redis.zadd(KEYS.nodes, {"a": 1})  # a's lease lapsed meanwhile
            return await commit(*args, **kw)

        a.service.owner.mover.transfers.commit = lease_gone  # type: ignore[method-assign]
        assert await a.service.owner.handovers.hand_over(ep, "move") == "kept"
        assert held(b, ep) is None  # told to drop its copy
        value = (await redis.get(KEYS.episode(ep))).split(" ")
        assert value[0] == "a/0"
        assert await redis.zrange(KEYS.load("b/0"), 0, -1) == []


async def test_a_commit_whose_answer_is_lost_asks_redis_until_it_knows(redis: Any) -> None:
    """The commit ran in Redis but its answer was lost (a pool exhausted, a dropped
    connection), and the first lookups fail too: the old owner asks again until Redis
    answers, and the move completes: the new owner is told, nothing is dropped, the
    episode goes on with its state. (Dropping the copy on a guess left the episode with an
    owner that refused it until that owner stopped: a reset, and 503s meanwhile.)"""
    obs = observations(8, 3)
    async with cluster(redis, two()) as ([a, _b], _):
        first = await on("a", a, "lost-answer", obs[0])
        ep = first["episode_id"]
        mover = a.service.owner.mover
        commit, lookup = mover.transfers.commit, mover.lease_claims.lookup
        failures = [2]

        async def answer_lost(*args: Any, **kw: Any) -> Any:
            await commit(*args, **kw)
            raise BackendUnavailable("connection lost after the commit")

        async def flaky_lookup(*args: Any, **kw: Any) -> Any:
            if failures[0]:
                failures[0] -= 1
                raise BackendUnavailable("still down")
            return await lookup(*args, **kw)

        mover.transfers.commit = answer_lost  # type: ignore[method-assign]
        mover.lease_claims.lookup = flaky_lookup  # type: ignore[method-assign]
        try:
            assert await a.service.owner.handovers.hand_over(ep, "drain") == "moved"
        finally:
            mover.transfers.commit = commit  # type: ignore[method-assign]
            mover.lease_claims.lookup = lookup  # type: ignore[method-assign]
        assert failures == [0] and a.service.table.get(ep) is None
        r = (await a.act(episode_id=ep, inputs={"obs": obs[1].tolist()}, seq=2)).json()
        assert (r["node"], r["seq"], r["state_reset"]) == ("b", 2, False), r
        expect(obs[:2], r)


async def test_a_commit_never_known_before_the_lease_ends_tells_nothing_on_a_guess(
    redis: Any,
) -> None:
    """The commit's answer is lost and Redis cannot be asked until the old owner's lease
    is over: it tells the new owner nothing (no drop on a guess) and keeps no claim to
    serve (its fence drops the record). Redis moved the episode, so the new owner's copy
    is served once a routed step confirms it: state kept, one owner."""
    obs = observations(9, 3)
    async with cluster(redis, two()) as ([a, b], _):
        ep = (await on("a", a, "never-known", obs[0]))["episode_id"]
        mover = a.service.owner.mover
        commit, lookup, tell = mover.transfers.commit, mover.lease_claims.lookup, mover._tell
        told: list[str] = []

        async def answer_lost(*args: Any, **kw: Any) -> Any:
            await commit(*args, **kw)
            raise BackendUnavailable("connection lost after the commit")

        async def down(*args: Any, **kw: Any) -> Any:
            a.service.lease.deadline = a.service.clock() - 1  # the lease runs out meanwhile
            raise BackendUnavailable("down")

        async def spy(to: Any, episode: str, op: str, claim: str = "") -> None:
            told.append(op)
            await tell(to, episode, op, claim)

        mover.transfers.commit = answer_lost  # type: ignore[method-assign]
        mover.lease_claims.lookup = down  # type: ignore[method-assign]
        mover._tell = spy  # type: ignore[method-assign]
        try:
            assert await a.service.owner.handovers.hand_over(ep, "drain") == "kept"
        finally:
            mover.transfers.commit = commit  # type: ignore[method-assign]
            mover.lease_claims.lookup = lookup  # type: ignore[method-assign]
            mover._tell = tell  # type: ignore[method-assign]
        assert told == []
        copy = held(b, ep)
        assert copy is not None and not copy.confirmed
        assert a.service.owner.serving(ep) is None  # the old owner serves nothing
        r = (await b.act(episode_id=ep, inputs={"obs": obs[1].tolist()}, seq=2)).json()
        assert (r["node"], r["seq"], r["state_reset"]) == ("b", 2, False), r
        expect(obs[:2], r)


async def test_an_unconfirmed_copy_is_never_served_from_memory(redis: Any) -> None:
    obs = observations(6, 3)
    async with cluster(redis, two()) as ([a, b], router):
        ep = (await on("a", a, "copy", obs[0]))["episode_id"]
        confirm = a.service.owner.mover._tell

        async def never(*args: Any, **kw: Any) -> None:  # the commit's news never arrives
            return None

        a.service.owner.mover._tell = never  # type: ignore[method-assign]
        commit = a.service.owner.mover.transfers.commit

        async def refused(*args: Any, **kw: Any) -> Any:
            from affinity.transfers import NotPlaced

            return NotPlaced("lease")

        a.service.owner.mover.transfers.commit = refused  # type: ignore[method-assign]
        assert await a.service.owner.handovers.hand_over(ep, "move") == "kept"
        record = held(b, ep)
        assert record is not None and not record.confirmed  # installed, never confirmed
        assert b.service.owner.serving(ep) is None
        r = (await b.act(episode_id=ep, inputs={"obs": obs[1].tolist()})).json()
        assert (r["node"], r["seq"]) == ("a", 2)  # Redis still names a: b forwards there
        a.service.owner.mover._tell = confirm  # type: ignore[method-assign]
        a.service.owner.mover.transfers.commit = commit  # type: ignore[method-assign]
        _ = router


async def test_an_operators_move_and_drain_with_move_reach_the_owner_at_its_renewal(
    redis: Any,
) -> None:
    obs = observations(7, 4)
    cfgs = [config("a", devices="cpu:2"), config("b", devices="cpu:1")]
    async with cluster(redis, cfgs) as ([a, b], _):
        eps = [(await on("a", a, f"op{i}", obs[0]))["episode_id"] for i in range(2)]
        registry = a.service.registry
        await registry.request_move("a", MoveRequest(episode=eps[0], target="b"))
        await a.service.lease.renew_once()
        await asyncio.gather(*list(a.service.owner.handovers._moving))
        assert b.service.table.get(eps[0]) is not None
        device = a.service.table.get(eps[1]).device  # type: ignore[union-attr]
        await registry.drain(device, "maintenance")
        await registry.request_move("a", MoveRequest(device=device))
        await a.service.lease.renew_once()
        await asyncio.gather(*list(a.service.owner.handovers._moving))
        for ep in eps:
            r = (await a.act(episode_id=ep, inputs={"obs": obs[1].tolist()})).json()
            assert (r["node"], r["seq"], r["state_reset"]) == ("b", 2, False), r
            expect(obs[:1] + obs[1:2], r)


async def test_a_state_kept_on_the_device_moves_with_its_episode(redis: Any) -> None:
    """With ``--cuda-graph`` each episode's state stays on its device between steps
    (``node.binding.DeviceTensor``; here a BoundSession on the CPU, the same code). A move
    copies it to the host for the message, and the new owner goes on from it. (Before, the
    move failed encoding the handle, so a graceful stop handed such episodes over without
    their state, and a drain's move raised.)"""
    from node.binding import BoundSession, DeviceTensor
    from node.contract import load_contract
    from node.providers import ProviderSettings, build_session

    def bound(spec: Any) -> tuple[Any, str]:
        session = build_session(DEMO_MODEL, spec, ProviderSettings()).session
        return BoundSession(session, load_contract(DEMO_MODEL), "cpu", 0), "CPU"

    obs = observations(61, 3)
    async with cluster(redis, two(), session_factory=bound) as ([a, b], _):
        ep = (await on("a", a, "on-device", obs[0]))["episode_id"]
        record = a.service.table.get(ep)
        assert record is not None and isinstance(record.state["state_in.hidden"], DeviceTensor)
        state = a.service.table.state_of(ep)
        assert state is not None and isinstance(state["state_in.hidden"], np.ndarray)
        assert await a.service.owner.handovers.hand_over(ep, "move") == "moved"
        for i, via in ((1, a), (2, b)):
            r = (await via.act(episode_id=ep, inputs={"obs": obs[i].tolist()})).json()
            assert (r["node"], r["seq"], r["state_reset"]) == ("b", i + 1, False), r
            expect(obs[: i + 1], r)
