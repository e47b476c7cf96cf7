"""The live hand-over's copy (issue 41): a copy is not an owner until the commit says so.

In process, on fakeredis and a real redis-server. Each test forces one race of the issue
at the moment it happens with real processes (tests/test_handover_relay.py runs them with
a slow Redis link): a new owner's flush or registration between the install and a late
commit, an undo during a move, Redis losing its data or going back to an older snapshot, a
target that starts leaving as the record arrives, a graceful stop whose timeout fires.
Each test but the last was run against the code before this change (on fakeredis) and
failed there.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from affinity import Keys
from node.episodes import Episode
from node.errors import Refused
from node.forward import MOVE_PATH
from node.transfer import Install, decode_install, encode_install
from tests.inproc import Gate, cluster, config
from tests.test_handover import expect, held, observations, on, two

pytestmark = pytest.mark.anyio
KEYS = Keys()


def claim(value: str) -> tuple[str, int, str]:
    device, token, claim_id = value.split(" ")[:3]
    return device, int(token), claim_id


async def test_a_late_commit_finds_the_copy_its_new_owner_flushed_meanwhile(redis: Any) -> None:
    """The old owner's commit lands after the new owner's flush and its re-registration
    (a slow link to Redis): the copy was neither slid (which found it lost, dropped it and
    remembered its claim as ended: every later step 503 ``owner_refused``) nor re-asserted;
    it waits, and the commit confirms it. No reset, the state goes on."""
    obs = observations(41, 3)
    async with cluster(redis, two()) as ([a, b], _):
        ep = (await on("a", a, "late", obs[0]))["episode_id"]
        mover = a.service.owner.mover
        commit = mover.transfers.commit
        flusher = b.service.owner.flusher

        async def slow(*args: Any, **kw: Any) -> Any:
            copy = b.service.table.copy_of(ep)
            assert copy is not None and b.service.table.get(ep) is None
            assert all(h.episode != ep for h in flusher.held())  # never re-asserted
            flusher._slid.clear()  # every record due, as after a change of Redis server
            await b.service.owner.flush()
            assert b.service.table.copy_of(ep) is copy  # not slid, not dropped
            return await commit(*args, **kw)

        mover.transfers.commit = slow  # type: ignore[method-assign]
        try:
            assert await a.service.owner.handovers.hand_over(ep, "drain") == "moved"
        finally:
            mover.transfers.commit = commit  # type: ignore[method-assign]
        r = (await a.act(episode_id=ep, inputs={"obs": obs[1].tolist()})).json()
        assert (r["node"], r["seq"], r["state_reset"]) == ("b", 2, False), r
        expect(obs[:2], r)


async def test_a_copy_its_new_owner_settles_away_can_never_be_committed(redis: Any) -> None:
    """The new owner drops a copy only through Redis (settle), which deletes the
    reservation's mark in the same step: the commit that comes later is refused, the old
    owner keeps the episode with its state, and the drop ended no claim on the new owner.
    The drain that could not move it says so in a ``move-kept`` event."""
    obs = observations(42, 3)
    async with cluster(redis, two()) as ([a, b], _):
        ep = (await on("a", a, "settled", obs[0]))["episode_id"]
        mover = a.service.owner.mover
        commit = mover.transfers.commit
        copies: list[Episode] = []

        async def late(*args: Any, **kw: Any) -> Any:
            copy = held(b, ep)
            assert copy is not None
            copies.append(copy)
            await b.service.owner.mover.settle(0.0)  # unconfirmed too long: settled
            assert held(b, ep) is None
            return await commit(*args, **kw)

        mover.transfers.commit = late  # type: ignore[method-assign]
        try:
            assert await a.service.owner.handovers.hand_over(ep, "drain") == "kept"
        finally:
            mover.transfers.commit = commit  # type: ignore[method-assign]
        assert copies[0].claim not in b.service.table._ended
        assert claim(await redis.get(KEYS.episode(ep)))[0] == "a/0"
        assert await redis.get(KEYS.transfer(ep)) is None
        assert await redis.zrange(KEYS.load("b/0"), 0, -1) == []
        r = (await b.act(episode_id=ep, inputs={"obs": obs[1].tolist()})).json()
        assert (r["node"], r["seq"], r["state_reset"]) == ("a", 2, False), r
        expect(obs[:2], r)
        kept = [f for _, f in await redis.xrange(KEYS.events) if f["type"] == "move-kept"]
        assert [(k["episode"], k["reason"], k["why"]) for k in kept] == [(ep, "drain", "refused")]


async def test_a_drain_with_nowhere_to_go_writes_a_move_kept_event(redis: Any) -> None:
    """``affinity drain DEV --move`` when nothing can take the episodes: besides the
    owner's log line, an event the operator sees (``affinity events``, the fleet page)."""
    async with cluster(redis, [config("a", devices="cpu:1")]) as ([a], _):
        obs = observations(43, 1)
        await a.act(episode_id="stuck", inputs={"obs": obs[0].tolist()})
        assert await a.service.owner.handovers.hand_over("stuck", "drain") == "kept"
        kept = [f for _, f in await redis.xrange(KEYS.events) if f["type"] == "move-kept"]
        assert [(k["episode"], k["device"], k["reason"], k["why"]) for k in kept] == [
            ("stuck", "a/0", "drain", "none")
        ]


async def test_a_copy_whose_confirmation_was_lost_is_confirmed_by_its_settle(
    redis: Any,
) -> None:
    """The old owner's ``confirm`` never arrives and no step comes: the new owner's settle
    asks Redis, finds the claim committed, and serves the copy from memory."""
    obs = observations(44, 2)
    async with cluster(redis, two()) as ([a, b], _):
        ep = (await on("a", a, "unconfirmed", obs[0]))["episode_id"]
        mover = a.service.owner.mover
        tell = mover._tell

        async def lost(*args: Any, **kw: Any) -> None:
            return None

        mover._tell = lost  # type: ignore[method-assign]
        try:
            assert await a.service.owner.handovers.hand_over(ep, "move") == "moved"
        finally:
            mover._tell = tell  # type: ignore[method-assign]
        copy = b.service.table.copy_of(ep)
        assert copy is not None and not copy.confirmed and b.service.table.get(ep) is None
        await b.service.owner.mover.settle(0.0)
        assert copy.confirmed and b.service.table.get(ep) is copy
        assert b.service.owner.serving(ep) is not None


async def test_an_undo_before_the_commit_is_sent_spoils_the_move_which_starts_again(
    redis: Any,
) -> None:
    """An undo reaches the old owner while its record travels: it is applied there, and
    the move sends the record again; the client's retry of the undone step is applied
    once, at the new owner, with no reset. (The move used to commit the record it had read,
    the failed step in it, and the retry was applied a second time, silently.)"""
    obs = observations(45, 3)
    async with cluster(redis, two()) as ([a, b], router):
        ep = (await on("a", a, "undo-early", obs[0]))["episode_id"]
        r = (await a.act(episode_id=ep, inputs={"obs": obs[1].tolist()})).json()
        assert (r["node"], r["seq"]) == ("a", 2)  # its reply is lost: the router undoes it
        post = router.post
        sent: list[int] = []

        async def undo_meanwhile(url: str, body: bytes, path: str = "") -> Any:
            if path == MOVE_PATH and not sent:
                sent.append(1)
                await a.service.owner.undo(ep, 2)
            return await post(url, body, path) if path else await post(url, body)

        router.post = undo_meanwhile  # type: ignore[method-assign]
        try:
            assert await a.service.owner.handovers.hand_over(ep, "drain") == "moved"
        finally:
            router.post = post  # type: ignore[method-assign]
        record = held(b, ep)
        assert record is not None and record.seq == 1
        r = (await a.act(episode_id=ep, inputs={"obs": obs[1].tolist()})).json()
        assert (r["node"], r["seq"], r["state_reset"]) == ("b", 2, False), r
        expect(obs[:2], r)


async def test_an_undo_during_the_commit_waits_and_follows_the_record(redis: Any) -> None:
    """An undo that arrives while the commit is on its way waits for it, then follows the
    record to the new owner, where the copy's history before the step did not move: the
    retry says ``state_reset`` (never the failed step applied twice, silently)."""
    obs = observations(46, 3)
    async with cluster(redis, two()) as ([a, b], _):
        ep = (await on("a", a, "undo-late", obs[0]))["episode_id"]
        r = (await a.act(episode_id=ep, inputs={"obs": obs[1].tolist()})).json()
        assert (r["node"], r["seq"]) == ("a", 2)
        mover = a.service.owner.mover
        commit = mover.transfers.commit
        undos: list[asyncio.Task[None]] = []

        async def undo_meanwhile(*args: Any, **kw: Any) -> Any:
            undos.append(asyncio.create_task(a.service.owner.undo(ep, 2)))
            await asyncio.sleep(0.01)
            assert not undos[0].done()  # it waits for the move
            return await commit(*args, **kw)

        mover.transfers.commit = undo_meanwhile  # type: ignore[method-assign]
        try:
            assert await a.service.owner.handovers.hand_over(ep, "drain") == "moved"
        finally:
            mover.transfers.commit = commit  # type: ignore[method-assign]
        await undos[0]
        record = held(b, ep)
        assert record is not None and record.doubt
        r = (await a.act(episode_id=ep, inputs={"obs": obs[1].tolist()})).json()
        assert (r["node"], r["state_reset"]) == ("b", True), r
        expect(obs[1:2], r)  # started over from this step, said


async def test_redis_restored_from_before_a_move_reassigns_the_old_claim_at_once(
    redis: Any,
) -> None:
    """Redis goes back to a snapshot taken before a completed move: it names the old
    claim, which the old owner ended when it handed the episode over. The old owner hands
    that claim over in Redis at the first refused step: the step is ``reassigned`` with
    ``state_reset`` (said), never 503 ``owner_refused`` for as long as the robot retries;
    the new owner's next flush drops its record (no second owner past it)."""
    obs = observations(47, 4)
    async with cluster(redis, two()) as ([a, b], _):
        ep = (await on("a", a, "snapshot", obs[0]))["episode_id"]
        before = await redis.get(KEYS.episode(ep))
        assert await a.service.owner.handovers.hand_over(ep, "drain") == "moved"
        await redis.set(KEYS.episode(ep), before, px=60_000)  # the older snapshot
        await redis.zadd(KEYS.load("a/0"), {ep: 10**13})
        r = await a.act(episode_id=ep, inputs={"obs": obs[1].tolist()})
        assert r.status_code == 200, r.text
        assert (r.json()["routing"], r.json()["state_reset"]) == ("reassigned", True)
        value = claim(await redis.get(KEYS.episode(ep)))
        flusher = b.service.owner.flusher
        flusher._slid.clear()  # the renewal saw another run_id: every record is due
        await b.service.owner.flush()
        for node in (a, b):
            record = held(node, ep)
            assert record is None or (record.device, record.token, record.claim) == value
        for i in (2, 3):
            r = await b.act(episode_id=ep, inputs={"obs": obs[i].tolist()})
            assert r.status_code == 200 and r.json()["state_reset"] is False, r.text
        expect(obs[1:4], r.json())


async def test_redis_restarted_empty_mid_move_keeps_one_owner_with_the_state(
    redis: Any,
) -> None:
    """Redis loses its data between the install and the commit: the commit is refused
    (no assignment, no reservation), the old owner keeps its record and re-asserts it; the
    new owner re-registers without the copy (it used to re-assert it: two owners, then
    none) and its settle drops it. The episode goes on at the old owner, no reset."""
    obs = observations(48, 2)
    async with cluster(redis, two()) as ([a, b], _):
        ep = (await on("a", a, "empty", obs[0]))["episode_id"]
        mover = a.service.owner.mover
        commit = mover.transfers.commit

        async def lost_everything(*args: Any, **kw: Any) -> Any:
            await redis.flushdb()
            assert await b.service.lease.renew_once()  # b re-registers first
            return await commit(*args, **kw)

        mover.transfers.commit = lost_everything  # type: ignore[method-assign]
        try:
            assert await a.service.owner.handovers.hand_over(ep, "drain") == "kept"
        finally:
            mover.transfers.commit = commit  # type: ignore[method-assign]
        assert await redis.get(KEYS.episode(ep)) is None  # never re-asserted by b
        assert await a.service.lease.renew_once()
        assert claim(await redis.get(KEYS.episode(ep)))[0] == "a/0"
        await b.service.owner.mover.settle(0.0)
        assert held(b, ep) is None
        r = (await b.act(episode_id=ep, inputs={"obs": obs[1].tolist()})).json()
        assert (r["node"], r["seq"], r["state_reset"]) == ("a", 2, False), r
        expect(obs[:2], r)


async def test_a_target_that_starts_leaving_as_the_record_arrives_refuses_it(
    redis: Any,
) -> None:
    """SIGTERM reaches the target as the record arrives: it refuses the install (503
    ``leaving``) and the old owner keeps the episode (a drain) with its state; a target
    that starts leaving after it installed is refused by the commit."""
    obs = observations(49, 3)
    async with cluster(redis, two()) as ([a, b], _):
        ep = (await on("a", a, "leaving", obs[0]))["episode_id"]
        b.service.lease.leaving = True  # its SIGTERM, before its leave reached Redis
        try:
            assert await a.service.owner.handovers.hand_over(ep, "drain") == "kept"
        finally:
            b.service.lease.leaving = False
        assert held(b, ep) is None
        mover = a.service.owner.mover
        commit = mover.transfers.commit

        async def leaves(*args: Any, **kw: Any) -> Any:
            await b.service.registry.leave("b", b.service.lease.instance)
            return await commit(*args, **kw)

        mover.transfers.commit = leaves  # type: ignore[method-assign]
        try:
            assert await a.service.owner.handovers.hand_over(ep, "drain") == "kept"
        finally:
            mover.transfers.commit = commit  # type: ignore[method-assign]
        assert held(b, ep) is None
        r = (await a.act(episode_id=ep, inputs={"obs": obs[1].tolist()})).json()
        assert (r["node"], r["seq"], r["state_reset"]) == ("a", 2, False), r


async def test_an_install_never_replaces_a_live_record(redis: Any) -> None:
    """A record arriving for an episode the node serves (a confirmed record) is refused
    409; the live record stays."""
    obs = observations(50, 2)
    async with cluster(redis, two()) as ([a, b], _):
        ep = (await on("b", a, "live", obs[0]))["episode_id"]
        live = held(b, ep)
        assert live is not None
        other = Episode(
            "b/0", live.token + 1, "ab" * 8, dict(live.state), 0.0, 7, None, model=live.model
        )
        body = encode_install(Install(ep, "b/0", other.token, other.claim, "a", other), 0.0)
        mover = b.service.owner.mover
        install = decode_install(body, mover.contracts, mover.clock())
        with pytest.raises(Refused) as refused:
            await mover.receive(install, b.service.owner.local_devices)
        assert refused.value.status == 409
        assert held(b, ep) is live


async def test_a_graceful_stop_whose_timeout_fires_counts_what_moved(
    redis: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """``--drain-timeout`` fires while the moves are on their way: they finish, and the log
    line counts them (it said "moved 0 … handed over 0" while they went on and succeeded)."""
    obs = observations(51, 1)
    cfgs = [config("a", devices="cpu:1"), config("b", devices="cpu:1")]
    async with cluster(redis, cfgs) as ([a, b], router):
        eps = []
        for i in range(4):
            eps.append((await on("a", a, f"stop{i}", obs[0]))["episode_id"])
        post = router.post

        async def slow(url: str, body: bytes, path: str = "") -> Any:
            if path == MOVE_PATH:
                await asyncio.sleep(1.0)
            return await post(url, body, path) if path else await post(url, body)

        router.post = slow  # type: ignore[method-assign]
        # The timeout fires while the moves that began are on their way. On a busy machine
        # a move may not begin before it fires: it is handed over by the deregistration, and
        # the line must count it there, not among the moved.
        a.service.owner.handovers.drain_timeout_s = 0.15
        try:
            with caplog.at_level(logging.INFO, logger="affinity.node"):
                await a.service.owner.leave()
        finally:
            router.post = post  # type: ignore[method-assign]
        moved = int(a.service.metrics.moves.labels("stop", "moved")._value.get())
        assert 1 <= moved <= len(set(eps))
        lines = [r.getMessage() for r in caplog.records if " left: " in r.getMessage()]
        assert len(lines) == 1 and f"moved {moved} episode(s)" in lines[0], lines
        assert "--drain-timeout" in lines[0]
        assert sum(held(b, ep) is not None for ep in set(eps)) == moved


async def test_a_move_between_two_devices_of_one_node_keeps_the_record_until_the_commit(
    redis: Any,
) -> None:
    """A drain of one device moves its episode to another device of the same node: the
    copy waits beside the live record (an install never replaces a live record) and
    becomes the record at the commit; a refused commit leaves the live record serving."""
    obs = observations(52, 3)
    async with cluster(redis, [config("a", devices="cpu:2")]) as ([a], _):
        ep = "same-node"
        first = (await a.act(episode_id=ep, inputs={"obs": obs[0].tolist()})).json()
        other = "a/1" if first["device"] == "a/0" else "a/0"
        mover = a.service.owner.mover
        commit = mover.transfers.commit
        seen: list[bool] = []

        async def beside(*args: Any, **kw: Any) -> Any:
            seen.append(a.service.table.get(ep) is not None and held(a, ep) is not None)
            seen.append(a.service.table.copy_of(ep) is not None)
            return await commit(*args, **kw)

        mover.transfers.commit = beside  # type: ignore[method-assign]
        try:
            assert await a.service.owner.handovers.hand_over(ep, "move", other) == "moved"
        finally:
            mover.transfers.commit = commit  # type: ignore[method-assign]
        assert seen == [True, True]
        r = (await a.act(episode_id=ep, inputs={"obs": obs[1].tolist()})).json()
        assert (r["device"], r["seq"], r["state_reset"]) == (other, 2, False), r
        expect(obs[:2], r)


async def test_a_first_step_claimed_as_the_stop_begins_moves_with_its_state(redis: Any) -> None:
    """A new episode's first step was claimed in Redis just before its node began a
    graceful stop, and is still running when the stop looks at what it holds: there is no
    record of it yet. The stop hands it over once that step finished, with its state.
    (It was dropped at the deregistration: its next step said ``state_reset``.)"""
    obs = observations(53, 2)
    obs[0][0, 0] = 9  # the Gate holds this run until told
    Gate.go.clear()
    Gate.entered.clear()
    gated = {"session_factory": lambda spec: (Gate(spec), "CPU")}
    try:
        async with cluster(redis, two(), **gated) as (nodes, _):
            ep = "late-first"
            first = asyncio.create_task(
                nodes[0].act(episode_id=ep, inputs={"obs": obs[0].tolist()})
            )
            assert await asyncio.to_thread(Gate.entered.wait, 30)
            on_a = claim(await redis.get(KEYS.episode(ep)))[0] == "a/0"
            leaving, other = (nodes[0], nodes[1]) if on_a else (nodes[1], nodes[0])
            table = leaving.service.table
            assert table.get(ep) is None and table.in_flight(ep)
            looked = asyncio.Event()
            owned = table.owned

            def spy() -> Any:
                if leaving.service.lease.leaving:
                    looked.set()  # the stop looks at what it holds
                return owned()

            table.owned = spy  # type: ignore[method-assign]
            stop = asyncio.create_task(leaving.service.owner.leave())
            await asyncio.wait_for(looked.wait(), 30)
            Gate.go.set()  # only now does the first step finish
            r0 = (await first).json()
            await asyncio.wait_for(stop, 60)
            assert (r0["seq"], r0["state_reset"]) == (1, False), r0
            r = (await other.act(episode_id=ep, inputs={"obs": obs[1].tolist()})).json()
            want = "b" if on_a else "a"
            assert (r["node"], r["seq"], r["state_reset"]) == (want, 2, False), r
            expect(obs[:2], r)
    finally:
        Gate.go.set()


async def test_a_stop_counts_as_kept_only_what_the_deregistration_hands_over(
    redis: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The stop also looks at the episodes whose step is in flight without a record (a
    first step claimed as it began); one that has no record by its turn (that step
    failed) leaves nothing to keep. The log line counted it "kept for the deregistration"
    all the same; it counts the records still held when the node deregisters."""
    obs = observations(54, 1)
    async with cluster(redis, two()) as (nodes, _):
        a = nodes[0]
        ep = (await on("a", a, "stays", obs[0]))["episode_id"]
        table = a.service.table
        stepping = table.stepping_episodes
        table.stepping_episodes = lambda: [*stepping(), "failed-first-step"]  # type: ignore[method-assign]
        for other in (n for n in nodes if n is not a):  # nowhere to go: the stop resets it
            for device in other.service.device_ids:
                await other.service.registry.drain(device)
        with caplog.at_level(logging.INFO, logger="affinity.node"):
            await a.service.owner.leave()
        lines = [r.getMessage() for r in caplog.records if " left: " in r.getMessage()]
        assert len(lines) == 1, lines
        assert "handed over 1 without, kept 0 for the deregistration" in lines[0], lines
        assert table.get(ep) is None
