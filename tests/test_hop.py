"""node/hop.py alone: the front's and the core's ends of the shared-memory hop, in one
process (each end with its own mapping of the region, as two processes have): a round trip
of tensors, the slots full, a malformed slot refused, the front gone mid-step or before it
read its answer, a reply the client did not take, doorbells that name several slots or none
asked."""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import pytest

from node import hop as hop_module
from node.errors import CoreLapsed, HopError, HopFull, Undelivered
from node.front import _Drains
from node.hop import (
    ACT,
    ASKED,
    KSERVE,
    NEVER_NS,
    NOTE,
    ROWS,
    SLOT_HEAD,
    STUCK_NS,
    WS_CLOSE,
    WS_OPEN,
    WS_STEP,
    Array,
    CoreHop,
    FrontHop,
    Region,
    SharedLoopBuckets,
    lift,
    lower,
)

pytestmark = pytest.mark.anyio


@dataclass
class Core:
    """A core whose handler echoes the tensors doubled, and waits on ``gate`` when set."""

    gate: asyncio.Event | None = None
    seen: list[dict[str, Any]] = field(default_factory=list)
    undelivered: list[Any] = field(default_factory=list)
    doubted: list[Any] = field(default_factory=list)
    finished: int = 0

    async def handler(
        self, kind: int, meta: dict[str, Any], arrays: list[Array], slot: int
    ) -> tuple[dict[str, Any], list[Array]]:
        self.seen.append(meta)
        if self.gate is not None:
            await self.gate.wait()
        self.finished += 1
        return {"facts": {"n": meta.get("n")}, "keep": meta.get("n")}, [a * 2 for a in arrays]

    async def on_undelivered(self, kept: Any) -> None:
        self.undelivered.append(kept)

    async def on_doubt(self, kept: Any) -> None:
        self.doubted.append(kept)


@asynccontextmanager
async def hop(core: Core, slots: int = 4) -> AsyncIterator[tuple[FrontHop, CoreHop]]:
    region = Region.create(slots, 1 << 16)
    ask = os.eventfd(0, os.EFD_NONBLOCK)
    answer = os.eventfd(0, os.EFD_NONBLOCK)
    core_end = CoreHop(region, ask, answer, core.handler, core.on_undelivered, core.on_doubt)
    core_end.start()
    front_region = Region.open(os.dup(region.fd))
    front = FrontHop(front_region, os.dup(ask), os.dup(answer))
    try:
        yield front, core_end
    finally:
        asyncio.get_running_loop().remove_reader(front.answer)
        core_end.drop()
        os.close(front.ask)
        os.close(front.answer)


def echo(kind: int, meta: dict[str, Any], views: list[Array]) -> tuple[dict[str, Any], list[Array]]:
    return meta, [v.copy() for v in views]  # views of the slot must not outlive the call


async def test_round_trip_of_tensors_and_fields() -> None:
    core = Core()
    async with hop(core) as (front, _):
        obs = np.arange(8, dtype=np.float32).reshape(1, 8)
        image = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
        meta, out = await front.call(ACT, {"n": 1, "doc": {"seq": 3}}, [obs, image], echo)
        assert meta["facts"] == {"n": 1}
        assert core.seen[0]["doc"] == {"seq": 3}
        np.testing.assert_array_equal(out[0], obs * 2)
        assert out[1].dtype == np.uint8 and out[1].shape == (2, 3, 3)
        np.testing.assert_array_equal(out[1], image * 2)
        assert sorted(front.free) == [0, 1, 2, 3]  # every slot back


async def test_a_call_past_the_slots_waits_its_turn_then_is_refused_past_the_wait() -> None:
    """With every slot in flight, further calls wait for one, first come first served (a
    burst of new episodes is queued, as a node of one process queues it, not refused), a
    call that leaves while waiting takes no slot, and one that waited past ``slot_wait_s``
    is refused (``HopFull``: 503 busy) and changes nothing."""
    core = Core(gate=asyncio.Event())
    async with hop(core, slots=2) as (front, _):
        one = np.ones(4, dtype=np.float32)
        running = [asyncio.create_task(front.call(ACT, {"n": i}, [one], echo)) for i in (0, 1)]
        while len(core.seen) < 2:
            await asyncio.sleep(0.001)
        front.slot_wait_s = 0.0  # (a wait that has passed)
        with pytest.raises(HopFull):
            await front.call(ACT, {"n": 2}, [one], echo)
        front.slot_wait_s = 60.0
        queued = [asyncio.create_task(front.call(ACT, {"n": i}, [one], echo)) for i in (3, 4, 5)]
        await asyncio.sleep(0)
        queued[1].cancel()  # left while waiting: takes no slot
        await asyncio.sleep(0)
        assert len(front.queued) == 2 and len(core.seen) == 2
        core.gate.set()  # type: ignore[union-attr]
        assert [m["facts"]["n"] for m, _ in await asyncio.gather(*running)] == [0, 1]
        got = await asyncio.gather(*queued, return_exceptions=True)
        assert isinstance(got[1], asyncio.CancelledError)
        assert [got[0][0]["facts"]["n"], got[2][0]["facts"]["n"]] == [3, 5]  # type: ignore[index]
        assert [m["n"] for m in core.seen] == [0, 1, 3, 5]  # in order, 2 and 4 never sent
        assert sorted(front.free) == [0, 1] and not front.queued


async def in_flight(core: Core, front: FrontHop, one: Array) -> asyncio.Task[Any]:
    """A call (``n`` 0) the core has taken and holds (its ``gate``): the hop's one slot."""
    running = asyncio.create_task(front.call(ACT, {"n": 0}, [one], echo))
    while len(core.seen) < 1:
        await asyncio.sleep(0.001)
    return running


async def test_a_call_waits_for_a_slot_no_longer_than_its_own_budget() -> None:
    """A call with a budget of its own (``wait_s``: what is left of a KServe request's
    ``timeout`` or a gRPC deadline) shorter than ``slot_wait_s`` waits for a slot that long
    only; it is refused then as a step whose deadline passed while it queued (503
    ``deadline``), never sent, and leaves the queue. A budget already spent is refused at
    once, the same way; a hop refusing a call it could not queue says ``busy``."""
    core = Core(gate=asyncio.Event())
    async with hop(core, slots=1) as (front, _):
        one = np.ones(4, dtype=np.float32)
        running = await in_flight(core, front, one)
        front.slot_wait_s = 3600.0  # (a test that waited this long would time out)
        with pytest.raises(HopFull) as waited:
            await front.call(ACT, {"n": 1}, [one], echo, wait_s=0.05)
        assert waited.value.deadline_s == 3600.0 and not front.queued
        refusal = waited.value.refusal()  # in the words of one process: the node's deadline
        assert refusal.reason == "deadline" and "no answer within 3600.0s" in str(refusal)
        with pytest.raises(HopFull) as spent:
            await front.call(ACT, {"n": 2}, [one], echo, wait_s=-1.0)
        assert spent.value.deadline_s == 3600.0 and spent.value.refusal().reason == "deadline"
        with pytest.raises(HopFull) as full:
            await front.call(NOTE, {"rejected": "unauthorized"}, [], echo, wait=False)
        assert full.value.deadline_s is None and full.value.refusal().reason == "busy"
        assert front.region.refused() == 2  # the steps refused, for the core to count; no note
        later = asyncio.create_task(front.call(ACT, {"n": 3}, [one], echo, wait_s=3600.0))
        await asyncio.sleep(0)
        core.gate.set()  # type: ignore[union-attr]
        await running
        assert (await later)[0]["facts"]["n"] == 3  # a budget long enough: served in turn
        assert [m.get("n") for m in core.seen] == [0, 3]  # 1 and 2 never reached it


async def test_a_note_never_waits_a_leaver_is_never_sent_and_the_queue_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With every slot in flight: a refusal's note (``wait=False``) is dropped at once
    rather than queued ahead of steps; a call whose client left while it waited is never
    sent (``Undelivered``: nothing to undo); past ``MAX_QUEUED`` waiting calls, one more
    is refused at once."""
    core = Core(gate=asyncio.Event())
    async with hop(core, slots=1) as (front, _):
        one = np.ones(4, dtype=np.float32)
        running = await in_flight(core, front, one)
        front.slot_wait_s = 60.0
        with pytest.raises(HopFull):
            await front.call(NOTE, {"rejected": "unauthorized"}, [], echo, wait=False)
        left = False
        leaver = asyncio.create_task(front.call(ACT, {"n": 1}, [one], echo, lambda: left))
        monkeypatch.setattr(hop_module, "MAX_QUEUED", 2)
        stayer = asyncio.create_task(front.call(ACT, {"n": 2}, [one], echo))
        await asyncio.sleep(0)
        with pytest.raises(HopFull):  # a third would wait: refused at once
            await front.call(ACT, {"n": 3}, [one], echo)
        left = True
        core.gate.set()  # type: ignore[union-attr]
        await running
        with pytest.raises(Undelivered):
            await leaver
        assert (await stayer)[0]["facts"]["n"] == 2
        assert [m.get("n") for m in core.seen] == [0, 2]  # the leaver's never reached it


@pytest.mark.parametrize("first", ["urgent", "ahead"])
async def test_an_urgent_note_or_a_request_sent_again_waits_first(
    monkeypatch: pytest.MonkeyPatch, first: str
) -> None:
    """With every slot in flight and the queue full, two calls are queued ahead of the
    calls waiting and reach the core first when a slot is released. A websocket's close
    (``urgent``, the episode it ends never left held) waits however long it takes, with no
    time left to wait for anyone else. A step sent again at once (``ahead``: the core
    refused its input check as out of date, so it goes again unchecked; it had its turn)
    waits no longer than its own budget."""
    core = Core(gate=asyncio.Event())
    async with hop(core, slots=1) as (front, _):
        one = np.ones(4, dtype=np.float32)
        running = await in_flight(core, front, one)
        monkeypatch.setattr(hop_module, "MAX_QUEUED", 1)
        waiting = asyncio.create_task(front.call(ACT, {"n": 1}, [one], echo))
        await asyncio.sleep(0)
        if first == "urgent":
            front.slot_wait_s = 0.0  # (a wait that has passed, for anyone but an urgent note)
        with pytest.raises(HopFull):  # the queue is full for anyone else
            await front.call(ACT, {"n": 2}, [one], echo)
        if first == "urgent":
            call = front.call(WS_CLOSE, {"n": 3}, [], echo, urgent=True)
        else:
            with pytest.raises(HopFull):  # its budget spent waiting: refused, never queued
                await front.call(ACT, {"n": 4}, [one], echo, wait_s=0.01, ahead=True)
            assert len(front.queued) == 1
            call = front.call(ACT, {"n": 3}, [one], echo, ahead=True)
        ahead = asyncio.create_task(call)
        await asyncio.sleep(0.01)
        assert not ahead.done() and len(front.queued) == 2
        core.gate.set()  # type: ignore[union-attr]
        await running
        await ahead
        await waiting
        assert [m.get("n") for m in core.seen] == [0, 3, 1]


async def test_a_handler_that_breaks_answers_500_and_frees_the_slot() -> None:
    """A bug in the core's handler (anything but a malformed request) is answered 500
    ``internal``, logged: the front's call ends, its slot is free again."""

    async def broken(kind: int, meta: dict[str, Any], arrays: list[Array], slot: int) -> Any:
        raise RuntimeError("a bug")

    core = Core()
    core.handler = broken  # type: ignore[method-assign]
    async with hop(core, slots=1) as (front, _):
        meta, _ = await asyncio.wait_for(front.call(ACT, {}, [], echo), 30)
        assert meta["err"][:2] == [500, "internal"] and "a bug" in meta["err"][2]
        assert front.free == [0]


async def test_a_request_too_big_for_a_slot_is_refused_before_it_is_sent() -> None:
    core = Core()
    async with hop(core, slots=1) as (front, _):
        with pytest.raises(HopError):
            await front.call(ACT, {}, [np.zeros(1 << 17, dtype=np.uint8)], echo)
        assert front.free == [0] and core.seen == []


@pytest.mark.parametrize(
    "damage",
    ["not msgpack", "lengths out of bounds", "tensor outside the slot", "object dtype"],
)
async def test_a_malformed_slot_is_refused_and_the_handler_never_sees_it(damage: str) -> None:
    core = Core()
    async with hop(core, slots=1) as (front, _):
        region = front.region
        head = region.head(0)
        one = np.ones(4, dtype=np.float32)
        region.write(0, 0, ACT, {"n": 1}, [one])
        _, kind, length, total = struct.unpack_from("<IIII", region.mm, head)
        data = head + SLOT_HEAD
        if damage == "not msgpack":
            region.mm[data : data + length] = b"\xc1" * length  # 0xc1: never used by msgpack
        elif damage == "lengths out of bounds":
            total = region.slot_size + 1
        else:
            import msgpack

            bad = {"n": 1, "t": [["<f4", [4], 1 << 20, 16]]}
            if damage == "object dtype":
                bad = {"n": 1, "t": [["|O", [2], 64, 16]]}
            header = msgpack.packb(bad)
            region.mm[data : data + len(header)] = header
            length = len(header)
        struct.pack_into("<IIII", region.mm, head, ASKED, kind, length, total)
        front.free.remove(0)
        waiting = asyncio.get_running_loop().create_future()
        front.waiting[0] = waiting
        os.eventfd_write(front.ask, 1)
        await asyncio.wait_for(waiting, 5)
        _, meta, _ = region.read(0, copy=True)
        assert meta["err"][:2] == [400, "malformed"], meta
        assert core.seen == []
        front._release(0)
        meta, _ = await front.call(ACT, {"n": 2}, [one], echo)  # the hop still serves
        assert meta["facts"]["n"] == 2


async def test_a_front_gone_mid_step_leaves_the_core_serving() -> None:
    core = Core(gate=asyncio.Event())
    async with hop(core) as (front, core_end):
        task = asyncio.create_task(front.call(ACT, {"n": 1}, [np.ones(2)], echo))
        while not core.seen:
            await asyncio.sleep(0.001)
        core_end.drop()  # what the supervisor does when the front's process exits
        core.gate.set()  # type: ignore[union-attr]
        for _ in range(1000):
            if core.undelivered:
                break
            await asyncio.sleep(0.001)
        # its answer is dropped: nothing raised, nothing written; the step is undone (its
        # client's connection went with the front), as for a client that left
        assert core.finished == 1 and core.undelivered == [1]
        assert not task.done()
        assert core.undelivered == [1]  # undone as a departed client's step (held with seq)
        task.cancel()
    # a restarted front gets a fresh region
    core = Core()
    async with hop(core) as (front, _):
        meta, _ = await front.call(ACT, {"n": 5}, [np.ones(2)], echo)
        assert meta["facts"]["n"] == 5


async def test_a_front_gone_before_it_read_its_answer_has_that_step_undone() -> None:
    """A reply the front never read back (its slot still answered) was never sent: the
    front's death undoes its step. One it read back may have reached its client: it stands."""
    core = Core()
    async with hop(core) as (front, core_end):
        await front.call(ACT, {"n": 3}, [np.ones(2)], echo)  # read back
        assert list(core_end.kept.values()) == [3]
        core_end.drop()
        await asyncio.sleep(0.01)
        assert core.undelivered == []
    async with hop(core) as (front, core_end):
        asyncio.get_running_loop().remove_reader(front.answer)  # the front stops reading...
        task = asyncio.create_task(front.call(ACT, {"n": 4}, [np.ones(2)], echo))
        for _ in range(1000):
            if core_end.kept:  # ...and the core answered its step
                break
            await asyncio.sleep(0.001)
        assert list(core_end.kept.values()) == [4]
        core_end.drop()  # then it dies
        for _ in range(1000):
            if core.undelivered:
                break
            await asyncio.sleep(0.001)
        assert core.undelivered == [4]
        task.cancel()


async def test_a_front_gone_with_its_not_delivered_word_unserved_has_that_step_undone() -> None:
    """The front read a reply back, found its client gone and wrote its word that it was
    not delivered into the slot, then died before ringing (its ring waits for the end of
    the loop's turn when other calls are in flight) or before the core served it: the
    front's death undoes that step all the same, as for a reply never read back. A word
    that makes the core's undo raise still has its slot answered."""
    from node.hop import ASKED, DOUBTED, UNDELIVERED

    core = Core()
    async with hop(core) as (front, core_end):
        await front.call(ACT, {"n": 6}, [np.ones(2)], echo)  # read back
        assert list(core_end.kept.values()) == [6]
        slot = next(iter(core_end.kept))
        core_end.region.write(slot, ASKED, UNDELIVERED, {}, [])  # written, never rung
        core_end.drop()  # then it dies
        for _ in range(1000):
            if core.undelivered:
                break
            await asyncio.sleep(0.001)
        assert core.undelivered == [6]

    core = Core()  # its word that the hand-over failed midway: in doubt all the same
    async with hop(core) as (front, core_end):
        await front.call(ACT, {"n": 5}, [np.ones(2)], echo)
        slot = next(iter(core_end.kept))
        core_end.region.write(slot, ASKED, DOUBTED, {}, [])
        core_end.drop()
        for _ in range(1000):
            if core.doubted:
                break
            await asyncio.sleep(0.001)
        assert core.doubted == [5] and core.undelivered == []

    async def broken(kept: Any) -> None:
        raise RuntimeError("an undo that breaks")

    core = Core()
    core.on_undelivered = broken  # type: ignore[method-assign]
    async with hop(core, slots=1) as (front, _):
        with pytest.raises(Undelivered):
            await front.call(ACT, {"n": 7}, [np.ones(2)], echo, gone=lambda: True)
        for _ in range(1000):  # answered all the same: the slot comes back
            if 0 in front.free:
                break
            await asyncio.sleep(0.001)
        meta, _ = await front.call(ACT, {"n": 8}, [np.ones(2)], echo)
        assert meta["facts"]["n"] == 8


async def test_a_reply_the_client_did_not_take_is_undone() -> None:
    core = Core()
    async with hop(core, slots=1) as (front, _):
        with pytest.raises(Undelivered):
            await front.call(ACT, {"n": 7}, [np.ones(2)], echo, gone=lambda: True)
        while 0 not in front.free:  # the core was told, then the slot came back
            await asyncio.sleep(0.001)
        assert core.undelivered == [7]
        await front.call(ACT, {"n": 8}, [np.ones(2)], echo)
        assert core.undelivered == [7]  # a delivered reply is never undone


async def test_a_call_cancelled_mid_step_tells_the_core_once_answered() -> None:
    core = Core(gate=asyncio.Event())
    async with hop(core, slots=1) as (front, _):
        task = asyncio.create_task(front.call(ACT, {"n": 9}, [np.ones(2)], echo))
        while not core.seen:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert front.free == []  # the core still holds it
        core.gate.set()  # type: ignore[union-attr]
        while 0 not in front.free:
            await asyncio.sleep(0.001)
        assert core.undelivered == [9]


def test_loop_lag_counts_survive_a_restarted_front() -> None:
    bounds = (0.001, 0.01)
    first = Region.create(1, 4096)
    lag = SharedLoopBuckets(first.mm, bounds)
    front_side = SharedLoopBuckets(first.mm, bounds)
    for value in (0.0005, 0.005, 0.5):
        front_side.observe(value)
    assert lag.counts == [1, 1, 1] and lag.sum == pytest.approx(0.5055)
    lag.detach()
    first.close()
    second = Region.create(1, 4096)
    lag.mm = second.mm
    SharedLoopBuckets(second.mm, bounds).observe(0.0001)
    assert lag.counts == [2, 1, 1]
    second.close()


async def test_requests_of_one_turn_share_a_ring_and_are_all_answered() -> None:
    core = Core()
    async with hop(core, slots=8) as (front, _):
        one = np.ones(4, dtype=np.float32)
        replies = await asyncio.gather(*(front.call(ACT, {"n": i}, [one], echo) for i in range(8)))
        assert [m["facts"]["n"] for m, _ in replies] == list(range(8))
        assert sorted(front.free) == list(range(8))


async def test_a_stray_ring_serves_nothing_and_wedges_nothing() -> None:
    core = Core()
    async with hop(core, slots=4) as (front, _):
        os.eventfd_write(front.ask, 1 << 2)  # a slot that was not asked
        os.eventfd_write(front.ask, 1 << 40)  # a count past the slots: every slot looked at
        await asyncio.sleep(0.01)
        assert core.seen == []
        meta, _ = await front.call(ACT, {"n": 1}, [np.ones(2)], echo)
        assert meta["facts"]["n"] == 1 and len(core.seen) == 1


def test_a_region_has_at_most_as_many_slots_as_a_ring_can_name() -> None:
    with pytest.raises(ValueError):
        Region.create(64, 4096)


@pytest.mark.parametrize("sent", [True, False, None, "cancelled"])
async def test_a_reply_whose_send_failed_or_was_cancelled_is_undone(sent: object) -> None:
    """``deliver`` (a websocket's send) runs while the slot is still the front's: a send
    that fails before it wrote anything (False) tells the core the reply was not delivered;
    one cut off midway (None: the connection lost with bytes of it unsent), or cancelled,
    that its fate is unknown (undone in doubt)."""
    core = Core()

    async def deliver(result: Any, handing: Any) -> bool | None:
        if sent == "cancelled":
            raise asyncio.CancelledError()
        return sent  # type: ignore[return-value]

    async with hop(core, slots=1) as (front, _):
        call = front.call(WS_STEP, {"n": 3}, [np.ones(2)], echo, deliver=deliver)
        if sent is True:
            meta, _ = await call
            assert meta["facts"]["n"] == 3
        else:
            with pytest.raises(asyncio.CancelledError if sent == "cancelled" else Undelivered):
                await call
        while 0 not in front.free:
            await asyncio.sleep(0.001)
        assert core.undelivered == ([3] if sent is False else [])
        assert core.doubted == ([3] if sent in (None, "cancelled") else [])


def test_a_message_lifted_into_a_slot_comes_back_the_same() -> None:
    """An openpi observation as the front decoded it (nested maps, lists, camera frames,
    numpy scalars, a string array, an extension value of the message) crosses a slot with
    its arrays raw and comes back equal, dtypes and all."""
    frame = np.arange(224 * 224 * 3, dtype=np.uint8).reshape(224, 224, 3)
    message = {
        "observation/image": frame,
        "state": {"joints": np.linspace(0, 1, 7), "gripper": [np.float32(0.5)]},
        "prompt": "put the bowl on the plate",
        "names": np.array(["a", "bc"], dtype=object),
        "seq": 3,
        "count": np.int64(4),
        "empty": np.zeros((0, 2), np.float32),
        b"raw": msgpack.ExtType(5, b"xy"),
    }
    arrays: list[Array] = []
    lifted = lift(message, arrays)
    assert len(arrays) == 5  # the frame, the joints, two scalars, the empty array
    region = Region.create(1, 1 << 20)
    try:
        region.write(0, ASKED, WS_STEP, {"o": lifted}, arrays)
        _, meta, carried = region.read(0, copy=True)
        back = lower(meta["o"], carried)
    finally:
        region.close()
    assert back.keys() == message.keys()
    np.testing.assert_array_equal(back["observation/image"], frame)
    assert back["observation/image"].dtype == np.uint8
    np.testing.assert_array_equal(back["state"]["joints"], message["state"]["joints"])
    scalar = back["state"]["gripper"][0]
    assert isinstance(scalar, np.float32) and scalar == np.float32(0.5)
    assert isinstance(back["count"], np.int64) and back["count"] == 4
    assert back["names"].dtype == object and back["names"].tolist() == ["a", "bc"]
    assert back["empty"].shape == (0, 2) and back["prompt"] == message["prompt"]
    assert back["seq"] == 3 and back[b"raw"] == msgpack.ExtType(5, b"xy")
    with pytest.raises(HopError):
        lower({"x": msgpack.ExtType(1, b"\x09\x00\x00\x00")}, carried)  # names no array
    with pytest.raises(HopError):
        lower({"x": msgpack.ExtType(99, b"")}, carried)


async def test_a_front_refuses_steps_itself_only_while_its_core_is_stuck_past_its_lease() -> None:
    """``Region.lapsed``: the core's lease ran out *and* its loop has not run for
    ``STUCK_NS``. A core that runs answers every step itself (fenced, routed elsewhere, or
    renewed meanwhile); a core that never said anything yet is waited for; a node that left
    never runs out. A refused step (or openpi connection) never reaches the core, and is
    counted for it; notes and an openpi connection's close still cross."""
    core = Core()
    async with hop(core) as (front, core_end):
        now = time.monotonic_ns()
        one = [np.ones(2, np.float32)]
        assert not front.region.lapsed(now)  # nothing said yet
        core_end.region.tell(now - STUCK_NS // 2, now - 1)  # ran out, but the loop runs
        assert not front.region.lapsed(now)
        core_end.region.tell(now - 2 * STUCK_NS, now + 10**9)  # stuck, its lease current
        assert not front.region.lapsed(now)
        core_end.region.tell(now - 2 * STUCK_NS, NEVER_NS)  # left: routes its stragglers
        assert not front.region.lapsed(now)
        meta, _ = await front.call(ACT, {"n": 1}, one, echo)
        assert meta["facts"]["n"] == 1
        core_end.region.tell(now - 2 * STUCK_NS, now - 1)  # stuck past its lease
        for kind in (ACT, ROWS, KSERVE, WS_STEP, WS_OPEN):
            with pytest.raises(CoreLapsed) as refused:
                await front.call(kind, {"n": 2}, one, echo)
            assert refused.value.reason == "fenced"
        assert core_end.region.refused() == 5 and len(core.seen) == 1
        await front.call(NOTE, {"rejected": "bad_input"}, [], echo)  # not steps: they cross
        assert len(core.seen) == 2 and sorted(front.free) == [0, 1, 2, 3]
        core_end.region.tell(time.monotonic_ns(), now - 1)  # it runs again (fenced, say)
        meta, _ = await front.call(ACT, {"n": 3}, one, echo)
        assert meta["facts"]["n"] == 3 and core_end.region.refused() == 5


async def test_a_front_dead_while_handing_a_reply_over_leaves_that_step_in_doubt() -> None:
    """A front that dies while ``deliver`` runs (its write held back by a slow client: the
    slot says DELIVERING) may or may not have got the reply to its client: the core gives
    the step to ``on_doubt`` (undone, its episode's next step says ``state_reset``), never
    undone as unread nor left standing. A reply the front finished handing over stands."""
    from node.hop import DELIVERING

    core = Core()
    handing = asyncio.Event()
    release = asyncio.Event()

    async def slow(result: Any, _: Any) -> bool:
        handing.set()
        await release.wait()
        return True

    async def handed(result: Any, _: Any) -> bool:
        return True

    async with hop(core, slots=2) as (front, core_end):
        await front.call(WS_STEP, {"n": 1}, [np.ones(2)], echo, deliver=handed)
        call = asyncio.create_task(front.call(WS_STEP, {"n": 2}, [np.ones(2)], echo, deliver=slow))
        await handing.wait()
        assert sorted(core_end.region.state(s) for s in range(2)) == [0, DELIVERING]
        core_end.drop()  # the front dies mid-write
        for _ in range(1000):
            if core.doubted:
                break
            await asyncio.sleep(0.001)
        assert core.doubted == [2] and core.undelivered == []  # step 1 was handed over
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call


class _Transport:
    """A transport's write side as ``_Drains.drained`` reads it."""

    def __init__(self, buffered: int = 0, closing: bool = False, late: bool = False) -> None:
        self.buffered, self.closing, self.late = buffered, closing, late
        self.limits, self.aborted = (16384, 65536), False

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self.limits

    def set_write_buffer_limits(self, high: int, low: int | None = None) -> None:
        self.limits = (high // 4 if low is None else low, high)

    def abort(self) -> None:
        self.aborted = True


class Conn(_Drains):
    """A front's connection as ``_Drains.drained`` sees it, its transport always paused
    (a client that reads nothing) until ``writable`` is set."""

    def __init__(self, transport: _Transport) -> None:
        self.transport = transport
        self.writable = asyncio.Event()

    def _transport(self) -> Any:
        return self.transport

    async def _writable(self) -> None:
        await self.writable.wait()

    def _paused(self) -> bool:
        return True


async def test_a_reply_counts_as_sent_only_once_its_front_buffer_emptied() -> None:
    """``_Drains.drained`` (a front's protocols): True once the front's buffer is empty, or
    after a close without an error (ours after ``Connection: close``: it empties first);
    None (in doubt) for a reset with bytes unsent or a write to a closing transport. A
    buffer the kernel could not take at once has the write limit set to 0 until it empties,
    then set back for the connection's later writes."""

    class Flowing(_Drains):  # paused only while its write limit is 0 and bytes are left
        def __init__(self, transport: _Transport) -> None:
            self.transport = transport
            self.writable = asyncio.Event()
            self.writable.set()

        def _transport(self) -> Any:
            return self.transport

        async def _writable(self) -> None:
            await self.writable.wait()

        def _paused(self) -> bool:
            return self.transport.limits[1] == 0 and self.transport.buffered > 0

    assert await Flowing(_Transport()).drained() is True
    assert await Flowing(_Transport(late=True)).drained() is None
    reset = Flowing(_Transport(buffered=10))
    reset._lose(ConnectionResetError())
    assert await reset.drained() is None
    closed = Flowing(_Transport(buffered=10, closing=True))  # flushed, then closed by us
    waiting = asyncio.create_task(closed.drained())
    await asyncio.sleep(0)
    closed.transport.buffered = 0
    closed._lose(None)
    assert await waiting is True
    slow = Flowing(_Transport(buffered=1 << 20))  # the kernel's buffer full
    slow.writable.clear()
    waiting = asyncio.create_task(slow.drained())
    for _ in range(3):
        await asyncio.sleep(0)
    assert not waiting.done() and slow.transport.limits == (0, 0)
    slow.transport.buffered = 0
    slow.writable.set()
    assert await waiting is True and slow.transport.limits == (16384, 65536)
    gone = Flowing(_Transport(buffered=1 << 20))
    gone.writable.clear()
    waiting = asyncio.create_task(gone.drained())
    for _ in range(3):
        await asyncio.sleep(0)
    gone._lose(ConnectionResetError())
    gone.writable.set()
    assert await waiting is None


@pytest.mark.parametrize("sent", [True, False, None])
async def test_a_held_call_keeps_its_slot_until_its_caller_settles_it(sent: bool | None) -> None:
    """``hold`` (gRPC hands the reply over after the handler returned): the call returns
    the reply and its settle; the slot stays DELIVERING (a front dying now leaves the step
    in doubt) until settled (or, past ``PARK_HELD_S``, moved to a ticket): True frees it,
    False undoes the step, None leaves it in doubt; a second settle changes nothing."""
    from node.hop import DELIVERING

    core = Core()
    async with hop(core, slots=1) as (front, core_end):
        (meta, _), settle = await front.call(ACT, {"n": 4}, [np.ones(2)], echo, hold=True)
        assert meta["facts"]["n"] == 4 and core_end.region.state(0) == DELIVERING
        assert front.free == []
        settle(sent)
        settle(not sent)
        while 0 not in front.free:
            await asyncio.sleep(0.001)
        assert core.undelivered == ([4] if sent is False else [])
        assert core.doubted == ([4] if sent is None else [])


async def test_a_client_reading_nothing_is_dropped_only_while_others_wait_for_a_slot() -> None:
    """A reply the kernel could not take, with no ticket left to move to, holds its hop slot
    while it drains. While no call waits for a slot it may (up to ``DRAIN_S``); once calls
    wait (``starved``), a
    connection still full ``SHED_S`` later is dropped, its step in doubt, so that clients
    that read nothing cannot starve a front of its slots."""
    from node.front import SHED_S

    class NoTicket:  # every ticket taken: the hand-over keeps its slot
        ticket = None

        def park(self, nbytes: int = 0) -> bool:
            return False

        def starved(self) -> bool:
            return others_wait

    others_wait = False
    slow = Conn(_Transport(buffered=1 << 20))
    waiting = asyncio.create_task(slow.drained(NoTicket()))  # type: ignore[arg-type]
    await asyncio.sleep(3 * SHED_S)  # no one waits: it may go on draining
    assert not waiting.done() and not slow.transport.aborted
    others_wait = True
    # (well before DRAIN_S, 60 s: the bound below is only the test's own)
    assert await asyncio.wait_for(waiting, 30) is None and slow.transport.aborted
    calm = Conn(_Transport(buffered=1 << 20))
    waiting = asyncio.create_task(calm.drained(None))
    await asyncio.sleep(SHED_S)
    calm.transport.buffered = 0
    calm.writable.set()
    assert await asyncio.wait_for(waiting, 60) is True and not calm.transport.aborted


async def _until(check: Callable[[], bool], what: str) -> None:
    """Wait for ``check`` on this loop: bounded in turns, never in wall-clock time."""
    for _ in range(20000):
        if check():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"never: {what}")


@pytest.mark.parametrize("sent", [True, False, None, "cancelled"])
async def test_a_slow_hand_over_moves_to_a_ticket_and_frees_its_slot(sent: object) -> None:
    """A reply the kernel did not take at once is parked (``Handing.park``): the core keeps
    its step under a ticket and the slot is freed, so the front's only slot serves another
    call while that client reads. Its hand-over then settles through the ticket: handed
    over, it stands (and the core lets go of it); failed, the core undoes it (in doubt
    when its fate is unknown)."""
    from node.hop import DELIVERING, FREE, TICKETS

    core = Core()
    release = asyncio.Event()
    parked = asyncio.Event()

    async def slow(result: Any, handing: Any) -> bool | None:
        assert handing.park() and handing.park()  # once: a second park changes nothing
        parked.set()
        await release.wait()
        if sent == "cancelled":
            raise asyncio.CancelledError()
        return sent  # type: ignore[return-value]

    async with hop(core, slots=1) as (front, core_end):
        first = asyncio.create_task(front.call(WS_STEP, {"n": 1}, [np.ones(2)], echo, deliver=slow))
        await parked.wait()
        await _until(lambda: 0 in front.free, "the parked reply's slot freed")
        (meta, _) = await front.call(ACT, {"n": 2}, [np.ones(2)], echo)  # the slot serves
        assert meta["facts"]["n"] == 2
        ticket = 0  # the first ticket taken, on its first use
        assert core_end.parked == {ticket: (1, 1)}
        assert core_end.region.ticket(ticket) == (DELIVERING, 1)
        release.set()
        if sent is True:
            assert (await first)[0]["facts"]["n"] == 1
        else:
            with pytest.raises(asyncio.CancelledError if sent == "cancelled" else Undelivered):
                await first
        await _until(lambda: len(front.tickets) == TICKETS, "the ticket free again")
        assert core_end.region.ticket(ticket) == (FREE, 1)
        assert core.undelivered == ([1] if sent is False else [])
        assert core.doubted == ([1] if sent in (None, "cancelled") else [])
        if sent is True:  # kept until the core's next look at the tickets (every 50 ms)
            assert core_end.parked == {ticket: (1, 1)}
            core_end.forget_handed()
        assert core_end.parked == {}


@pytest.mark.parametrize("sent", [True, False, None])
async def test_a_hand_over_that_ends_before_the_core_took_its_park_settles_on_that_slot(
    sent: bool | None,
) -> None:
    """A parked hand-over that ends before the core answered its park: handed over, the
    ticket is free once the park is answered; failed, the park's own slot carries the
    SETTLE at once, so no other request can reach the core between them."""
    from node.hop import TICKETS

    core = Core()

    async def quick(result: Any, handing: Any) -> bool | None:
        assert handing.park()
        return sent  # in the same turn: the core has not seen the park

    async with hop(core, slots=1) as (front, core_end):
        call = front.call(WS_STEP, {"n": 3}, [np.ones(2)], echo, deliver=quick)
        if sent:
            await call
        else:
            with pytest.raises(Undelivered):
                await call
        await _until(lambda: 0 in front.free and len(front.tickets) == TICKETS, "all freed")
        assert core.doubted == ([3] if sent is None else [])
        assert core.undelivered == ([3] if sent is False else [])
        core_end.forget_handed()
        assert core_end.parked == {}


async def test_a_failed_hand_overs_settle_goes_ahead_of_every_call_waiting_for_a_slot() -> None:
    """The SETTLE of a parked hand-over that failed takes the next free slot before the
    calls queued for one: the core undoes the step before it serves any of them (a retry
    of that step among them would otherwise run on the step that should be undone)."""
    order: list[str] = []

    class Ordered(Core):
        async def handler(
            self, kind: int, meta: dict[str, Any], arrays: list[Array], slot: int
        ) -> tuple[dict[str, Any], list[Array]]:
            order.append(f"step {meta.get('n')}")
            return await super().handler(kind, meta, arrays, slot)

        async def on_doubt(self, kept: Any) -> None:
            order.append(f"undo {kept}")
            await super().on_doubt(kept)

    core = Ordered()
    fail = asyncio.Event()

    async def slow(result: Any, handing: Any) -> bool | None:
        handing.park()
        await fail.wait()
        return None

    async with hop(core, slots=1) as (front, _):
        first = asyncio.create_task(front.call(ACT, {"n": 1}, [np.ones(2)], echo, deliver=slow))
        await _until(lambda: order == ["step 1"] and 0 in front.free, "the first parked")
        core.gate = asyncio.Event()
        second = asyncio.create_task(front.call(ACT, {"n": 2}, [np.ones(2)], echo))
        await _until(lambda: order == ["step 1", "step 2"], "the second step in the core")
        third = asyncio.create_task(front.call(ACT, {"n": 3}, [np.ones(2)], echo))
        await _until(front.starved, "the third call waiting for the slot")
        fail.set()
        with pytest.raises(Undelivered):
            await first
        core.gate.set()
        await second
        await third
        assert order == ["step 1", "step 2", "undo 1", "step 3"]


class Ordered(Core):
    """A core that writes down, in one list, each step it serves and each undo."""

    def __init__(self, hold: int | None = None) -> None:
        super().__init__()
        self.order: list[str] = []
        self.hold = hold  # the step whose handler waits on ``release``
        self.release = asyncio.Event()

    async def handler(
        self, kind: int, meta: dict[str, Any], arrays: list[Array], slot: int
    ) -> tuple[dict[str, Any], list[Array]]:
        self.order.append(f"step {meta.get('n')}")
        if meta.get("n") == self.hold:
            await self.release.wait()
        return await super().handler(kind, meta, arrays, slot)

    async def on_undelivered(self, kept: Any) -> None:
        self.order.append(f"undo {kept}")
        await super().on_undelivered(kept)

    async def on_doubt(self, kept: Any) -> None:
        self.order.append(f"doubt {kept}")
        await super().on_doubt(kept)


async def test_a_note_goes_ahead_of_a_step_rung_with_it_whatever_their_slots() -> None:
    """A reply that did not reach its client, its note in a slot above a step that came
    after it (the client's retry) and read with it in one doorbell: the core undoes the
    first step before it serves the retry (a slot's number says nothing of their order)."""
    core = Ordered(hold=9)
    async with hop(core, slots=4) as (front, core_end):
        loop = asyncio.get_running_loop()

        async def lost(result: Any, handing: Any) -> bool:
            loop.remove_reader(core_end.ask)  # the core reads nothing more, for now
            return False  # nothing of the reply reached the client

        other = asyncio.create_task(front.call(ACT, {"n": 9}, [np.ones(2)], echo))  # slot 0
        await _until(lambda: core.order == ["step 9"], "slot 0 held in the core")
        with pytest.raises(Undelivered):  # slot 1
            await front.call(ACT, {"n": 1}, [np.ones(2)], echo, deliver=lost)
        assert front.region.kind(1) == hop_module.UNDELIVERED  # its note, unread
        core.release.set()
        await other  # slot 0 free again
        retry = asyncio.create_task(front.call(ACT, {"n": 2}, [np.ones(2)], echo))
        await _until(lambda: front.region.state(0) == ASKED, "the retry in slot 0")
        loop.add_reader(core_end.ask, core_end._rung)  # both read in one doorbell
        await retry
        assert core.order == ["step 9", "step 1", "undo 1", "step 2"]


@pytest.mark.parametrize("park_served", [True, False])
async def test_a_failed_park_is_undone_before_a_later_step_though_its_settle_waits(
    park_served: bool,
) -> None:
    """A parked hand-over fails while its park is unanswered (the front sends its SETTLE
    only once the core answered the park), and the client's retry takes another slot: the
    core, which reads the ticket's word, undoes the step before it serves the retry, whether
    it had taken the park already or reads it with the retry; the SETTLE then finds nothing
    left to undo (undone once)."""
    core = Ordered()
    fail = asyncio.Event()

    async with hop(core, slots=2) as (front, core_end):
        loop = asyncio.get_running_loop()

        async def slow(result: Any, handing: Any) -> bool | None:
            loop.remove_reader(front.answer)  # the front will not see the park's answer
            if not park_served:
                loop.remove_reader(core_end.ask)  # nor the core the park, for now
            assert handing.park()
            await fail.wait()
            return None  # the connection lost midway: in doubt

        first = asyncio.create_task(front.call(ACT, {"n": 1}, [np.ones(2)], echo, deliver=slow))
        if park_served:
            await _until(lambda: len(core_end.parked) == 1, "the park taken by the core")
        else:
            await _until(lambda: front.region.state(0) == ASKED, "the park written")
        fail.set()
        await _until(lambda: first.done(), "the hand-over failed")
        assert core.order == ["step 1"]  # its SETTLE waits for the park's answer
        retry = asyncio.create_task(front.call(ACT, {"n": 2}, [np.ones(2)], echo))
        await _until(lambda: front.region.state(1) != hop_module.FREE, "the retry sent")
        if not park_served:
            loop.add_reader(core_end.ask, core_end._rung)
        await _until(lambda: "step 2" in core.order, "the retry served")
        loop.add_reader(front.answer, front._rung)
        await retry
        with pytest.raises(Undelivered):
            await first
        await _until(lambda: 0 in front.free and 1 in front.free, "every slot back")
        assert core.order == ["step 1", "doubt 1", "step 2"]
        assert core.doubted == [1] and core_end.parked == {}


@pytest.mark.parametrize(
    "when", ["delivering", "handed", "failed", "undelivered", "reused", "park_unserved"]
)
async def test_a_front_dead_with_parked_hand_overs_leaves_each_by_its_tickets_state(
    when: str,
) -> None:
    """The core reads a dead front's tickets: a hand-over still going (or failed, its note
    unserved) is undone in doubt; one the front said never reached the client, plainly;
    one handed to the kernel stands. What the core kept under an earlier use of a ticket
    stands whatever the ticket's later use says (the front begins a use only once the one
    before was settled), and a park the core had not served is judged by its ticket."""
    from node.hop import DELIVERING, DOUBTED, FREE, PARK, UNDELIVERED

    core = Core()
    async with hop(core, slots=2) as (front, core_end):
        ticket = 7
        expected: tuple[list[Any], list[Any]]  # (doubted, undone)
        if when == "park_unserved":  # the front wrote its park and died before it was served
            core_end.parked[ticket] = (1, "earlier")  # handed over, not yet forgotten
            await front.call(ACT, {"n": 5}, [np.ones(2)], echo)
            slot = next(s for s in range(2) if s in core_end.kept)
            core_end.region.set_ticket(ticket, DELIVERING, 2)
            core_end.region.write(slot, ASKED, PARK, {"k": ticket, "u": 2}, [])
            expected = ([5], [])
        elif when == "reused":  # died between the ticket's next use and its park's write
            core_end.parked[ticket] = (1, "earlier")
            core_end.region.set_ticket(ticket, DELIVERING, 2)
            expected = ([], [])
        else:
            core_end.parked[ticket] = (1, 9)
            state = {"delivering": DELIVERING, "handed": FREE, "failed": DOUBTED,
                     "undelivered": UNDELIVERED}[when]  # fmt: skip
            core_end.region.set_ticket(ticket, state, 1)
            expected = {"handed": ([], []), "undelivered": ([], [9])}.get(when, ([9], []))
        core_end.drop()
        await _until(lambda: not core_end.running, "the undo done")
        assert (core.doubted, core.undelivered) == expected


async def test_a_held_call_moves_to_a_ticket_when_its_caller_is_slow_to_settle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gRPC settles a held call once it sent the reply: one not settled within
    ``PARK_HELD_S`` moves to a ticket, freeing the slot; its settle then goes there."""
    monkeypatch.setattr(hop_module, "PARK_HELD_S", 0.0)
    core = Core()
    async with hop(core, slots=1) as (front, core_end):
        _, settle = await front.call(ACT, {"n": 6}, [np.ones(2)], echo, hold=True)
        await _until(lambda: 0 in front.free, "the held call's slot freed")
        assert list(core_end.parked.values()) == [(1, 6)]
        settle(None)
        settle(True)  # only the first counts
        await _until(lambda: core.doubted == [6], "the step undone in doubt")
        assert core_end.parked == {}


async def test_with_no_ticket_left_a_slow_hand_over_keeps_its_slot() -> None:
    """Every ticket taken: ``park`` says so and the reply keeps its slot, which
    ``starved`` then reports as waited for (the shedding rule of ``_Drains.drained``)."""
    core = Core()
    gate = asyncio.Event()
    said: list[bool] = []

    async def slow(result: Any, handing: Any) -> bool:
        said.append(handing.park())
        await gate.wait()
        said.append(handing.starved())
        return True

    async with hop(core, slots=1) as (front, _):
        front.tickets.clear()
        first = asyncio.create_task(front.call(ACT, {"n": 1}, [np.ones(2)], echo, deliver=slow))
        await _until(lambda: bool(said), "the park tried")
        second = asyncio.create_task(front.call(ACT, {"n": 2}, [np.ones(2)], echo))
        await _until(front.starved, "a call waiting for the slot")
        gate.set()
        await first
        assert (await second)[0]["facts"]["n"] == 2
        assert said == [False, True] and core.undelivered == core.doubted == []


async def test_a_reply_still_in_the_front_a_moment_on_moves_to_a_ticket_not_before() -> None:
    """``_Drains.drained`` parks a reply only once it stayed in the front's buffer for
    ``PARK_AFTER_S`` (a big reply to a client that reads drains within it, and costs no
    park), and then at once: a slow reader holds its slot no longer."""
    from node.front import PARK_AFTER_S

    class Counting:
        def __init__(self) -> None:
            self.ticket: int | None = None
            self.parks = 0

        def park(self, nbytes: int = 0) -> bool:
            self.parks += 1
            self.ticket = 0
            return True

        def starved(self) -> bool:
            return False

    quick, handing = Conn(_Transport(buffered=1 << 20)), Counting()
    waiting = asyncio.create_task(quick.drained(handing))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    quick.transport.buffered = 0  # the client read it at once
    quick.writable.set()
    assert await waiting is True and handing.parks == 0
    slow, handing = Conn(_Transport(buffered=1 << 20)), Counting()
    waiting = asyncio.create_task(slow.drained(handing))  # type: ignore[arg-type]
    await _until(lambda: handing.parks == 1, "parked")
    await asyncio.sleep(2 * PARK_AFTER_S)
    assert handing.parks == 1 and not waiting.done()  # parked once, still draining
    slow.transport.buffered = 0
    slow.writable.set()
    assert await waiting is True


async def test_a_held_reply_counts_its_bytes_against_the_fronts_budget_while_parked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A held call (gRPC) says how big its reply is (``size``): parked, it counts against
    ``PARKED_BYTES`` as a written reply does, so a gRPC client that reads nothing cannot pin
    a front's memory past the budget either; one that would pass it keeps its slot and
    tries again once the bytes came back."""
    monkeypatch.setattr(hop_module, "PARK_HELD_S", 0.0)
    monkeypatch.setattr(hop_module, "PARKED_BYTES", 100)
    core = Core()
    async with hop(core, slots=2) as (front, core_end):
        _, first = await front.call(ACT, {"n": 1}, [np.ones(2)], echo, hold=True,
                                    size=lambda _: 80)  # fmt: skip
        await _until(lambda: front.parked_bytes == 80 and 0 in front.free, "the first parked")
        _, second = await front.call(ACT, {"n": 2}, [np.ones(2)], echo, hold=True,
                                     size=lambda _: 30)  # fmt: skip
        for _ in range(20):  # (several tries, each over the budget)
            await asyncio.sleep(0)
        assert front.parked_bytes == 80 and len(core_end.parked) == 1
        assert 0 not in front.free  # the second kept its slot (it took the one freed)
        first(True)
        await _until(lambda: front.parked_bytes == 30, "the second parked once bytes came back")
        second(True)
        await _until(lambda: front.parked_bytes == 0, "both handed over")
        assert core.undelivered == core.doubted == []


async def test_a_held_call_tries_again_for_a_ticket_while_every_one_is_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A held call whose first try found no ticket free tries again every
    ``PARK_HELD_S``: it leaves its slot once one comes free."""
    monkeypatch.setattr(hop_module, "PARK_HELD_S", 0.0)
    core = Core()
    async with hop(core, slots=1) as (front, core_end):
        kept = list(front.tickets)
        front.tickets.clear()
        _, settle = await front.call(ACT, {"n": 8}, [np.ones(2)], echo, hold=True)
        for _ in range(20):  # (several tries, each finding none)
            await asyncio.sleep(0)
        assert front.free == [] and core_end.parked == {}
        front.tickets.extend(kept)
        await _until(lambda: 0 in front.free, "the held call's slot freed")
        assert list(core_end.parked.values()) == [(1, 8)]
        settle(True)


async def test_the_core_holds_a_parked_step_lightened() -> None:
    """While a reply is parked with a slow client the core holds only what the step's
    undo needs (``CoreHop.lighten``: for a node, the reply without its outputs), and
    that is what an undo gets."""
    from node.fronts import lighten
    from node.step import Reply

    core = Core()
    release = asyncio.Event()

    async def slow(result: Any, handing: Any) -> bool | None:
        handing.park()
        await release.wait()
        return None

    async with hop(core, slots=1) as (front, core_end):
        core_end.lighten = lambda keep: ("light", keep)
        first = asyncio.create_task(front.call(ACT, {"n": 4}, [np.ones(2)], echo, deliver=slow))
        await _until(lambda: bool(core_end.parked), "parked")
        assert list(core_end.parked.values()) == [(1, ("light", 4))]
        release.set()
        with pytest.raises(Undelivered):
            await first
        await _until(lambda: bool(core.doubted), "undone")
        assert core.doubted == [("light", 4)]
    reply = Reply({"actions": np.ones((1, 4096))}, "ep", "n/0", "n", 1, "hit", False, False)
    light = lighten([reply])[0]
    assert light.outputs == {} and (light.episode, light.seq) == (reply.episode, reply.seq)
    assert reply.outputs and lighten("other") == "other"


async def test_parked_replies_hold_no_more_of_a_fronts_memory_than_its_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reply parks only while the replies parked before it left less than
    ``PARKED_BYTES`` in the front: past that it keeps its slot (and is shed under
    pressure), so clients that read nothing cannot pin a front's memory without bound.
    A hand-over that ends gives its bytes back."""
    monkeypatch.setattr(hop_module, "PARKED_BYTES", 100)
    core = Core()
    first_done, second_tried = asyncio.Event(), asyncio.Event()
    said: list[bool] = []

    async def big(result: Any, handing: Any) -> bool:
        said.append(handing.park(80))
        await first_done.wait()
        return True

    async def more(result: Any, handing: Any) -> bool:
        said.append(handing.park(30))  # 110 > 100: not now
        second_tried.set()
        await _until(lambda: len(said) == 2 and first.done(), "the first handed over")
        said.append(handing.park(30))
        return True

    async with hop(core, slots=2) as (front, _):
        first = asyncio.create_task(front.call(ACT, {"n": 1}, [np.ones(2)], echo, deliver=big))
        await _until(lambda: said == [True], "the first parked")
        second = asyncio.create_task(front.call(ACT, {"n": 2}, [np.ones(2)], echo, deliver=more))
        await second_tried.wait()
        assert said == [True, False] and front.parked_bytes == 80
        first_done.set()
        await first
        await second
        assert said == [True, False, True] and front.parked_bytes == 0
        assert core.undelivered == core.doubted == []
