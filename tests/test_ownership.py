"""Owner-authoritative hits (issue 22), in-process on fakeredis and a real redis-server: a
step at its owner costs no Redis command and survives Redis being unavailable; idle
expiry at the owner frees the load slot in its flush (never before the owner dropped the
episode); an episode Redis gives away is dropped at the next flush; after Redis loses its
data no claim is granted during the grace period while the owner re-asserts its episodes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from affinity import BackendUnavailable, Keys
from node.service import NodeService
from tests.inproc import InProcNode, claim_of, cluster, config

pytestmark = pytest.mark.anyio
KEYS = Keys()
OBS = np.zeros((1, 8), np.float32).tolist()


class Counted:
    """Counts (or fails) the request path's Redis calls (``Claims``: resolve, lookup,
    release); the lease and the flush use the registry's own calls."""

    def __init__(self, service: NodeService) -> None:
        self.calls: list[str] = []
        self.fail = False
        self._call = service.claims._call
        service.claims._call = self  # type: ignore[method-assign]

    async def __call__(self, script: Any, episode: str, args: Any = ()) -> Any:
        self.calls.append(script.name)
        if self.fail:
            raise BackendUnavailable("injected: Redis does not answer")
        return await self._call(script, episode, args)


async def flushed(node: InProcNode) -> None:
    """One flush of ``node`` now (the maintenance loop runs one each second too)."""
    await node.service.owner.flush()


async def test_a_step_at_its_owner_costs_no_redis_command(redis: Any) -> None:
    async with cluster(redis, [config("a")]) as ([a], _):
        first = (await a.act(episode_id="ep", inputs={"obs": OBS})).json()
        assert first["routing"] == "claimed"
        await flushed(a)
        counted = Counted(a.service)
        for n in range(2, 12):
            r = (await a.act(episode_id="ep", inputs={"obs": OBS})).json()
            assert (r["routing"], r["seq"], r["state_reset"]) == ("hit", n, False)
        assert counted.calls == []
        # a new episode still claims through Redis
        assert (await a.act(episode_id="other", inputs={"obs": OBS})).json()["routing"] == "claimed"
        assert counted.calls == ["resolve"]


async def test_the_owner_serves_while_redis_does_not_answer(redis: Any) -> None:
    async with cluster(redis, [config("a")]) as ([a], _):
        assert (await a.act(episode_id="ep", inputs={"obs": OBS})).status_code == 200
        await flushed(a)
        counted = Counted(a.service)
        counted.fail = True
        for n in range(2, 6):
            r = await a.act(episode_id="ep", inputs={"obs": OBS})
            assert r.status_code == 200 and r.json()["seq"] == n
        new = await a.act(episode_id="new", inputs={"obs": OBS})
        assert new.status_code == 503 and new.json()["error"]["code"] == "redis"
        assert "retry-after" in new.headers
        # a lapsed lease ends the authority: the owner asks Redis (and is refused) again
        a.service.lease.deadline = float("-inf")
        r = await a.act(episode_id="ep", inputs={"obs": OBS})
        assert r.status_code == 503 and r.json()["error"]["code"] == "fenced"


async def test_idle_expiry_at_the_owner_frees_the_slot_in_its_flush(redis: Any) -> None:
    async with cluster(redis, [config("a", devices="cpu:1", capacity=1)]) as ([a], _):
        one = (await a.act(episode_id="one", inputs={"obs": OBS})).json()
        full = await a.act(episode_id="two", inputs={"obs": OBS})
        assert full.status_code == 503 and full.json()["error"]["code"] == "full"
        record = a.service.table.get("one")
        assert record is not None
        record.last_used -= a.service.owner.flusher.idle_ttl_s + 1  # idle past the owner's timeout
        assert await redis.get(KEYS.episode("one")) is not None  # taken until the flush
        await flushed(a)
        assert a.service.table.get("one") is None
        assert await redis.get(KEYS.episode("one")) is None
        assert await redis.zrange(KEYS.load("a/0"), 0, -1) == []
        events = [f for _, f in await redis.xrange(KEYS.events) if f.get("reason") == "idle"]
        assert [(e["episode"], e["token"]) for e in events] == [("one", str(one["token"]))]
        assert (await a.act(episode_id="two", inputs={"obs": OBS})).json()["routing"] == "claimed"


async def test_a_stepping_episode_is_slid_once_its_backstop_is_near_not_each_flush(
    redis: Any,
) -> None:
    """The first flush after a claim slides it; later flushes slide it only once its
    backstop has less than a lease TTL + SLIDE_AHEAD_S left; a backstop closer than
    EXPIRY_MARGIN_S (flushes failing) sends the step to Redis, which slides it."""
    from node.flusher import EXPIRY_MARGIN_S, SLIDE_AHEAD_S

    async with cluster(redis, [config("a")]) as ([a], _):
        o = a.service.owner.flusher
        assert (await a.act(episode_id="ep", inputs={"obs": OBS})).status_code == 200
        await flushed(a)  # slides the new record
        slid = o._slid["ep"]
        key = KEYS.episode("ep")
        first = await redis.pttl(key)
        assert first > 0
        counted = Counted(a.service)
        for _ in range(3):  # stepped, flushed: nothing is due, nothing is sent
            assert (await a.act(episode_id="ep", inputs={"obs": OBS})).json()["routing"] == "hit"
            await flushed(a)
        assert o._slid["ep"] == slid and counted.calls == []
        assert await redis.pttl(key) <= first
        # its backstop nears: the next flush slides it (written again in full)
        o._slid["ep"] = slid - (o.backstop_s - o.lease_ttl_s - SLIDE_AHEAD_S)
        await a.act(episode_id="ep", inputs={"obs": OBS})
        await redis.pexpire(key, 60_000)
        await flushed(a)
        assert o._slid["ep"] > slid
        assert await redis.pttl(key) > 60_000
        # nearer than the margin (its slides failed): the step asks Redis, which slides it
        o._slid["ep"] = o.clock() - o.backstop_s + EXPIRY_MARGIN_S / 2
        await redis.pexpire(key, 60_000)
        r = (await a.act(episode_id="ep", inputs={"obs": OBS})).json()
        assert r["routing"] == "hit" and counted.calls == ["resolve"]
        assert await redis.pttl(key) > 60_000


async def test_an_episode_redis_lost_is_dropped_at_the_next_flush(redis: Any) -> None:
    """The owner drops an episode its flush finds lost, and remembers that it did: the
    episode's next claim here says ``state_reset`` even for a client that echoes nothing."""
    async with cluster(redis, [config("a")]) as ([a], _):
        r = (await a.act(episode_id="ep", inputs={"obs": OBS})).json()
        await flushed(a)
        a.service.owner.flusher._slid.clear()  # due for a slide again
        await redis.delete(KEYS.episode("ep"))
        await a.act(episode_id="ep", inputs={"obs": OBS})  # from memory, before the flush
        await flushed(a)
        assert a.service.table.get("ep") is None
        again = (await a.act(episode_id="ep", inputs={"obs": OBS})).json()
        assert again["routing"] == "claimed" and again["token"] != r["token"]
        assert again["state_reset"] is True


async def test_an_operator_release_goes_through_the_owner(redis: Any) -> None:
    """``affinity release`` writes Redis only, and must not make a second owner: while the
    owner's lease is live the assignment is marked revoked (its steps still go to the
    owner, a router's resolve still finds it there), the owner learns it from its next
    renewal, drops its record and says so at once in a second renewal, which turns the
    mark into ``moved``: the next step is reassigned with ``state_reset``. A renewal whose
    answer was lost loses nothing; a release by the owner itself, or one for an older
    token, revokes nothing."""
    async with cluster(redis, [config("a"), config("b")]) as ([a, b], _):
        r = (await a.act(episode_id="ep", inputs={"obs": OBS})).json()
        await flushed(a)
        done = await a.service.claims.release("ep", r["token"], "operator")
        assert done.revoked
        assert await redis.smembers(KEYS.revoked("a")) == {f"ep {r['token']}"}
        assert (await redis.get(KEYS.episode("ep"))).endswith(" revoked")
        hit = (await a.act(episode_id="ep", inputs={"obs": OBS})).json()
        assert hit["routing"] == "hit"  # from memory: the owner does not know yet
        via_b = (await b.act(episode_id="ep", inputs={"obs": OBS})).json()
        assert (via_b["node"], via_b["seq"]) == ("a", 3)  # no second owner meanwhile
        lease = a.service.lease
        lost = await lease.registry.renew("a", lease.instance)  # an answer that was lost
        assert lost is not None and lost.revoked == [("ep", r["token"])]
        assert a.service.table.get("ep") is not None
        await lease.renew_once()  # asked again: carried out, and said at once
        assert a.service.table.get("ep") is None
        assert await redis.exists(KEYS.revoked("a")) == 0
        assert (await redis.get(KEYS.episode("ep"))).endswith(" moved")
        again = (await b.act(episode_id="ep", inputs={"obs": OBS})).json()
        assert again["routing"] == "reassigned" and again["token"] != r["token"]
        assert again["state_reset"] is True
        # a stale revocation of the old token revokes nothing; then the owner's own end
        owner = a if again["node"] == "a" else b
        await redis.sadd(KEYS.revoked(again["node"]), f"ep {r['token']}")
        await owner.service.lease.renew_once()
        assert claim_of(owner.service, "ep") is not None
        assert await redis.exists(KEYS.revoked(again["node"])) == 0
        await owner.service.router.end_here("ep", again["token"])
        assert await redis.get(KEYS.episode("ep")) is None


async def test_another_redis_server_has_the_owner_check_every_record_in_its_next_flush(
    redis: Any,
) -> None:
    """A restart from a snapshot or a failover keeps the fleet marker (no grace period) but
    may lose the last claims: the renewal that finds another ``run_id`` has the next flush
    slide every record held here, dropping the ones Redis lost, long before their slides
    would be due."""
    async with cluster(redis, [config("a")]) as ([a], _):
        m = a.service.lease
        tokens = {}
        for episode in ("kept", "lost"):
            tokens[episode] = (await a.act(episode_id=episode, inputs={"obs": OBS})).json()["token"]
        await flushed(a)
        ids = iter(["first", "second"])

        async def server_id() -> str:
            return next(ids)

        m.registry.server_id = server_id  # type: ignore[method-assign]
        m.server_id = "first"  # the server seen so far
        await redis.delete(KEYS.episode("lost"))  # a claim the new server never had
        await m.renew_once()  # the same server: nothing to check
        await flushed(a)
        assert a.service.table.get("lost") is not None  # not due: kept (and not checked)
        await m.renew_once()  # another server answers
        await flushed(a)
        assert a.service.table.get("lost") is None
        assert a.service.table.get("kept") is not None and await redis.exists(KEYS.episode("kept"))
        again = await a.act(episode_id="lost", inputs={"obs": OBS}, token=tokens["lost"])
        assert (again.json()["routing"], again.json()["state_reset"]) == ("claimed", True)


async def test_a_record_claimed_anew_during_the_flush_is_not_dropped_as_lost(redis: Any) -> None:
    """Redis answers "lost" for the claim the flush sent; the episode was ended and
    claimed anew here while the flush was on its way: the new record is not that claim,
    and stays (nor is it counted as lost)."""
    async with cluster(redis, [config("a")]) as ([a], _):
        o = a.service.owner.flusher
        first = (await a.act(episode_id="ep", inputs={"obs": OBS})).json()
        await flushed(a)
        await redis.delete(KEYS.episode("ep"))  # Redis lost that claim
        o._slid.clear()
        real = o.registry.flush
        again: dict[str, Any] = {}

        async def flush(*args: Any) -> Any:
            done = await real(*args)
            a.service.table.release("ep", "end")  # ended here meanwhile, and claimed anew
            again.update((await a.act(episode_id="ep", inputs={"obs": OBS})).json())
            return done

        o.registry.flush = flush  # type: ignore[method-assign]
        await flushed(a)
        assert again["routing"] == "claimed" and again["token"] != first["token"]
        claim = claim_of(a.service, "ep")
        assert claim is not None and claim[1] == again["token"]
        lost = a.service.metrics.owner_dropped.labels("lost")._value.get()
        assert lost == 0


async def test_a_step_served_past_its_deadline_is_answered_503_and_undone(redis: Any) -> None:
    """A step at its owner that never suspends (a quick run on the event loop) cannot be
    cancelled by its deadline; finished past it, it is answered 503 ``deadline`` and so
    must not stay applied: the next step is the one after the last 200."""
    from dataclasses import replace

    async with cluster(redis, [config("a", devices="cpu:1")]) as ([a], _):
        for _ in range(3):  # the worker's runs give the device its quick average
            assert (await a.act(episode_id="ep", inputs={"obs": OBS})).status_code == 200
        await flushed(a)
        s = a.service
        normal = s.config
        s.config = replace(normal, act_deadline_s=1e-9)  # past before the run ends
        late = await a.act(episode_id="ep", inputs={"obs": OBS})
        assert late.status_code == 503 and late.json()["error"]["code"] == "deadline"
        s.config = normal
        r = (await a.act(episode_id="ep", inputs={"obs": OBS})).json()
        assert (r["seq"], r["state_reset"]) == (4, False)


async def test_after_redis_lost_its_data_no_claim_until_the_owner_reasserted(redis: Any) -> None:
    """Redis restarted empty while ``a`` serves ``ep`` from memory: ``b``'s claims get 503
    ``recovering`` (the grace period), ``a`` re-registers within its lease and re-asserts
    ``ep`` in the same script, and ``ep`` goes on at ``a`` through ``b`` with its state."""
    async with cluster(redis, [config("a", devices="cpu:1"), config("b", devices="cpu:1")]) as (
        [a, b],
        _,
    ):
        first = (await a.act(episode_id="ep", inputs={"obs": OBS})).json()
        assert first["device"] == "a/0"
        await redis.flushdb()  # Redis lost everything, the fleet marker too
        for episode in ("ep", "new"):
            r = await b.act(episode_id=episode, inputs={"obs": OBS})
            assert r.status_code == 503 and r.json()["error"]["code"] == "recovering"
            assert int(r.headers["retry-after"]) >= 1
        assert await redis.get(KEYS.episode("ep")) is None
        await a.service.lease.renew_once()  # finds itself gone: registers, re-asserts
        claim = claim_of(a.service, "ep")
        assert claim is not None and claim[:2] == ("a/0", first["token"])
        assert await redis.get(KEYS.episode("ep")) == " ".join(map(str, claim))
        assert await redis.zrange(KEYS.load("a/0"), 0, -1) == ["ep"]
        await b.service.lease.renew_once()
        via_b = (await b.act(episode_id="ep", inputs={"obs": OBS})).json()
        assert (via_b["node"], via_b["seq"], via_b["state_reset"]) == ("a", 2, False)
        new = await b.act(episode_id="new", inputs={"obs": OBS})
        assert new.json()["error"]["code"] == "recovering"  # the grace period still runs
        await redis.set(KEYS.fleet, "1")  # ... until it ends (a time long past)
        assert (await b.act(episode_id="new", inputs={"obs": OBS})).json()["routing"] == "claimed"


def two() -> list[Any]:
    return [config("a", devices="cpu:1"), config("b", devices="cpu:1")]


async def on(node: str, via: InProcNode, prefix: str) -> str:
    """An episode claimed on ``node`` by a first step sent through ``via``."""
    for i in range(16):
        r = (await via.act(episode_id=f"{prefix}-{i}", inputs={"obs": OBS})).json()
        if r["node"] == node:
            return f"{prefix}-{i}"
    raise AssertionError(f"nothing landed on {node}")


async def test_a_router_forwards_to_the_owner_it_found_without_asking_redis(redis: Any) -> None:
    async with cluster(redis, two()) as ([a, b], _):
        ep = await on("a", b, "hint")
        await flushed(a)
        at_a, at_b = Counted(a.service), Counted(b.service)
        for n in range(2, 8):
            r = (await b.act(episode_id=ep, inputs={"obs": OBS})).json()
            assert (r["node"], r["seq"], r["state_reset"]) == ("a", n, False)
        assert at_a.calls == at_b.calls == []


async def test_an_owner_that_does_not_hold_the_episode_says_so_and_the_router_resolves(
    redis: Any,
) -> None:
    """The router's hint names a's claim; a no longer holds it (an operator released it and
    it was claimed anew on b): a answers 409 and b resolves, then serves it itself."""
    async with cluster(redis, two()) as ([a, b], _):
        ep = await on("a", b, "gone")
        first = (await b.act(episode_id=ep, inputs={"obs": OBS})).json()
        a.service.table.release(ep, "end")
        await a.service.claims.release(ep, first["token"], "operator")
        await redis.set(KEYS.episode(ep), f"b/0 {first['token'] + 1} abc", px=60_000)
        at_b = Counted(b.service)
        r = (await b.act(episode_id=ep, inputs={"obs": OBS})).json()
        assert (r["node"], r["device"]) == ("b", "b/0") and at_b.calls == ["resolve"]


async def test_a_hint_naming_an_owner_that_cannot_be_reached_is_resolved_again(
    redis: Any,
) -> None:
    """The router's hint names a, which is gone (it handed its episodes over and exited:
    the connection is refused, so the forward never left): b asks Redis once and follows
    the assignment there, instead of answering owner_unreachable for a step that ran
    nowhere."""
    async with cluster(redis, two()) as ([a, b], router):
        ep = await on("a", b, "handed")
        first = (await b.act(episode_id=ep, inputs={"obs": OBS})).json()
        assert first["node"] == "a" and b.service.router.locator.lookup(ep) is not None
        a.service.table.release(ep, "end")
        await a.service.claims.release(ep, first["token"], "operator")
        await redis.set(KEYS.episode(ep), f"b/0 {first['token'] + 1} abc", px=60_000)
        router.down.add("a.test")
        at_b = Counted(b.service)
        r = await b.act(episode_id=ep, inputs={"obs": OBS})
        assert r.status_code == 200, r.text
        assert (r.json()["node"], at_b.calls) == ("b", ["resolve"])


async def test_a_router_asks_redis_again_once_a_step(redis: Any) -> None:
    """Redis names a, which answers each forward that it does not hold the claim (its own
    lookup disagrees): b asks Redis, then once again, and answers 503 ``owner_refused``;
    never a third time."""
    async with cluster(redis, two()) as ([a, b], _):
        ep = await on("a", b, "stale")
        a.service.table.release(ep, "end")

        async def nothing(episode: str) -> None:
            return None

        a.service.owner.claims.lookup = nothing  # type: ignore[method-assign,assignment]
        b.service.router.locator.forget(ep)
        at_b = Counted(b.service)
        r = await b.act(episode_id=ep, inputs={"obs": OBS})
        assert r.status_code == 503 and r.json()["error"]["code"] == "owner_refused", r.text
        assert at_b.calls == ["resolve", "resolve"]


def test_the_router_asks_redis_again_in_one_place() -> None:
    """One re-resolve loop (``Router._act_asking_again``), as httpx's redirect loop: the
    leaves (serve here, forward, hand over) raise, and only the loop asks again."""
    import ast
    from pathlib import Path

    source = Path(__file__).resolve().parents[1] / "node" / "router.py"
    asking: list[str] = []
    for fn in ast.walk(ast.parse(source.read_text())):
        if isinstance(fn, ast.AsyncFunctionDef | ast.FunctionDef):
            for call in ast.walk(fn):
                if (
                    isinstance(call, ast.Attribute)
                    and call.attr in ("for_step", "for_steps", "resolve")
                    and isinstance(call.value, ast.Attribute)
                    and call.value.attr == "resolver"
                ):
                    asking.append(fn.name)
    # the first ask, the restart's two (where it is, the new claim), and the loop's; a
    # message of rows asks first for its rows together (issue 44): a row found stale goes
    # through the one-row layers, so the loop stays the only place that asks again
    assert sorted(asking) == sorted(
        ["_act_handling_restart", "_act_handling_restart", "restart_here", "_act_asking_again",
         "act_rows"]
    )  # fmt: skip


async def test_an_end_sent_to_another_node_reaches_the_owner(redis: Any) -> None:
    async with cluster(redis, two()) as ([a, b], _):
        ep = await on("a", b, "end")
        await flushed(a)
        assert a.service.table.get(ep) is not None
        r = await b.client.post(f"/episodes/{ep}/end")
        assert r.status_code == 200 and r.json()["device"] == "a/0"
        assert a.service.table.get(ep) is None  # the owner serves it no more
        assert await redis.get(KEYS.episode(ep)) is None
        assert await redis.zrange(KEYS.load("a/0"), 0, -1) == []
        # an end step through b also ends it at a
        ep2 = await on("a", b, "step-end")
        done = await b.act(episode_id=ep2, inputs={"obs": OBS}, end=True)
        assert done.status_code == 200
        assert a.service.table.get(ep2) is None
        assert await redis.get(KEYS.episode(ep2)) is None


async def test_a_restart_sent_to_another_node_is_made_by_the_owner(redis: Any) -> None:
    """A restart (KServe ``sequence_start``) reaching b for a's episode: a drops its record
    and claims anew, so a never serves the old claim from memory afterwards."""
    from node.step import Step

    async with cluster(redis, two()) as ([a, b], _):
        ep = await on("a", b, "again")
        old = claim_of(a.service, ep)
        deadline = b.service.clock() + 5
        step = Step(episode=ep, inputs={"obs": np.zeros((1, 8), np.float32)}, deadline=deadline,
                    restart=True)  # fmt: skip
        reply = await b.service.router.act(step)
        assert reply.routing == "claimed" and reply.token != old[1]
        held = {n: claim_of(n_.service, ep) for n, n_ in (("a", a), ("b", b))}
        assert old not in held.values()
        assert [claim[1] for claim in held.values() if claim] == [reply.token]


async def test_a_rolled_back_claim_is_dropped_by_its_owner_at_its_next_slide(redis: Any) -> None:
    """A lossy failover that kept the fleet marker but lost ``ep``'s assignment (simulated:
    its key and load-set member deleted): no grace period starts; the owner's next slide of
    ``ep`` finds it gone and drops it (it never re-asserts outside a grace period), and the
    client that echoes its token is told ``state_reset`` (docs/guarantees.md states the
    window before that slide)."""
    async with cluster(redis, [config("a")]) as ([a], _):
        first = (await a.act(episode_id="ep", inputs={"obs": OBS})).json()
        old = claim_of(a.service, "ep")
        await redis.delete(KEYS.episode("ep"))
        await redis.zrem(KEYS.load(first["device"]), "ep")
        a.service.owner.flusher._slid.clear()  # its slide is due
        await flushed(a)  # (or the maintenance loop's flush, whichever comes first)
        assert a.service.table.get("ep") is None
        assert await redis.get(KEYS.episode("ep")) is None  # not written back
        again = (await a.act(episode_id="ep", inputs={"obs": OBS}, token=first["token"])).json()
        assert again["routing"] == "claimed" and again["state_reset"] is True
        assert claim_of(a.service, "ep") != old


async def test_a_failover_to_a_replica_without_the_fleet_is_a_grace_period(redis: Any) -> None:
    """The other lossy failover: the new master never had the fleet (no marker). As after
    a restart, no claim until the owner re-asserted; then the episode goes on."""
    async with cluster(redis, [config("a")]) as ([a], _):
        (await a.act(episode_id="ep", inputs={"obs": OBS})).json()
        for key in await redis.keys("{affinity}:*"):
            await redis.delete(key)
        r = await a.act(episode_id="new", inputs={"obs": OBS})
        assert r.status_code == 503 and r.json()["error"]["code"] == "recovering"
        served = (await a.act(episode_id="ep", inputs={"obs": OBS})).json()  # from memory
        assert (served["seq"], served["state_reset"]) == (2, False)
        await a.service.lease.renew_once()
        assert await redis.zrange(KEYS.load(served["device"]), 0, -1) == ["ep"]


def versions() -> list[Any]:
    """a serves demo@v1, b demo@v2 (one device each): a version names its node."""
    from node.catalog import ModelSpec
    from node.models import DEMO_MODEL

    return [
        config("a", devices="cpu:1", models=(ModelSpec(DEMO_MODEL, "demo", "v1"),)),
        config("b", devices="cpu:1", models=(ModelSpec(DEMO_MODEL, "demo", "v2"),)),
    ]


async def test_a_step_naming_another_version_is_refused_from_memory_and_on_a_hint(
    redis: Any,
) -> None:
    """The owner's from-memory hit checks the step's model as Redis would (409
    ``model_conflict``, no Redis command, nothing changed); a router whose hint names
    another version does not forward on it: Redis answers the conflict."""
    async with cluster(redis, versions()) as ([a, b], _):
        first = (await a.act(episode_id="ep", model="demo@v1", inputs={"obs": OBS})).json()
        assert (first["node"], first["model"]) == ("a", "demo@v1")
        value = await redis.get(KEYS.episode("ep"))
        assert value.endswith(" demo@v1")
        await flushed(a)
        at_a = Counted(a.service)
        r = await a.act(episode_id="ep", model="demo@v2", inputs={"obs": OBS})
        assert r.status_code == 409 and r.json()["error"]["code"] == "model_conflict", r.text
        assert "demo@v1" in r.json()["error"]["message"] and at_a.calls == []
        again = (await a.act(episode_id="ep", model="demo", inputs={"obs": OBS})).json()
        assert (again["seq"], again["state_reset"], again["model"]) == (2, False, "demo@v1")
        assert at_a.calls == []
        # through b: the first forward leaves a hint; a step naming v2 asks Redis instead
        via_b = (await b.act(episode_id="ep", model="demo@v1", inputs={"obs": OBS})).json()
        assert (via_b["node"], via_b["seq"]) == ("a", 3)
        assert b.service.router.locator.lookup("ep").model == "demo@v1"
        at_b = Counted(b.service)
        r = await b.act(episode_id="ep", model="demo@v2", inputs={"obs": OBS})
        assert r.status_code == 409 and r.json()["error"]["code"] == "model_conflict", r.text
        assert at_b.calls == ["resolve"] and at_a.calls == []
        assert await redis.get(KEYS.episode("ep")) == value
        after = (await b.act(episode_id="ep", model="demo@v1", inputs={"obs": OBS})).json()
        assert (after["node"], after["seq"], after["state_reset"]) == ("a", 4, False)


async def test_a_restart_forwarded_to_the_owner_takes_the_version_it_names(redis: Any) -> None:
    """A restart reaching b for a's demo@v1 episode naming demo@v2: the owner a drops its
    record and claims anew with v2, which only b serves; a holds nothing afterwards."""
    from node.step import Step

    async with cluster(redis, versions()) as ([a, b], _):
        first = (await a.act(episode_id="ep", model="demo@v1", inputs={"obs": OBS})).json()
        assert first["node"] == "a"
        step = Step(episode="ep", inputs={"obs": np.zeros((1, 8), np.float32)},
                    deadline=b.service.clock() + 5, restart=True, model="demo",
                    version="v2")  # fmt: skip
        reply = await b.service.router.act(step)
        assert (reply.routing, reply.node, reply.model) == ("claimed", "b", "demo@v2")
        assert claim_of(a.service, "ep") is None
        assert claim_of(b.service, "ep") == (
            "b/0",
            reply.token,
            (await redis.get(KEYS.episode("ep"))).split(" ")[2],
            "demo@v2",
        )
