"""The owner's per-episode step record (node/episodes.py) through the dispatcher: step
numbers, replay of the last reply, seq conflicts, undo of a step whose reply was lost, and
a property test of random interleavings against a reference model of the episode."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node.dispatcher import BatchSettings, ChunkSettings, CrashSettings
from node.episodes import Apply, Episode, admit, undone
from node.errors import ClaimEnded, ForwardCancelled, NotKept, SeqConflict
from tests.dispatch import dispatch
from tests.test_dispatcher import CHUNKED, ChunkSession, H, make, obs, recorded_chunk, started

pytestmark = pytest.mark.anyio


def act(result: Any) -> float:
    return float(result.outputs["act"].item())


async def test_steps_are_numbered_and_a_retry_of_the_last_gets_its_reply_again() -> None:
    d, sessions, _ = make(1)
    r1 = await dispatch(d, "n/0", "ep", 7, True, obs(1), seq=1)
    r2 = await dispatch(d, "n/0", "ep", 7, False, obs(2), seq=2)
    assert (r1.seq, r2.seq, act(r2)) == (1, 2, 3.0)
    runs = sessions["n/0"].calls
    again = await dispatch(d, "n/0", "ep", 7, False, obs(2), seq=2)
    assert again.replayed and (again.seq, act(again)) == (2, 3.0)
    assert sessions["n/0"].calls == runs, "a replay runs no model"
    r3 = await dispatch(d, "n/0", "ep", 7, False, obs(4), seq=3)
    assert (r3.seq, act(r3), r3.replayed) == (3, 7.0, False), "the replay changed nothing"


async def test_a_step_replayed_to_a_retry_is_never_undone_by_its_first_attempt() -> None:
    """The first attempt's client left (its undo comes late, e.g. it ran after its
    connection closed and was checked only then); a retry with the same seq got the reply
    replayed meanwhile: that retry delivered the step, so the first attempt's undo is
    refused and the episode goes on from step 2."""
    d, _, _ = make(1)
    await dispatch(d, "n/0", "ep", 7, True, obs(1), seq=1)
    first = await dispatch(d, "n/0", "ep", 7, False, obs(2), seq=2)
    again = await dispatch(d, "n/0", "ep", 7, False, obs(2), seq=2)
    assert again.replayed
    assert not d.undo("ep", first.seq)
    r3 = await dispatch(d, "n/0", "ep", 7, False, obs(4), seq=3)
    assert (r3.seq, act(r3)) == (3, 7.0)


async def test_a_seq_that_is_neither_next_nor_last_is_a_conflict_and_changes_nothing() -> None:
    d, _, _ = make(1)
    await dispatch(d, "n/0", "ep", 7, True, obs(1), seq=1)
    await dispatch(d, "n/0", "ep", 7, False, obs(2), seq=2)
    for wrong in (1, 4, 9):
        with pytest.raises(SeqConflict) as info:
            await dispatch(d, "n/0", "ep", 7, False, obs(100), seq=wrong)
        assert info.value.current == 2 and "has applied step 2" in str(info.value)
    r3 = await dispatch(d, "n/0", "ep", 7, False, obs(4), seq=3)
    assert (r3.seq, act(r3)) == (3, 7.0)


async def test_a_step_whose_reply_was_lost_is_undone_with_its_buffer() -> None:
    d, _, _ = make(1)
    await dispatch(d, "n/0", "ep", 7, True, obs(1))
    lost = await dispatch(d, "n/0", "ep", 7, False, obs(2))
    assert d.undo("ep", lost.seq)
    assert not d.undo("ep", lost.seq), "an undo happens once"
    retry = await dispatch(d, "n/0", "ep", 7, False, obs(2))
    assert (retry.seq, act(retry), retry.state_reset) == (2, 3.0, False)


async def test_a_step_whose_reply_may_have_been_delivered_makes_the_next_one_a_reset() -> None:
    """Undone in doubt (a front died while handing its reply over: node/hop.py): whether
    the client holds step 2's result is unknown, so the next step starts clean and says so,
    never a silent continuation from step 1 (DESIGN rule 6); the one after goes on."""
    d, _, _ = make(1)
    await dispatch(d, "n/0", "ep", 7, True, obs(1))
    unknown = await dispatch(d, "n/0", "ep", 7, False, obs(2))
    assert d.table.undo("ep", unknown.seq, doubt=True)
    nxt = await dispatch(d, "n/0", "ep", 7, False, obs(4))
    assert (nxt.state_reset, nxt.seq, act(nxt)) == (True, 1, 4.0)  # started clean, said
    after = await dispatch(d, "n/0", "ep", 7, False, obs(1))
    assert (after.state_reset, after.seq, act(after)) == (False, 2, 5.0)
    held = await dispatch(d, "n/0", "held", 7, True, obs(1), seq=1)  # seq makes a retry safe:
    assert not d.table.undo("held", held.seq, doubt=True)  # held for it, never in doubt


async def test_the_first_step_undone_leaves_a_claim_with_nothing_applied() -> None:
    d, _, _ = make(1)
    first = await dispatch(d, "n/0", "ep", 7, True, obs(5))
    assert d.undo("ep", first.seq)
    again = await dispatch(d, "n/0", "ep", 7, False, obs(1))
    assert (again.seq, act(again), again.state_reset) == (1, 1.0, False)


async def test_an_undo_that_comes_after_a_later_step_makes_the_next_one_a_reset() -> None:
    d, _, _ = make(1)
    await dispatch(d, "n/0", "ep", 7, True, obs(1))
    await dispatch(d, "n/0", "ep", 7, False, obs(2))
    await dispatch(d, "n/0", "ep", 7, False, obs(3))
    assert d.undo("ep", 2), "step 3 was applied on top: its outcome cannot be known"
    nxt = await dispatch(d, "n/0", "ep", 7, False, obs(5))
    assert (nxt.state_reset, nxt.seq, act(nxt)) == (True, 1, 5.0)  # started clean, said
    after = await dispatch(d, "n/0", "ep", 7, False, obs(0))
    assert not after.state_reset


async def test_an_undo_by_forward_names_the_forward_that_applied_the_step() -> None:
    d, _, _ = make(1)
    await dispatch(d, "n/0", "ep", 7, True, obs(1), origin="f1")
    await dispatch(d, "n/0", "ep", 7, False, obs(2), origin="f2")
    # f1's step has a later one on top (f2 is current): it cannot be undone, so the
    # episode is in doubt; undoing f2 then leaves f1's step, which its client never saw
    assert d.undo("ep", origin="f1")
    assert d.undo("ep", origin="f2")
    assert not d.undo("ep", origin="f2")
    r = await dispatch(d, "n/0", "ep", 7, False, obs(4))
    assert (r.seq, act(r), r.state_reset) == (1, 4.0, True)  # started clean, said


async def test_a_forward_whose_undo_came_first_is_never_applied() -> None:
    """A paused owner reads, on resume, a forward its router gave up on and the router's
    undo of it, in either order: the undo that finds nothing is remembered, and the forward
    is refused rather than applied with no one waiting for it (issue 21 item 1)."""
    d, sessions, _ = make(1)
    await dispatch(d, "n/0", "ep", 7, True, obs(1), origin="f1")
    assert not d.undo("ep", origin="f2"), "f2 has not been applied yet"
    runs = sessions["n/0"].calls
    with pytest.raises(ForwardCancelled):
        await dispatch(d, "n/0", "ep", 7, False, obs(2), origin="f2")
    assert sessions["n/0"].calls == runs
    r = await dispatch(d, "n/0", "ep", 7, False, obs(4), origin="f3")
    assert (r.seq, act(r), r.state_reset) == (2, 5.0, False), "f2 changed nothing"


async def test_undoing_the_step_on_top_of_one_in_doubt_keeps_the_doubt() -> None:
    """Step 2's undo comes after step 3 (so step 2 cannot be restored), then step 3's own:
    the record back is step 2's, which is exactly the step that should have been undone,
    so the next step still says state_reset."""
    d, _, _ = make(1)
    for i, first in ((1, True), (2, False), (3, False)):
        await dispatch(d, "n/0", "ep", 7, first, obs(i))
    assert d.undo("ep", 2) and d.undo("ep", 3)
    nxt = await dispatch(d, "n/0", "ep", 7, False, obs(0))
    assert nxt.seq == 1 and nxt.state_reset  # started clean, said


async def test_buffered_steps_are_numbered_replayed_and_undone() -> None:
    d, _, _ = make(1, CHUNKED, session=ChunkSession, chunks=ChunkSettings(execute_steps=H))
    m = await dispatch(d, "n/0", "ep", 7, True, obs(0))
    b = await dispatch(d, "n/0", "ep", 7, False, obs(0))
    assert (m.source, b.source, b.seq) == ("model", "buffer", 2)
    assert d.undo("ep", 2)  # its reply was lost: undone, buffer included
    again = await dispatch(d, "n/0", "ep", 7, False, obs(0), seq=2)
    assert not again.replayed and np.array_equal(again.outputs["actions"], b.outputs["actions"])
    np.testing.assert_array_equal(again.outputs["actions"][0], recorded_chunk(0, 0)[1])
    replay = await dispatch(d, "n/0", "ep", 7, False, obs(0), seq=2)
    assert replay.replayed and np.array_equal(replay.outputs["actions"], b.outputs["actions"])
    assert not d.undo("ep", 2), "a step that named its seq is held for the retry, never undone"


async def test_a_step_that_named_its_seq_is_held_for_the_retry_and_never_undone() -> None:
    """The caller of step 2 went away while it ran (its client's timeout): the step runs on
    and keeps its result; the retry, the same request, gets the run under way or its
    stored reply without a second run; a different request under seq 2 is a conflict."""
    d, sessions, _ = make(1)
    await dispatch(d, "n/0", "ep", 7, True, obs(1), seq=1)
    gate = threading.Event()
    sessions["n/0"].gate = gate
    first = asyncio.ensure_future(dispatch(d, "n/0", "ep", 7, False, obs(2), seq=2))
    await started(sessions["n/0"])
    first.cancel()  # the caller left while its step ran
    with pytest.raises(asyncio.CancelledError):
        await first
    assert d.table.in_flight("ep"), "a held step still counts until it is done"
    retry = asyncio.ensure_future(dispatch(d, "n/0", "ep", 7, False, obs(2), seq=2))
    await asyncio.sleep(0.01)
    assert not retry.done()  # it waits for the run under way
    runs = sessions["n/0"].calls
    gate.set()
    got = await retry
    assert got.replayed and (got.seq, act(got)) == (2, 3.0)
    assert sessions["n/0"].calls == runs, "the retry ran no model: it got the first run's reply"
    await d.table.wait_idle("ep")
    assert not d.undo("ep", 2)
    with pytest.raises(SeqConflict, match="other inputs"):
        await dispatch(d, "n/0", "ep", 7, False, obs(9), seq=2)
    nxt = await dispatch(d, "n/0", "ep", 7, False, obs(4), seq=3)
    assert (nxt.seq, act(nxt), nxt.state_reset) == (3, 7.0, False)


async def test_a_step_queued_behind_the_end_of_its_claim_never_recreates_it() -> None:
    """The owner ends the episode (a client's end, an operator's revocation, a lost claim)
    while a step of that claim waits in the device's queue: the step is refused
    (ClaimEnded, nothing applied) instead of re-creating the record under the ended claim;
    a new claim of the episode starts clean."""
    d, sessions, _ = make(1)
    await dispatch(d, "n/0", "ep", 7, True, obs(1), claim="c1")
    gate = threading.Event()
    sessions["n/0"].gate = gate
    blocker = asyncio.ensure_future(dispatch(d, "n/0", "other", 8, True, obs(1), claim="c9"))
    await started(sessions["n/0"])
    queued = asyncio.ensure_future(dispatch(d, "n/0", "ep", 7, False, obs(2), claim="c1"))
    await asyncio.sleep(0.01)
    assert d.table.release("ep", "end") is not None
    gate.set()
    await blocker
    with pytest.raises(ClaimEnded):
        await queued
    assert d.table.get("ep") is None
    with pytest.raises(ClaimEnded):  # and any later step of that claim
        await dispatch(d, "n/0", "ep", 7, False, obs(2), claim="c1")
    fresh = await dispatch(d, "n/0", "ep", 9, True, obs(5), claim="c2")
    assert (fresh.seq, fresh.state_reset, act(fresh)) == (1, False, 5.0)


async def test_a_claim_ended_while_its_step_ran_keeps_nothing() -> None:
    d, sessions, _ = make(1)
    gate = threading.Event()
    sessions["n/0"].gate = gate
    step = asyncio.ensure_future(dispatch(d, "n/0", "ep", 7, True, obs(1), claim="c1"))
    await started(sessions["n/0"])
    d.table.release("ep", "revoked", 7)  # nothing held yet: that claim's step keeps nothing
    gate.set()
    with pytest.raises((ClaimEnded, NotKept)):
        await step
    assert d.table.get("ep") is None


async def test_a_claim_ended_before_its_first_step_arrived_keeps_nothing() -> None:
    """A router claimed the episode in Redis and sends its first step here; an end that
    read Redis meanwhile releases that claim before the step arrived (no record, nothing in
    flight). The step, arriving after, is refused and keeps nothing: Redis gave the
    episode up, and the next claim may be on another node."""
    d, _, _ = make(1)
    assert d.table.release("ep", "end", 7) is None  # ended before anything arrived
    with pytest.raises(ClaimEnded):
        await dispatch(d, "n/0", "ep", 7, True, obs(1), claim="c1")
    assert d.table.get("ep") is None
    fresh = await dispatch(d, "n/0", "ep", 8, True, obs(2), claim="c2")  # a new claim
    assert (fresh.seq, fresh.state_reset, act(fresh)) == (1, False, 2.0)


async def test_a_node_that_dropped_an_episode_says_state_reset_when_it_starts_it_again() -> None:
    """Dropped here for any reason but its client's end (idle, lost, revoked, fenced): the
    episode's next claim here starts clean and says so, echo or not; after a client's end
    the next claim is a new episode."""
    for reason, reset in (("idle", True), ("lost", True), ("fenced", True), ("end", False)):
        d, _, _ = make(1)
        await dispatch(d, "n/0", "ep", 7, True, obs(1), claim="c1")
        if reason == "fenced":
            d.table.drop_all("fenced")
        else:
            d.table.release("ep", reason)  # type: ignore[arg-type]
        again = await dispatch(d, "n/0", "ep", 9, True, obs(1), claim="c2")
        assert (again.seq, again.state_reset) == (1, reset), reason
        after = await dispatch(d, "n/0", "ep", 9, False, obs(1), claim="c2")
        assert not after.state_reset, "said once"
        d.close()


async def test_a_reset_whose_reply_was_lost_is_said_again_by_the_retry() -> None:
    """A first step that said state_reset and was undone (its reply never reached the
    client): the retry must say it again, or the client never learns of the reset."""
    d, _, _ = make(1)
    lost = await dispatch(d, "n/0", "ep", 7, False, obs(1))  # not fresh, nothing held: a reset
    assert lost.state_reset and d.undo("ep", lost.seq)
    retry = await dispatch(d, "n/0", "ep", 7, False, obs(1))
    assert (retry.seq, retry.state_reset) == (1, True)


def test_admit_and_undone_rules() -> None:
    rec = Episode("n/0", 7, "c1", {}, 0.0, 3, None)
    assert admit("ep", rec, "n/0", 7, "c1", False, 4) == Apply(rec, False)
    with pytest.raises(SeqConflict):
        admit("ep", rec, "n/0", 7, "c1", False, 3)  # no stored reply to replay
    # another claim id under the same token number is a new claim: clean state, a reset
    assert admit("ep", rec, "n/0", 7, "c2", False, None) == Apply(None, True)
    assert admit("ep", rec, "n/0", 7, "c2", False, 1) == Apply(None, False)
    assert admit("ep", None, "n/0", 7, "c1", True, None) == Apply(None, False)
    assert admit("ep", None, "n/0", 7, "c1", True, None, dropped=True) == Apply(None, True)
    with pytest.raises(ClaimEnded):  # an older claim's step never replaces a newer record
        admit("ep", rec, "n/0", 6, "c0", False, None)
    assert undone(rec, 2, None) is rec and rec.doubt
    assert undone(rec, 5, None) is None


# ---- a property test: random interleavings against a reference model ---------------------

# what happens to one attempt of the client's step
OUTCOMES = st.sampled_from(
    ["delivered", "lost_undone", "lost_unknown", "replayed_dup", "cancelled_mid_run"]
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    plan=st.lists(
        st.tuples(st.integers(1, 9), st.lists(OUTCOMES, min_size=1, max_size=4)),
        min_size=1,
        max_size=12,
    ),
    with_seq=st.booleans(),
)
async def test_random_interleavings_apply_every_step_once(
    plan: list[tuple[int, list[str]]], with_seq: bool
) -> None:
    """Each client step (an observation x) is tried until delivered: an attempt is
    delivered; lost and undone (the reply never reached a live caller: router deadline,
    closed connection, failed send, a router that gave up; one that named its seq is held
    instead, its retry replayed); cancelled while the model runs (a deadline or a close
    that lands mid-run, e.g. an owner paused with the step queued; held too, with seq);
    lost where nobody can know (applied, reply gone: only a client with seq can be served
    exactly once); or delivered twice (a duplicate retry with the same seq). The fake
    model's state is the sum of the observations it applied: the client's view must equal
    the reference sum."""
    d, sessions, _ = make(
        1, crashes=CrashSettings(failure_threshold=10_000), batching=BatchSettings(max_batch=1)
    )  # a cancel mid-run is a hang
    session = sessions["n/0"]
    reference = 0.0
    seq = 0
    fresh = True
    try:
        for x, attempts in plan:
            unseen = False  # applied, its reply lost: a retry with seq is a replay
            safe = ("delivered", "lost_undone", "cancelled_mid_run")
            attempts = [o for o in attempts if with_seq or o in safe]
            attempts.append("delivered")
            for outcome in attempts:
                sent = seq + 1 if with_seq else None
                if outcome == "cancelled_mid_run" and unseen:
                    continue  # the retry would be a replay: no model run to cancel
                if outcome == "cancelled_mid_run":
                    session.held.clear()
                    gate = session.hold[float(x)] = threading.Event()
                    running = asyncio.ensure_future(
                        dispatch(d, "n/0", "ep", 7, fresh, obs(x), seq=sent)
                    )
                    assert await asyncio.to_thread(session.held.wait, 10)
                    running.cancel()
                    gate.set()
                    with contextlib.suppress(asyncio.CancelledError):
                        await running
                    del session.hold[float(x)]
                    await d.table.wait_idle("ep")
                    fresh = fresh and not with_seq
                    unseen = with_seq  # held for the retry: it ran to the end and applied
                    continue
                r = await dispatch(d, "n/0", "ep", 7, fresh, obs(x), seq=sent)
                fresh = False
                if outcome == "lost_undone":
                    if with_seq:  # a step that named its seq is held, never undone
                        assert not d.undo("ep", r.seq)
                        unseen = True
                    elif not r.replayed:  # a front door never undoes a replay
                        assert d.undo("ep", r.seq)
                    continue
                if outcome == "lost_unknown":
                    unseen = True
                    continue  # applied; the client retries with the same seq
                if outcome == "replayed_dup":
                    dup = await dispatch(d, "n/0", "ep", 7, False, obs(x), seq=r.seq)
                    assert dup.replayed and act(dup) == act(r)
                reference += x
                seq = r.seq
                assert act(r) == reference and not r.state_reset
                break
        assert d.table.state_of("ep") == {"state_in.h": np.array([[reference]], np.float32)}
    finally:
        d.close()


async def test_a_client_leaving_mid_run_is_not_a_hung_device() -> None:
    """A step cancelled mid-run before its deadline (its client left) keeps nothing and
    does not count against the device; past its deadline it counts as a hung run."""
    d, sessions, transitions = make(1, crashes=CrashSettings(failure_threshold=1))
    session = sessions["n/0"]
    for deadline, counted in ((time.monotonic() + 60, False), (time.monotonic() - 1, True)):
        session.held.clear()
        gate = session.hold[1.0] = threading.Event()
        running = asyncio.ensure_future(
            dispatch(d, "n/0", "ep", 7, True, obs(1), deadline=deadline)
        )
        assert await asyncio.to_thread(session.held.wait, 10)
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running  # cancelled while the run is still held on the worker
        gate.set()
        await d.table.wait_idle("ep")
        assert bool(transitions) is counted and d.table.get("ep") is None


async def test_a_record_whose_state_died_with_its_worker_process_starts_over_said() -> None:
    """A step read its record just before its device's worker process died, and kept a
    state that process held (``RemoteState.stale``): the next step drops that record and
    starts clean, said (``state_reset``, seq 1), never a run on a state that is gone."""
    from dataclasses import replace

    class Gone:
        stale = True

    d, _, _ = make(1)
    await dispatch(d, "n/0", "ep", 7, True, obs(1))
    record = d.table.get("ep")
    assert record is not None
    with d.table.lock:
        d.table._records["ep"] = replace(record, state={k: Gone() for k in record.state})
    r = await dispatch(d, "n/0", "ep", 7, False, obs(2))
    assert (r.seq, r.state_reset, act(r)) == (1, True, 2.0)


async def test_the_retry_of_a_step_that_started_over_gets_its_reply_the_reset_said() -> None:
    """A step names its seq (3) and starts from the initial state (its record was dropped:
    here, its state died with a worker process); its reply, which says so, is lost. Its
    retry names the same seq and gets that reply, ``state_reset`` and all, and the episode
    goes on from it. The reset keeps the seq its caller named: numbered afresh (1), the
    retry's 3 was neither the next nor the last step (409 ``seq_conflict`` at every retry,
    for good), and a caller that had sent 2 could not be told from its next step."""
    from dataclasses import replace

    class Gone:
        stale = True

    d, _, _ = make(1)
    await dispatch(d, "n/0", "ep", 7, True, obs(1), seq=1)
    await dispatch(d, "n/0", "ep", 7, False, obs(2), seq=2)
    record = d.table.get("ep")
    assert record is not None
    with d.table.lock:
        d.table._records["ep"] = replace(record, state={k: Gone() for k in record.state})
    first = await dispatch(d, "n/0", "ep", 7, False, obs(4), seq=3)  # (its reply lost)
    assert (first.seq, first.state_reset, act(first)) == (3, True, 4.0)
    retry = await dispatch(d, "n/0", "ep", 7, False, obs(4), seq=3)
    assert (retry.seq, retry.state_reset, retry.replayed, act(retry)) == (3, True, True, 4.0)
    nxt = await dispatch(d, "n/0", "ep", 7, False, obs(8), seq=4)
    assert (nxt.seq, nxt.state_reset, act(nxt)) == (4, False, 12.0)
