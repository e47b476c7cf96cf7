"""One door for every change of owner (issue 33), in-process on fakeredis and a real
redis-server: an end racing a queued step, an operator's release racing live steps, a
forward naming another process of the owner's node id, a re-issued token number, a router
serving through a Redis pause with a stale view of the fleet's models, and the lease terms
that keep a grace period as long as any lease. Each failed on the code before it."""

from __future__ import annotations

import asyncio
import itertools
import threading
from typing import Any

import numpy as np
import pytest

from affinity import Keys, Registry, Settings
from node.forward import Forward
from node.step import Step
from tests.conftest import cpu_devices
from tests.inproc import Gate, InProcNode, cluster, config

pytestmark = pytest.mark.anyio
KEYS = Keys()
OBS = np.zeros((1, 8), np.float32).tolist()
HOLD = [[9.0] * 8]  # a run of these waits at the Gate (tests/inproc.py)


def gated(spec: Any) -> tuple[Gate, str]:
    return Gate(spec), "CPU"


async def on(node: str, via: InProcNode, prefix: str) -> str:
    """An episode claimed on ``node`` by a first step sent through ``via``."""
    for i in range(16):
        r = (await via.act(episode_id=f"{prefix}-{i}", inputs={"obs": OBS})).json()
        if r["node"] == node:
            return f"{prefix}-{i}"
    raise AssertionError(f"nothing landed on {node}")


def one_owner(replies: list[dict[str, Any]]) -> None:
    """The replies of one episode, in order, as one owner at a time serves them: each
    step is one after the last on the same claim, or a new claim that says so (a claim
    never comes back once another served)."""
    seen: list[int] = []
    for before, after in itertools.pairwise(replies):
        if after["token"] == before["token"]:
            assert after["seq"] == before["seq"] + 1 and after["node"] == before["node"], (
                before,
                after,
            )
        else:
            assert after["token"] not in seen, f"an older claim served again: {after}"
            seen.append(before["token"])


async def test_an_end_racing_a_queued_step_never_recreates_the_episode(redis: Any) -> None:
    """``POST /episodes/E/end`` (through another node) while a step of E waits in its
    device's queue: that step is not served from a record re-created under the released
    claim (answered after a new claim, or not at all); a and b agree on one owner after."""
    Gate.go.clear()
    Gate.entered.clear()
    cfgs = [config("a", devices="cpu:1"), config("b", devices="cpu:1")]
    async with cluster(redis, cfgs, session_factory=gated) as ([a, b], _):
        ep = await on("a", a, "end")
        blocker = await on("a", a, "blocker")
        held = asyncio.create_task(a.act(episode_id=blocker, inputs={"obs": HOLD}))
        assert await asyncio.to_thread(Gate.entered.wait, 10)  # a/0 is busy
        queued = asyncio.create_task(a.act(episode_id=ep, inputs={"obs": OBS}))
        for _ in range(200):  # bounded: until the step waits in a/0's queue
            if a.service.table.in_flight(ep):
                break
            await asyncio.sleep(0.005)
        assert a.service.table.in_flight(ep)
        ended = await b.client.post(f"/episodes/{ep}/end")
        assert ended.status_code == 200 and ended.json()["device"] == "a/0"
        Gate.go.set()
        assert (await held).status_code == 200
        late = await queued
        assert late.status_code in (200, 503), late.text
        if late.status_code == 200:  # answered only as a new claim of the episode
            assert late.json()["routing"] == "claimed" and late.json()["seq"] == 1
        replies = [late.json()] if late.status_code == 200 else []
        for via in (b, a, b, a, b, a):
            r = await via.act(episode_id=ep, inputs={"obs": OBS})
            assert r.status_code == 200, r.text
            replies.append(r.json())
        one_owner(replies)
        record = a.service.table.get(ep) or b.service.table.get(ep)
        assert record is not None
        value = (await redis.get(KEYS.episode(ep))).split(" ")
        assert (value[0], int(value[1]), value[2]) == (record.device, record.token, record.claim)
    Gate.go.clear()


async def test_an_operator_release_racing_live_steps_never_makes_two_owners(redis: Any) -> None:
    """``affinity release E`` while E steps through both nodes: until its owner lets go
    (its next renewal) every step is the owner's, continuing; then a new claim, said with
    state_reset; the old claim never serves again."""
    async with cluster(redis, [config("a"), config("b")]) as ([a, b], _):
        ep = await on("a", b, "rel")
        first = (await a.act(episode_id=ep, inputs={"obs": OBS})).json()
        await a.service.owner.flush()
        done = await a.service.claims.release(ep, first["token"], "operator")
        assert done.revoked
        replies = [first]
        for via in (b, a, b, a):
            replies.append((await via.act(episode_id=ep, inputs={"obs": OBS})).json())
        assert {r["token"] for r in replies} == {first["token"]}  # still the owner's
        await a.service.lease.renew_once()  # the owner lets go, and says so at once
        for via in (b, a, b, a):
            replies.append((await via.act(episode_id=ep, inputs={"obs": OBS})).json())
        one_owner(replies)
        new = [r for r in replies if r["token"] != first["token"]]
        assert new and new[0]["routing"] == "reassigned" and new[0]["state_reset"] is True


async def test_a_forward_naming_another_process_never_fences_the_receiver(redis: Any) -> None:
    """A router's hint names the instance of the owner's dead predecessor (a restart under
    the same node id): the owner answers 409 and the router asks Redis; the owner keeps
    serving and never stops (before: it fenced itself and exited with code 4)."""
    async with cluster(redis, [config("a"), config("b")]) as ([a, b], _):
        ep = await on("a", b, "twin")
        hint = b.service.router.locator.lookup(ep)
        assert hint is not None
        b.service.router.locator.remember(hint._replace(instance="a-dead-predecessor"))
        stopped = threading.Event()
        a.service.lease.on_conflict = stopped.set
        r = await b.act(episode_id=ep, inputs={"obs": OBS})
        assert r.status_code == 200 and r.json()["node"] == "a", r.text
        assert r.json()["seq"] == 2 and not r.json()["state_reset"]
        assert not stopped.is_set() and a.service.lease.conflict is None
        assert a.service.lease.valid()
        # the owner's own answer to such a forward, directly: 409, nothing else
        inputs = {"obs": np.zeros((1, 8), np.float32)}
        fwd = Forward(Step(ep, inputs, 0.0), hint.token, hint.device, "hit", 1.0, claim=hint.claim,
                      instance="a-dead-predecessor", model=hint.model)  # fmt: skip
        resp = await a.client.post("/internal/act", content=fwd.encode())
        assert resp.status_code == 409 and resp.json()["error"]["code"] == "stale_instance"
        assert a.service.lease.conflict is None


async def test_a_reissued_token_number_is_a_reset_even_for_a_client_that_echoes_it(
    redis: Any,
) -> None:
    """The owner dropped E's lost claim; a lossy failover (and clock skew) re-issues E's
    token number under a new claim id, claimed here afresh: the client that echoes its
    token gets state_reset (the owner remembers dropping E; the claim ids differ)."""
    async with cluster(redis, [config("a")]) as ([a], _):
        first = (await a.act(episode_id="ep", inputs={"obs": OBS})).json()
        await a.service.owner.flush()
        await redis.delete(KEYS.episode("ep"))  # the failover lost the claim
        a.service.owner.flusher._slid.clear()
        await a.service.owner.flush()  # the owner finds it lost and drops it
        assert a.service.table.get("ep") is None
        resolve = a.service.claims.resolve

        async def reissued(episode: str, **kw: Any) -> Any:
            got = await resolve(episode, **kw)
            return got._replace(token=first["token"])  # the same number, another claim id

        a.service.claims.resolve = reissued  # type: ignore[method-assign]
        again = await a.act(episode_id="ep", inputs={"obs": OBS}, token=first["token"])
        assert again.status_code == 200
        body = again.json()
        assert (body["token"], body["routing"]) == (first["token"], "claimed")
        assert body["claim"] != first["claim"] and body["state_reset"] is True
        # an echo of the claim id tells it too, on a node that never held the episode
        a.service.table.release("ep", "end")  # (forget: as a node that never held it)
        a.service.claims.resolve = resolve  # type: ignore[method-assign]
        await redis.delete(KEYS.episode("ep"))
        body = (await a.act(episode_id="ep", inputs={"obs": OBS}, claim=first["claim"])).json()
        assert body["routing"] == "claimed" and body["state_reset"] is True


async def test_a_router_with_a_hint_serves_through_a_redis_pause(redis: Any) -> None:
    """Redis does not answer (paused) while the router's view of the fleet's models is due
    for a refresh: a step through the router with a hint is served at once, never waiting
    for that read (before: it waited for the read's deadline, 1.6 s behind a pause)."""
    async with cluster(redis, [config("a"), config("b")]) as ([_, b], _):
        ep = await on("a", b, "pause")
        await b.act(episode_id=ep, inputs={"obs": OBS})
        paused = asyncio.Event()

        async def models() -> Any:  # a read Redis never answers while paused
            await paused.wait()
            return []

        b.service.catalog.inventory.models = models  # type: ignore[method-assign, union-attr]
        b.service.catalog._read_at = float("-inf")  # due
        step = asyncio.create_task(b.act(episode_id=ep, inputs={"obs": OBS}))
        done, _ = await asyncio.wait({step}, timeout=10)
        assert step in done and not paused.is_set(), "the step waited for Redis"
        assert step.result().status_code == 200 and step.result().json()["seq"] == 3
        paused.set()


async def test_the_grace_period_outlasts_the_longest_lease_of_the_fleet(redis: Any) -> None:
    """a renews a 30 s lease, b a 3 s one. a's first lease is b's 3 s until b has heard of
    30 s at a renewal (then a holds its 30 s); once Redis loses its data, a grace period
    started by b lasts 30 s, not 3 s: b claims nothing a may still serve from memory."""
    short, long = Settings(lease_ttl_s=3), Settings(lease_ttl_s=30)
    known = {"a": 0, "b": 0}
    registry = {
        "a": Registry(redis, long, lambda: known["a"]),
        "b": Registry(redis, short, lambda: known["b"]),
    }
    await registry["b"].register("b", "http://b.test", cpu_devices(1), instance="ib")
    done = await registry["a"].register("a", "http://a.test", cpu_devices(1), instance="ia")
    assert done.terms == (3000, 30000)  # b has not heard of a's 30 s yet
    known["a"] = done.terms.longest_ms
    renewal = await registry["b"].renew("b", "ib")
    assert renewal is not None and renewal.terms == (3000, 30000)
    known["b"] = renewal.terms.longest_ms
    renewal = await registry["b"].renew("b", "ib")  # b says it knows
    assert renewal is not None
    renewal = await registry["a"].renew("a", "ia")
    assert renewal is not None and renewal.terms == (30000, 30000)  # now a holds its 30 s
    await redis.flushdb()  # Redis lost everything
    from affinity import Claims, Recovering

    with pytest.raises(Recovering) as grace:
        await Claims(redis, short, lambda: known["b"]).resolve("ep")
    assert grace.value.retry_after_s > 20  # 30 s, not b's 3 s
    grace_end = int((await redis.get(KEYS.fleet)).split(" ")[0])
    assert grace_end - await server_ms(redis) > 20_000


async def server_ms(redis: Any) -> int:
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def test_a_step_retried_after_its_caller_left_gets_the_run_under_way(redis: Any) -> None:
    """A step that names its seq and whose caller leaves mid-run (a client timeout) is
    held: the retry of the same request gets its reply, with no second run; a different
    request under that seq is 409. (Without seq the step is undone, as before.)"""
    Gate.go.clear()
    Gate.entered.clear()
    async with cluster(redis, [config("a", devices="cpu:1")], session_factory=gated) as ([a], _):
        deadline = a.service.clock() + 30
        obs = np.zeros((1, 8), np.float32)
        first = await a.service.router.act(Step("ep", {"obs": obs}, deadline, seq=1))
        slow = np.full((1, 8), 9.0, np.float32)
        lost = asyncio.create_task(a.service.router.act(Step("ep", {"obs": slow}, deadline, seq=2)))
        assert await asyncio.to_thread(Gate.entered.wait, 10)
        lost.cancel()  # the caller timed out while its step ran
        with pytest.raises(asyncio.CancelledError):
            await lost
        retry = asyncio.create_task(
            a.service.router.act(Step("ep", {"obs": slow}, deadline, seq=2))
        )
        await asyncio.sleep(0.01)
        assert not retry.done()  # it waits for the run under way
        Gate.go.set()
        got = await retry
        assert (got.seq, got.replayed, got.token) == (2, True, first.token)
        other = await a.act(episode_id="ep", inputs={"obs": OBS}, seq=2)
        assert other.status_code == 409 and other.json()["error"]["code"] == "seq_conflict"
        nxt = (await a.act(episode_id="ep", inputs={"obs": OBS}, seq=3)).json()
        assert (nxt["seq"], nxt["state_reset"]) == (3, False)
    Gate.go.clear()


async def test_a_device_back_up_never_serves_an_episode_moved_while_it_was_down(
    redis: Any,
) -> None:
    """a/0 goes down (its worker process died) and E's next step moves E to b
    (``reassigned``, ``state_reset``); a/0 comes back up (a new worker process, warmed
    up): a checks its records there against Redis before it serves them from memory again
    and drops E's, so E's steps through either node are b's, one after the other (before:
    a served its old record again, beside b)."""
    configs = [config("a", devices="cpu:1"), config("b", devices="cpu:1")]
    async with cluster(redis, configs) as ([a, b], _):
        ep = await on("a", a, "back")
        await a.service.owner.flush()  # an older record than the flush's first look
        dispatchers = list(a.service.dispatchers.values())
        for d in dispatchers:
            d.lost("a/0", "its worker process died")
        for _ in range(100):  # device_down until Redis has it down (on the loop): retried
            moved = (await a.act(episode_id=ep, inputs={"obs": OBS})).json()
            if "error" not in moved:
                break
            assert moved["error"]["code"] == "device_down", moved
            await asyncio.sleep(0.02)
        assert (moved["node"], moved["routing"], moved["state_reset"]) == ("b", "reassigned", True)
        for d in dispatchers:
            await d.restored("a/0")
        replies = [moved]
        for via in (a, b, a, b):  # at once: a's record there is not checked yet
            replies.append((await via.act(episode_id=ep, inputs={"obs": OBS})).json())
        for _ in range(200):  # once up in Redis too (the health's transition, on the loop)
            await a.service.owner.recheck()
            if not a.service.health.unchecked("a/0"):
                break
            await asyncio.sleep(0.02)
        assert not a.service.health.unchecked("a/0")
        assert a.service.table.get(ep) is None  # checked: dropped
        for via in (a, b):
            replies.append((await via.act(episode_id=ep, inputs={"obs": OBS})).json())
        one_owner(replies)
        assert {r["node"] for r in replies} == {"b"}, replies
