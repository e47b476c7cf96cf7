"""Exactly-once steps through the node's front doors, in-process (fakeredis and a real
redis-server): seq on /act (JSON and msgpack), replay, 409 seq_conflict, undo of a step
whose client left or whose forward was cut off, the claim id (issue 21 item 6) and the
registration's instance (item 5)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from affinity import Keys, wire
from node.models import DEMO_MODEL
from node.step import Step
from tests.inproc import Gate, cluster, config
from tests.rollout import reference_rollout

pytestmark = pytest.mark.anyio
KEYS = Keys()


def observations(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, 8)).astype(np.float32) for _ in range(n)]


def expect(history: list[np.ndarray], reply: dict[str, Any]) -> None:
    """The reply is the model's after exactly ``history`` (the state saw those steps)."""
    want = reference_rollout(DEMO_MODEL, history)[-1]["actions"]
    np.testing.assert_allclose(np.asarray(reply["outputs"]["actions"]), want, rtol=1e-5)


async def test_seq_replays_the_last_reply_and_refuses_any_other(redis: Any) -> None:
    obs = observations(1, 3)
    async with cluster(redis, [config("a")]) as ([a], _):
        r1 = (await a.act(episode_id="ep", inputs={"obs": obs[0].tolist()}, seq=1)).json()
        r2 = (await a.act(episode_id="ep", inputs={"obs": obs[1].tolist()}, seq=2)).json()
        assert (r1["seq"], r2["seq"], r2["replayed"]) == (1, 2, False)
        again = await a.act(episode_id="ep", inputs={"obs": obs[1].tolist()}, seq=2)
        assert again.status_code == 200 and again.json()["replayed"] is True
        assert again.json()["outputs"] == r2["outputs"] and again.headers["x-affinity-seq"] == "2"
        for wrong in (1, 5):
            r = await a.act(episode_id="ep", inputs={"obs": obs[2].tolist()}, seq=wrong)
            assert r.status_code == 409 and r.json()["error"]["code"] == "seq_conflict"
            assert "has applied step 2" in r.json()["error"]["message"]
        bad = await a.act(episode_id="ep", inputs={"obs": obs[2].tolist()}, seq=0)
        assert bad.status_code == 422 and bad.json()["error"]["field"] == "seq"
        # msgpack carries seq the same way
        body = wire.encode({"episode_id": "ep", "inputs": {"obs": obs[2]}, "seq": 3})
        r3 = await a.client.post(
            "/act",
            content=body,
            headers={"content-type": "application/msgpack", "accept": "application/msgpack"},
        )
        doc = wire.decode(r3.content)
        assert r3.status_code == 200 and doc["seq"] == 3 and doc["replayed"] is False
        expect(obs, {"outputs": {"actions": doc["outputs"]["actions"]}})


async def test_a_forward_carries_seq_and_a_conflict_comes_back_as_409(redis: Any) -> None:
    obs = observations(2, 2)
    async with cluster(redis, [config("a"), config("b")]) as ([a, _b], _):
        for i in range(8):
            first = await a.act(episode_id=f"f{i}", inputs={"obs": obs[0].tolist()}, seq=1)
            if first.json()["node"] == "b":
                break
        ep = first.json()["episode_id"]
        assert first.json()["node"] == "b"
        replay = await a.act(episode_id=ep, inputs={"obs": obs[0].tolist()}, seq=1)
        assert replay.json()["replayed"] is True and replay.json()["seq"] == 1
        conflict = await a.act(episode_id=ep, inputs={"obs": obs[1].tolist()}, seq=3)
        assert conflict.status_code == 409 and conflict.json()["error"]["code"] == "seq_conflict"
        nxt = (await a.act(episode_id=ep, inputs={"obs": obs[1].tolist()}, seq=2)).json()
        assert nxt["seq"] == 2 and not nxt["state_reset"]
        expect(obs, nxt)


async def test_a_reissued_token_number_with_another_claim_id_starts_clean(redis: Any) -> None:
    """Issue 21 item 6: after a lossy failover Redis re-issues a token number the owner
    still holds state and a chunk buffer for; the claim id tells the claims apart, so the
    step starts clean, says so, and never serves the lost claim's buffered action."""
    obs = observations(3, 3)
    async with cluster(redis, [config("a", execute_steps=4)]) as ([a], _):
        r1 = (await a.act(episode_id="ep", inputs={"obs": obs[0].tolist()})).json()
        r2 = (await a.act(episode_id="ep", inputs={"obs": obs[1].tolist()})).json()
        assert r2["source"] == "buffer"
        device, token, _claim = (await redis.get(KEYS.episode("ep"))).split(" ")[:3]
        # the lost claim's successor: the same token number, a claim id the owner never saw
        await redis.set(KEYS.episode("ep"), f"{device} {token} 0123456789abcdef", px=60_000)
        o = a.service.owner.flusher  # the owner learns it at its next slide of the episode
        o._slid.clear()
        await a.service.owner.flush()
        r = (await a.act(episode_id="ep", inputs={"obs": obs[2].tolist()})).json()
        assert (r["routing"], r["token"]) == ("hit", r1["token"])
        assert r["state_reset"] is True and r["source"] == "model" and r["seq"] == 1
        want = reference_rollout(DEMO_MODEL, obs[2:])[0]["actions"][:, 0]
        np.testing.assert_allclose(r["outputs"]["actions"], want, rtol=1e-5)


async def test_a_registration_held_by_another_instance_stops_serving_at_once(
    redis: Any,
) -> None:
    """Issue 21 item 5: Redis restarted empty and a duplicate process with the same node id
    registered. A step that asks Redis (here: a new episode) finds the other instance and
    fences at once; one served from memory is this instance's until its renewal finds the
    other registration (meanwhile the grace period after the restart keeps the duplicate
    from claiming anything, tests/test_exactly_once_procs.py)."""
    obs = observations(4, 2)
    async with cluster(redis, [config("a")]) as ([a], _):
        await a.act(episode_id="ep", inputs={"obs": obs[0].tolist()})
        stopped = threading.Event()
        a.service.lease.on_conflict = stopped.set
        await redis.hset(KEYS.node("a"), "instance", "another-process")
        r = await a.act(episode_id="other", inputs={"obs": obs[1].tolist()})
        assert r.status_code == 503 and r.json()["error"]["code"] == "fenced"
        assert stopped.is_set() and a.service.table.get("ep") is None


async def test_a_client_that_leaves_while_its_step_runs_gets_it_undone(redis: Any) -> None:
    """Issue 21 item 4 (HTTP /act), at the handler: the connection closes while the step
    is on the device; nothing is sent and the next step sees the state as it was."""
    from node.protocols import act

    obs = observations(5, 3)
    Gate.go.clear()
    Gate.entered.clear()
    gated = {"session_factory": lambda spec: (Gate(spec), "CPU")}
    async with cluster(redis, [config("a", devices="cpu:1")], **gated) as ([a], _):
        await a.act(episode_id="ep", inputs={"obs": obs[0].tolist()})
        body = wire.encode({"episode_id": "ep", "inputs": {"obs": np.full((1, 8), 9, np.float32)}})
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        sent: list[Any] = []

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            assert await asyncio.to_thread(Gate.entered.wait, 30)
            return {"type": "http.disconnect"}  # the client's timeout closed the connection

        async def send(message: Any) -> None:
            sent.append(message)

        scope = {"type": "http", "headers": [(b"content-type", b"application/msgpack")]}
        await act.handle(a.service, scope, receive, send)  # type: ignore[arg-type]
        Gate.go.set()  # the run ends after its client left: its state must not be kept
        # never the step's reply; a 499 closes the exchange (issue 42 item 1: a handler
        # that returned without a response made uvicorn log an ERROR and a 500)
        assert [m.get("status") for m in sent] == [499, None], sent
        assert b"client_gone" in sent[1]["body"] and b"outputs" not in sent[1]["body"]
        r = (await a.act(episode_id="ep", inputs={"obs": obs[2].tolist()})).json()
        assert r["seq"] == 2 and not r["state_reset"]
        expect([obs[0], obs[2]], r)


async def test_a_close_seen_as_the_work_finishes_hands_back_its_result() -> None:
    from node.asgi import while_connected
    from node.errors import ClientGone

    async def gone() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def quick() -> str:
        await asyncio.sleep(0)  # the close is read meanwhile; its callback comes after
        return "reply"

    with pytest.raises(ClientGone) as info:
        await while_connected(gone, quick())
    assert info.value.result == "reply", "the caller needs the reply to undo its step"

    async def slow() -> str:
        await asyncio.sleep(30)
        return "never"

    with pytest.raises(ClientGone) as info:
        await asyncio.wait_for(while_connected(gone, slow()), 10)
    assert info.value.result is None

    async def stays() -> dict[str, Any]:
        await asyncio.sleep(30)
        return {"type": "http.disconnect"}

    assert await while_connected(stays, quick()) == "reply"


async def test_a_servers_connection_probe_decides_without_reading_the_connection() -> None:
    """With the server's probe (scope[CONNECTION], node/server.py), a finished step's close
    check asks it alone, without ``receive()``; it yields one loop turn only while the
    server serves other requests."""
    from node.asgi import while_connected
    from node.errors import ClientGone

    reads: list[str] = []

    async def receive() -> dict[str, Any]:
        reads.append("receive")
        return {"type": "http.disconnect"}

    async def quick() -> str:
        return "reply"

    class Probe:
        def __init__(self, closed: bool, others: bool) -> None:
            self.closed, self.others = closed, others

        def peer_closed(self) -> bool:
            return self.closed

        def serving_others(self) -> bool:
            return self.others

    with pytest.raises(ClientGone) as info:
        await while_connected(receive, quick(), Probe(closed=True, others=False))
    assert info.value.result == "reply"
    assert await while_connected(receive, quick(), Probe(closed=False, others=False)) == "reply"
    assert reads == [], "the probe answered: the connection was not read"

    turns: list[str] = []

    async def other() -> None:
        turns.append("other")

    for others in (False, True):
        turns.clear()
        pending = asyncio.ensure_future(other())  # ready: runs at the loop's next turn
        await while_connected(receive, quick(), Probe(closed=False, others=others))
        turns.append("replied")
        await pending
        assert turns == (["other", "replied"] if others else ["replied", "other"])


async def test_the_step_time_limit_raises_timeout_and_lets_other_cancels_through() -> None:
    from node.step import TimeLimit as _TimeLimit

    with pytest.raises(TimeoutError), _TimeLimit(0.01):
        await asyncio.sleep(30)
    with _TimeLimit(0.01):
        await asyncio.sleep(0)  # ends in time: nothing raised, the timer is gone
    await asyncio.sleep(0.05)  # a timer left behind would cancel this task here

    async def cancelled_from_outside() -> None:
        with _TimeLimit(30):
            await asyncio.sleep(30)

    task = asyncio.ensure_future(cancelled_from_outside())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    async def expired_then_cancelled() -> None:
        with _TimeLimit(0):
            try:
                await asyncio.sleep(30)
            finally:
                asyncio.current_task().cancel()  # type: ignore[union-attr]
                await asyncio.sleep(0)  # a second cancel, not the limit's: it propagates

    with pytest.raises(asyncio.CancelledError):
        await expired_then_cancelled()


async def test_kserve_takes_seq_as_a_request_parameter(redis: Any) -> None:
    from tests.test_kserve import infer, result_of

    obs = observations(6, 2)
    async with cluster(redis, [config("a")]) as ([a], _):
        r1 = await infer(a, obs[0], sequence_id=5, sequence_start=True, parameters={"seq": 1})
        assert result_of(r1).get_response()["parameters"]["seq"] == 1
        again = await infer(a, obs[0], sequence_id=5, parameters={"seq": 1})
        facts = result_of(again).get_response()["parameters"]
        assert facts["replayed"] is True and facts["seq"] == 1
        conflict = await infer(a, obs[1], sequence_id=5, parameters={"seq": 4})
        assert conflict.status_code == 409 and "seq_conflict" in conflict.json()["error"]
        bad = await infer(a, obs[1], sequence_id=5, parameters={"seq": "2"})
        assert bad.status_code == 400 and "seq" in bad.json()["error"]
        r2 = await infer(a, obs[1], sequence_id=5, parameters={"seq": 2})
        assert result_of(r2).get_response()["parameters"]["seq"] == 2
        expect(obs, {"outputs": {"actions": result_of(r2).as_numpy("actions")}})


async def test_openpi_takes_seq_out_of_the_observation(redis: Any) -> None:
    from affinity import InvalidArgument
    from node.protocols import openpi

    async with cluster(redis, [config("a")]) as ([a], _):
        frame = {"bytes": wire.encode({"obs": np.zeros(8, np.float32), "seq": 3})}
        step = openpi.decode(a.service, frame, "ep", "own", {}, 0.0)
        assert step.seq == 3 and set(step.inputs) == {"obs"}, "seq never reaches the model"
        with pytest.raises(InvalidArgument, match="seq"):
            bad = {"bytes": wire.encode({"obs": np.zeros(8, np.float32), "seq": 0})}
            openpi.decode(a.service, bad, "ep", "own", {}, 0.0)


ATTEMPTS = st.sampled_from(["delivered", "undelivered", "lost_unknown", "duplicate"])


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    plan=st.lists(
        st.lists(st.tuples(st.sampled_from([0, 1]), ATTEMPTS), min_size=1, max_size=3),
        min_size=1,
        max_size=6,
    ),
    with_seq=st.booleans(),
)
async def test_random_interleavings_through_two_nodes_match_the_reference(
    plan: list[list[tuple[int, str]]], with_seq: bool
) -> None:
    """A property test through routing, forwarding and the owner's record, two nodes on
    one Redis: each step of the client is tried until delivered, every attempt through a
    random node, and ends as delivered; undelivered (its caller left, a router gave up: the
    front door's undo, by forward when the owner is the other node); lost where nobody can
    know (applied, the reply gone: with seq only); or delivered and then retried with the
    same seq through the other node (a replay). The client's view equals the reference
    rollout of the steps it saw, with no state_reset."""
    from tests.conftest import make_client

    redis = await make_client("fake")
    obs = observations(7, len(plan))
    nodes_cfg = [config("a", devices="cpu:1"), config("b", devices="cpu:1")]
    try:
        async with cluster(redis, nodes_cfg) as (nodes, _):
            history: list[np.ndarray] = []
            seq = 0
            for x, attempts in zip(obs, plan, strict=True):
                tries = [
                    (n, o) for n, o in attempts if with_seq or o in ("delivered", "undelivered")
                ]
                for entry, outcome in [*tries, (0, "delivered")]:
                    service = nodes[entry].service
                    sent = seq + 1 if with_seq else None
                    reply = await service.router.act(
                        Step("ep", {"obs": x}, service.clock() + 10, seq=sent)
                    )
                    if outcome == "undelivered":
                        await service.router.undelivered(reply)
                        continue
                    if outcome == "lost_unknown":
                        continue
                    if outcome == "duplicate":
                        other = nodes[1 - entry].service
                        dup = await other.router.act(
                            Step("ep", {"obs": x}, other.clock() + 10, seq=reply.seq)
                        )
                        assert dup.replayed and dup.seq == reply.seq
                    history.append(x)
                    seq = reply.seq
                    assert reply.seq == len(history) and not reply.state_reset
                    expect(history, {"outputs": {"actions": reply.outputs["actions"]}})
                    break
    finally:
        await redis.aclose()


async def test_a_replay_that_reaches_nobody_undoes_nothing(redis: Any) -> None:
    """A timed-out attempt read by the owner after its retry was answered is a replay; its
    connection is closed, but the step was delivered by the retry and must stay applied."""
    obs = observations(8, 2)
    async with cluster(redis, [config("a")]) as ([a], _):
        routing = a.service.router
        first = await routing.act(Step("ep", {"obs": obs[0]}, a.service.clock() + 10, seq=1))
        late = await routing.act(Step("ep", {"obs": obs[0]}, a.service.clock() + 10, seq=1))
        assert late.replayed
        await routing.undelivered(late)
        nxt = await routing.act(Step("ep", {"obs": obs[1]}, a.service.clock() + 10, seq=2))
        assert (first.seq, nxt.seq, nxt.replayed) == (1, 2, False)
        expect(obs, {"outputs": {"actions": nxt.outputs["actions"]}})
