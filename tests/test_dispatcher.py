"""MultiGpuDispatcher's step rules with fake sessions: state per episode and token, moves,
releases and drops, crash tracking and probes, cancelled and hung steps, and action-chunk
execution. The worker's queue, batching and inline runs: tests/test_worker.py."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from affinity.claims import Assignment
from affinity.errors import InvalidArgument
from node.chunks import ActionBuffer, ChunkMode, ChunkSpec, find_chunk
from node.contract import PolicyContract, TensorSpec
from node.dispatcher import ChunkSettings, CrashSettings, MultiGpuDispatcher, WorkerHooks
from node.errors import DeviceDown, ModelFailure, NotKept
from node.step import Step
from tests.dispatch import dispatch

pytestmark = pytest.mark.anyio

CONTRACT = PolicyContract(
    inputs=(TensorSpec("obs", (1, 2), "float32"), TensorSpec("state_in.h", (1, 1), "float32")),
    outputs=(TensorSpec("act", (1, 1), "float32"), TensorSpec("state_out.h", (1, 1), "float32")),
    state={"state_in.h": "state_out.h"},
)
# the same model with a batch axis
BATCHED = PolicyContract(
    inputs=(
        TensorSpec("obs", ("batch", 2), "float32"),
        TensorSpec("state_in.h", ("batch", 1), "float32"),
    ),
    outputs=(
        TensorSpec("act", ("batch", 1), "float32"),
        TensorSpec("state_out.h", ("batch", 1), "float32"),
    ),
    state={"state_in.h": "state_out.h"},
    batch_axis=True,
)
POISON = 13.0  # an observation the fake model fails on

_open: list[MultiGpuDispatcher] = []


@pytest.fixture(autouse=True)
def _close_dispatchers() -> Any:
    yield
    while _open:
        _open.pop().close()


class FakeSession:
    """Per row: h' = h + sum(obs); act = h'. Records the thread of every run and the rows
    (first observation value of each) it ran; fails a run holding the POISON value."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.threads: set[int] = set()
        self.fail = 0  # fail the next N runs
        self.calls = 0
        self.gate: threading.Event | None = None
        self.entered = threading.Event()  # set when a run starts
        self.runs: list[list[float]] = []
        # a run holding one of these observations waits for its event; `held` says one does
        self.hold: dict[float, threading.Event] = {}
        self.held = threading.Event()

    def run(self, names: Sequence[str] | None, feed: Mapping[str, Any]) -> list[Any]:
        self.calls += 1
        self.threads.add(threading.get_ident())
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(5)
        self.runs.append([float(x) for x in feed["obs"][:, 0]])
        for x in self.runs[-1]:
            if x in self.hold:
                self.held.set()
                self.hold[x].wait(5)
        if self.fail:
            self.fail -= 1
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if (feed["obs"] == POISON).any():
            raise ValueError("the model cannot take this observation")
        h = feed["state_in.h"] + feed["obs"].sum(axis=1, keepdims=True)
        return [h.copy(), h]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def started(session: FakeSession) -> None:
    """Wait (bounded) until a run has entered ``session``."""
    assert await asyncio.to_thread(session.entered.wait, 10), "the run never started"


def obs(x: float) -> dict[str, np.ndarray]:
    return {"obs": np.array([[x, 0]], np.float32)}


def episodes(d: MultiGpuDispatcher) -> list[tuple[str, int, str]]:
    """(episode, token, device) of every record held."""
    return [(ep, r.token, r.device) for ep, r in d.table.records()]


def make(
    n: int = 2, contract: PolicyContract = CONTRACT, session: Any = FakeSession, **kw: Any
) -> tuple[MultiGpuDispatcher, dict[str, Any], list[Any]]:
    sessions: dict[str, Any] = {}
    transitions: list[Any] = []

    def factory(device: str) -> Any:
        sessions[device] = session(device)
        return sessions[device]

    hooks = replace(kw.pop("hooks", WorkerHooks()), on_transition=lambda *a: transitions.append(a))
    d = MultiGpuDispatcher([f"n/{i}" for i in range(n)], factory, contract, hooks=hooks, **kw)
    _open.append(d)
    return d, sessions, transitions


async def settled(tasks: list[asyncio.Future[Any]]) -> list[Any]:
    return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)


async def test_state_follows_episode_and_token() -> None:
    d, _, _ = make()
    r1 = await dispatch(d, "n/0", "ep", 7, True, obs(1))
    r2 = await dispatch(d, "n/0", "ep", 7, False, obs(2))
    assert (r1.outputs["act"].item(), r2.outputs["act"].item()) == (1.0, 3.0)
    assert not r1.state_reset and not r2.state_reset and r2.seq == 2
    assert "state_out.h" not in r2.outputs, "fed-back state is not an output for clients"
    # a new token (a new claim) starts clean and says so
    r3 = await dispatch(d, "n/0", "ep", 9, False, obs(5))
    assert (r3.outputs["act"].item(), r3.state_reset, r3.seq) == (5.0, True, 1)


async def test_a_step_and_its_assignment_are_taken_whole() -> None:
    """The claim comes from the Assignment (status "claimed": fresh), the options from the
    Step; ``inputs`` replaces the step's own (the owner adds its control values)."""
    d, _, _ = make()
    claimed = Assignment("ep", "claimed", "n/0", 7, "n", "", None, "c1")
    first = await d.step(Step("ep", obs(1), 0.0, seq=1), claimed)
    second = await d.step(Step("ep", obs(100), 0.0, seq=2), claimed._replace(status="hit"),
                          inputs=obs(2))  # fmt: skip
    assert (first.outputs["act"].item(), second.outputs["act"].item(), second.seq) == (1, 3, 2)
    assert not second.state_reset and d.table.holds("ep", "n/0", 7, "c1")


async def test_interleaved_episodes_do_not_disturb_each_other() -> None:
    d, _, _ = make()
    a = b = 0.0
    for i in range(10):
        a = (await dispatch(d, "n/0", "a", 1, i == 0, obs(1))).outputs["act"].item()
        b = (await dispatch(d, "n/0", "b", 2, i == 0, obs(10))).outputs["act"].item()
    assert (a, b) == (10.0, 100.0)
    assert d.live_episodes("n/0") == 2


async def test_a_fresh_claim_starts_clean_over_state_with_the_same_token() -> None:
    # after a lossy failover Redis may hand out a token number again, for a new claim
    d, _, _ = make()
    await dispatch(d, "n/0", "ep", 7, True, obs(1))
    await dispatch(d, "n/0", "ep", 7, False, obs(2))
    again = await dispatch(d, "n/0", "ep", 7, True, obs(4))
    assert (again.outputs["act"].item(), again.state_reset, again.seq) == (4.0, True, 1)


async def test_unknown_state_of_a_hit_is_a_reset() -> None:
    d, _, _ = make()
    r = await dispatch(d, "n/1", "ep", 3, False, obs(1))
    assert r.state_reset


async def test_moving_episode_between_devices() -> None:
    d, _, _ = make(2)
    await dispatch(d, "n/0", "ep", 1, True, obs(1))
    r = await dispatch(d, "n/1", "ep", 2, False, obs(1))
    assert r.state_reset
    assert (d.live_episodes("n/0"), d.live_episodes("n/1")) == (0, 1)


async def test_release_expire_drop() -> None:
    clock = Clock()
    d, _, _ = make(2, clock=clock)
    await dispatch(d, "n/0", "a", 1, True, obs(1))
    await dispatch(d, "n/1", "b", 2, True, obs(1))
    assert d.table.release("a", "end") and not d.table.release("a", "end")
    clock.t += 5
    await dispatch(d, "n/0", "c", 3, True, obs(1))
    clock.t += 6
    assert len(d.table.expire_idle(10)) == 1  # b idle 11s, c idle 6s
    assert d.table.get("b") is None and d.table.get("c") is not None
    assert d.table.drop_all("fenced") == 1 and d.live_episodes("n/0") == 0


async def test_crash_tracker_down_probe_up() -> None:
    clock = Clock()
    d, sessions, transitions = make(
        2, clock=clock, crashes=CrashSettings(failure_threshold=3, cooldown_s=30)
    )
    await dispatch(d, "n/0", "ep", 1, True, obs(1))
    sessions["n/0"].fail = 3
    for _ in range(3):
        with pytest.raises(ModelFailure, match="n/0"):
            await dispatch(d, "n/0", "ep", 1, False, obs(1))
    assert transitions == [("n/0", "down", transitions[0][2])]
    assert "illegal memory access" in transitions[0][2]
    with pytest.raises(DeviceDown):
        await dispatch(d, "n/0", "ep", 1, False, obs(1))
    # the failed runs did not advance the state
    assert d.table.get("ep").token == 1
    assert await d.probe() == []  # cool-down not over
    clock.t += 31
    assert await d.probe() == ["n/0"]
    assert transitions[-1] == ("n/0", "up", "")
    r = await dispatch(d, "n/0", "ep", 1, False, obs(1))
    assert r.outputs["act"].item() == 2.0


async def test_failed_probe_restarts_cooldown() -> None:
    clock = Clock()
    d, sessions, transitions = make(
        1, clock=clock, crashes=CrashSettings(failure_threshold=1, cooldown_s=10)
    )
    sessions["n/0"].fail = 2
    with pytest.raises(ModelFailure):
        await dispatch(d, "n/0", "ep", 1, True, obs(1))
    clock.t += 11
    assert await d.probe() == []
    clock.t += 5
    assert await d.probe() == []
    clock.t += 6
    assert await d.probe() == ["n/0"]
    assert [t[1] for t in transitions] == ["down", "up"]


async def test_stateless_run_keeps_nothing() -> None:
    d, _, _ = make(1)
    out = await d.run_stateless("n/0", obs(4))
    assert out["act"].item() == 4.0 and d.table.get("") is None and d.live_episodes("n/0") == 0


async def test_a_step_whose_caller_gave_up_keeps_nothing() -> None:
    d, sessions, _ = make(1)
    await dispatch(d, "n/0", "ep", 1, True, obs(1))  # h = 1
    s = sessions["n/0"]
    gate = threading.Event()
    s.gate = gate
    s.entered.clear()
    running = asyncio.ensure_future(dispatch(d, "n/0", "ep", 1, False, obs(2)))
    queued = asyncio.ensure_future(dispatch(d, "n/0", "other", 2, True, obs(5)))
    await started(s)
    calls = s.calls
    running.cancel()  # the request's deadline passed while the model ran
    queued.cancel()  # ... and while this one still waited in the device's queue
    gate.set()
    s.gate = None
    r = await dispatch(d, "n/0", "ep", 1, False, obs(2))
    assert r.outputs["act"].item() == 3.0 and not r.state_reset  # h = 1 + 2, not 1 + 2 + 2
    assert s.calls == calls + 1, "the queued step of a cancelled request never ran"
    assert d.table.get("other") is None


async def test_drop_all_during_a_run_keeps_nothing_and_answers_nothing() -> None:
    """The node fenced itself (or registered anew) while the model ran: the step's result
    is kept nowhere, so it is not answered either (NotKept: 503 at the owner)."""
    d, sessions, _ = make(1)
    gate = threading.Event()
    sessions["n/0"].gate = gate
    step = asyncio.ensure_future(dispatch(d, "n/0", "ep", 1, True, obs(1)))
    await started(sessions["n/0"])
    d.table.drop_all("fenced")  # the node fenced itself while the model ran
    gate.set()
    with pytest.raises(NotKept):
        await step
    assert d.table.get("ep") is None
    with pytest.raises(NotKept):  # a step that began before the drop never runs
        await dispatch(d, "n/0", "ep", 1, True, obs(1), generation=d.table.generation - 1)


async def test_a_run_that_outlives_its_deadline_counts_as_a_failure() -> None:
    d, sessions, transitions = make(1, crashes=CrashSettings(failure_threshold=1))
    gate = threading.Event()
    sessions["n/0"].gate = gate  # the GPU hangs
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await dispatch(d, "n/0", "ep", 1, True, obs(1))
    assert transitions and transitions[0][:2] == ("n/0", "down")
    assert "deadline" in transitions[0][2]
    with pytest.raises(DeviceDown):
        await dispatch(d, "n/0", "ep", 1, True, obs(1))
    gate.set()
    d.close()  # the hung run returns; its worker ends


async def test_in_flight_and_wait_idle_follow_the_episodes_steps() -> None:
    d, sessions, _ = make(1)
    s = sessions["n/0"]
    assert not d.table.in_flight("ep")
    await asyncio.wait_for(d.table.wait_idle("ep"), 5)  # nothing in flight: returns at once
    gate = threading.Event()
    s.gate = gate
    step = asyncio.ensure_future(dispatch(d, "n/0", "ep", 1, True, obs(1)))
    await started(s)
    assert d.table.in_flight("ep") and not d.table.in_flight("other")
    idle = asyncio.ensure_future(d.table.wait_idle("ep"))
    await asyncio.sleep(0)
    assert not idle.done(), "wait_idle returned while the step was running"
    gate.set()
    await asyncio.wait_for(idle, 5)
    assert step.done() and step.result().seq == 1, "idle before the step's reply"
    assert not d.table.in_flight("ep")
    assert episodes(d) == [("ep", 1, "n/0")]


async def test_a_cancelled_step_is_not_in_flight() -> None:
    d, sessions, _ = make(1)
    s = sessions["n/0"]
    gate = threading.Event()
    s.gate = gate
    blocker = asyncio.ensure_future(dispatch(d, "n/0", "a", 1, True, obs(1)))
    await started(s)
    queued = asyncio.ensure_future(dispatch(d, "n/0", "b", 2, True, obs(1)))
    await asyncio.sleep(0)
    assert d.table.in_flight("b")
    queued.cancel()
    await asyncio.wait_for(d.table.wait_idle("b"), 5)  # the blocked run does not hold it
    assert not d.table.in_flight("b") and d.table.in_flight("a")
    gate.set()
    await blocker
    assert sorted(episodes(d)) == [("a", 1, "n/0")]


async def test_episodes_lists_state_held_here() -> None:
    d, _, _ = make(2)
    await dispatch(d, "n/0", "a", 5, True, obs(1))
    await dispatch(d, "n/1", "b", 6, True, obs(1))
    await dispatch(d, "n/1", "a", 7, False, obs(1))  # a moved with a new token
    assert sorted(episodes(d)) == [("a", 7, "n/1"), ("b", 6, "n/1")]
    d.table.release("a", "end")
    assert episodes(d) == [("b", 6, "n/1")]


# ---- action-chunk execution -------------------------------------------------------------

H, D = 4, 3
CHUNKED = PolicyContract(
    inputs=(
        TensorSpec("obs", ("batch", 2), "float32"),
        TensorSpec("state_in.h", ("batch", 1), "float32"),
    ),
    outputs=(
        TensorSpec("actions", ("batch", H, D), "float32"),
        TensorSpec("extra", ("batch", 1), "float32"),
        TensorSpec("state_out.h", ("batch", 1), "float32"),
    ),
    state={"state_in.h": "state_out.h"},
    chunk="actions",
    batch_axis=True,
)


def recorded_chunk(episode: int, run: int) -> np.ndarray:
    """The chunk the model predicts at its ``run``-th run for episode number ``episode``."""
    rng = np.random.default_rng([episode, run])
    return rng.uniform(-1, 1, (H, D)).astype(np.float32)


class ChunkSession(FakeSession):
    """Per row: the state counts the model's runs for that episode (obs[0] is its number);
    the chunk is ``recorded_chunk(episode, runs so far)``."""

    def run(self, names: Sequence[str] | None, feed: Mapping[str, Any]) -> list[Any]:
        self.calls += 1
        self.runs.append([float(x) for x in feed["obs"][:, 0]])
        for x in self.runs[-1]:
            if x in self.hold:
                self.held.set()
                self.hold[x].wait(5)
        h = feed["state_in.h"]
        rows = zip(feed["obs"][:, 0], h[:, 0], strict=True)
        chunks = np.stack([recorded_chunk(int(e), int(r)) for e, r in rows])
        return [chunks, h * 10, h + 1]


def reference_execute(chunks: list[np.ndarray], k: int, steps: int) -> list[tuple[Any, str]]:
    """Execute-k in plain numpy: run at steps 0, k, 2k, ..., serve the chunk in between."""
    out: list[tuple[Any, str]] = []
    for t in range(steps):
        chunk = chunks[t // k]
        out.append((chunk[t % k], "model" if t % k == 0 else "buffer"))
    return out


def reference_ensemble(chunks: list[np.ndarray], m: float, steps: int) -> list[tuple[Any, str]]:
    """ACT's temporal ensembling in plain numpy: a table of every chunk's predictions by the
    time step they are for; the reply at t weighs the column t oldest-first, w_i = exp(-m i)."""
    h, d = chunks[0].shape
    table = np.zeros((steps, steps + h, d))
    filled = np.zeros((steps, steps + h), bool)
    out: list[tuple[Any, str]] = []
    for t in range(steps):
        table[t, t : t + h] = chunks[t]
        filled[t, t : t + h] = True
        column = table[filled[:, t], t]
        weights = np.exp(-m * np.arange(len(column)))
        weights /= weights.sum()
        out.append(((column * weights[:, None]).sum(axis=0), "model"))
    return out


@pytest.mark.parametrize(
    ("k", "ensemble"), [(1, None), (2, None), (3, None), (H, None), (None, "exp")]
)
async def test_chunk_execution_equals_the_numpy_reference(
    k: int | None, ensemble: str | None
) -> None:
    decay = 0.3
    d, sessions, _ = make(
        1, CHUNKED, session=ChunkSession, chunks=ChunkSettings(ensemble_decay=decay)
    )
    steps, episodes = 3 * H + 1, 5

    async def episode(e: int) -> list[Any]:
        replies = []
        for t in range(steps):
            inputs = {"obs": np.array([[e, t]], np.float32)}
            replies.append(
                await dispatch(
                    d, "n/0", f"ep{e}", 1, t == 0, inputs, execute_steps=k, ensemble=ensemble
                )
            )
        return replies

    # the episodes run concurrently: model steps batch together, buffered ones do not
    for e, replies in enumerate(await asyncio.gather(*(episode(e) for e in range(episodes)))):
        runs = steps if ensemble else -(-steps // (k or 1))
        chunks = [recorded_chunk(e, r) for r in range(runs)]
        want = (
            reference_ensemble(chunks, decay, steps)
            if ensemble
            else reference_execute(chunks, k or 1, steps)
        )
        for t, (reply, (action, source)) in enumerate(zip(replies, want, strict=True)):
            assert set(reply.outputs) == {"actions"}
            assert reply.outputs["actions"].shape == (1, D)
            np.testing.assert_allclose(reply.outputs["actions"][0], action, rtol=1e-6, atol=1e-7)
            assert (reply.source, reply.seq, reply.state_reset) == (source, t + 1, False)
        # the recurrent state advanced once per model run, never for a buffered step
        assert d.table.state_of(f"ep{e}")["state_in.h"].item() == runs
    assert sum(map(len, sessions["n/0"].runs)) == episodes * runs, "a buffered step ran"


async def test_the_node_mode_applies_when_a_step_has_no_override() -> None:
    d, sessions, _ = make(1, CHUNKED, session=ChunkSession, chunks=ChunkSettings(execute_steps=2))
    assert d.chunk_mode is not None and d.chunk_mode.execute_steps == 2
    sources = [(await dispatch(d, "n/0", "e", 1, t == 0, obs(0))).source for t in range(4)]
    assert sources == ["model", "buffer", "model", "buffer"]
    # an override changes k for this step: the chunk of the last run is served further
    r = await dispatch(d, "n/0", "e", 1, False, obs(0), execute_steps=H)
    assert (r.source, r.seq) == ("buffer", 5)
    np.testing.assert_array_equal(r.outputs["actions"][0], recorded_chunk(0, 1)[2])
    assert sessions["n/0"].calls == 2
    off, _, _ = make(1, CHUNKED, session=ChunkSession)
    full = await dispatch(off, "n/0", "e", 1, True, obs(0))
    assert full.outputs["actions"].shape == (1, H, D) and "extra" in full.outputs


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"execute_steps": 0}, "execute_steps"),
        ({"execute_steps": H + 1}, "execute_steps"),
        ({"execute_steps": True}, "execute_steps"),
        ({"execute_steps": "2"}, "execute_steps"),
        ({"execute_steps": 2.0}, "execute_steps"),
        ({"ensemble": "mean"}, "ensemble"),
        ({"ensemble": "exp", "execute_steps": 2}, "execute_steps"),
    ],
)
async def test_a_bad_override_is_refused_and_changes_nothing(
    overrides: dict[str, Any], field: str
) -> None:
    d, sessions, _ = make(1, CHUNKED, session=ChunkSession, chunks=ChunkSettings(execute_steps=H))
    await dispatch(d, "n/0", "e", 1, True, obs(0))
    with pytest.raises(InvalidArgument) as raised:
        await dispatch(d, "n/0", "e", 1, False, obs(0), **overrides)
    assert raised.value.field == field
    assert sessions["n/0"].calls == 1 and not d.table.in_flight("e")
    r = await dispatch(d, "n/0", "e", 1, False, obs(0))
    assert (r.source, r.seq) == ("buffer", 2), "the refused step changed the buffer"


async def test_chunk_execution_needs_a_chunk_output() -> None:
    d, _, _ = make(1, BATCHED)  # its only output is [batch, 1]
    assert d.chunk is None
    with pytest.raises(InvalidArgument, match="no action-chunk output"):
        await dispatch(d, "n/0", "e", 1, True, obs(0), execute_steps=1)
    assert d.table.get("e") is None
    with pytest.raises(ValueError, match="no action-chunk output"):
        make(1, BATCHED, chunks=ChunkSettings(execute_steps=2))
    with pytest.raises(ValueError, match="execute_steps"):
        make(1, CHUNKED, session=ChunkSession, chunks=ChunkSettings(execute_steps=H + 1))
    with pytest.raises(ValueError, match="ensemble"):
        make(1, CHUNKED, session=ChunkSession, chunks=ChunkSettings(ensemble="avg"))
    with pytest.raises(ValueError, match="ensemble_decay"):
        make(
            1,
            CHUNKED,
            session=ChunkSession,
            chunks=ChunkSettings(ensemble="exp", ensemble_decay=-1),
        )


def test_the_chunk_spec_follows_the_contract() -> None:
    spec, _ = find_chunk(CHUNKED)
    assert spec == ChunkSpec("actions", H, True)
    assert spec.action(np.zeros(D)).shape == (1, D)  # a batch axis: the action is [1, D]
    flat = PolicyContract(
        inputs=(TensorSpec("obs", (1, 2), "float32"),),
        outputs=(TensorSpec("plan", (H, D), "float32"),),
        state={},
        chunk="plan",
    )
    spec, _ = find_chunk(flat)
    assert spec == ChunkSpec("plan", H, False)
    assert spec.action(np.zeros(D)).shape == (D,)  # no batch axis: the action is [D]
    assert find_chunk(replace(flat, chunk=None))[0] is None


async def test_the_buffer_is_dropped_with_the_episodes_state() -> None:
    clock = Clock()
    d, sessions, _ = make(
        1, CHUNKED, session=ChunkSession, clock=clock, chunks=ChunkSettings(execute_steps=H)
    )

    def expire() -> None:
        clock.t += 11
        assert len(d.table.expire_idle(10)) == 1

    await dispatch(d, "n/0", "e", 1, True, obs(0))
    # a new token (reassigned): fresh state and buffer, reported
    r = await dispatch(d, "n/0", "e", 2, False, obs(0))
    assert (r.source, r.state_reset, r.seq) == ("model", True, 1)
    np.testing.assert_array_equal(r.outputs["actions"][0], recorded_chunk(0, 0)[0])
    for drop in (lambda: d.table.release("e", "end"), lambda: d.table.drop_all("fenced"), expire):
        drop()
        r = await dispatch(d, "n/0", "e", 2, False, obs(0))
        assert (r.source, r.state_reset, r.seq) == ("model", True, 1)
    assert sessions["n/0"].calls == 5


async def test_a_step_with_chunk_execution_off_drops_the_buffer() -> None:
    d, _, _ = make(1, CHUNKED, session=ChunkSession)
    await dispatch(d, "n/0", "e", 1, True, obs(0), execute_steps=H)
    full = await dispatch(d, "n/0", "e", 1, False, obs(0))
    assert full.outputs["actions"].shape == (1, H, D) and full.source == "model"
    r = await dispatch(d, "n/0", "e", 1, False, obs(0), execute_steps=H)
    assert r.source == "model", "a chunk older than the last model run was served"
    np.testing.assert_array_equal(r.outputs["actions"][0], recorded_chunk(0, 2)[0])


async def test_a_buffered_step_does_not_wait_behind_model_runs() -> None:
    d, sessions, _ = make(1, CHUNKED, session=ChunkSession, chunks=ChunkSettings(execute_steps=H))
    s = sessions["n/0"]
    await dispatch(d, "n/0", "e", 1, True, obs(0))
    hang = s.hold[7.0] = threading.Event()
    busy = asyncio.ensure_future(dispatch(d, "n/0", "other", 1, True, obs(7)))
    assert await asyncio.to_thread(s.held.wait, 10)  # the device is busy with "other"
    r = await asyncio.wait_for(dispatch(d, "n/0", "e", 1, False, obs(0)), 10)
    assert (r.source, r.seq) == ("buffer", 2) and not busy.done()
    hang.set()
    await busy


async def test_a_buffered_step_waits_for_its_episodes_step_in_flight() -> None:
    d, sessions, _ = make(1, CHUNKED, session=ChunkSession, chunks=ChunkSettings(execute_steps=H))
    s = sessions["n/0"]
    await dispatch(d, "n/0", "e", 1, True, obs(0))
    hang = s.hold[0.0] = threading.Event()
    model = asyncio.ensure_future(dispatch(d, "n/0", "e", 1, False, obs(0), execute_steps=1))
    assert await asyncio.to_thread(s.held.wait, 10)
    after = asyncio.ensure_future(dispatch(d, "n/0", "e", 1, False, obs(0)))
    await asyncio.sleep(0)
    assert not after.done(), "served from the old chunk before the model step finished"
    hang.set()
    m, a = await settled([model, after])
    assert (m.source, m.seq, a.source, a.seq) == ("model", 2, "buffer", 3)
    np.testing.assert_array_equal(a.outputs["actions"][0], recorded_chunk(0, 1)[1])


async def test_a_batch_mixes_episodes_with_and_without_chunk_execution() -> None:
    d, sessions, _ = make(1, CHUNKED, session=ChunkSession)
    s = sessions["n/0"]
    await dispatch(d, "n/0", "buffered", 1, True, obs(3), execute_steps=H)
    hang = s.hold[9.0] = threading.Event()
    blocker = asyncio.ensure_future(dispatch(d, "n/0", "blocker", 1, True, obs(9)))
    assert await asyncio.to_thread(s.held.wait, 10)
    tasks = [
        asyncio.ensure_future(dispatch(d, "n/0", "plain", 1, True, obs(1))),
        asyncio.ensure_future(dispatch(d, "n/0", "k2", 1, True, obs(2), execute_steps=2)),
        asyncio.ensure_future(dispatch(d, "n/0", "ens", 1, True, obs(4), ensemble="exp")),
        asyncio.ensure_future(dispatch(d, "n/0", "buffered", 1, False, obs(3), execute_steps=H)),
    ]
    await asyncio.sleep(0)
    hang.set()
    _, plain, k2, ens, buffered = await settled([blocker, *tasks])
    assert s.runs[-1] == [1.0, 2.0, 4.0], "one run for the three model steps"
    assert plain.outputs["actions"].shape == (1, H, D) and "extra" in plain.outputs
    np.testing.assert_array_equal(k2.outputs["actions"][0], recorded_chunk(2, 0)[0])
    np.testing.assert_allclose(ens.outputs["actions"][0], recorded_chunk(4, 0)[0], rtol=1e-6)
    assert (buffered.source, buffered.seq) == ("buffer", 2)
    np.testing.assert_array_equal(buffered.outputs["actions"][0], recorded_chunk(3, 0)[1])


def test_an_ensembling_buffer_holds_at_most_h_chunks() -> None:
    mode = ChunkMode(1, "exp", 0.01)
    buffer = ActionBuffer()
    for t in range(5 * H):
        buffer, _ = buffer.after_run(recorded_chunk(0, t), mode)
        assert len(buffer.chunks) == min(t + 1, H)
    buffer, _ = buffer.after_run(recorded_chunk(0, 99), ChunkMode(H, "none"))
    assert len(buffer.chunks) == 1  # execute-k keeps the newest chunk only
