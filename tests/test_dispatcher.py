"""MultiGpuDispatcher with fake sessions: routing, state, tokens, crash tracking (no ORT)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from node.dispatcher import DeviceDown, ModelFailure, MultiGpuDispatcher
from node.policy import PolicyContract, TensorSpec

pytestmark = pytest.mark.anyio

CONTRACT = PolicyContract(
    inputs=(TensorSpec("obs", (1, 2), "float32"), TensorSpec("state_in.h", (1, 1), "float32")),
    outputs=(TensorSpec("act", (1, 1), "float32"), TensorSpec("state_out.h", (1, 1), "float32")),
    state={"state_in.h": "state_out.h"},
)


class FakeSession:
    """h' = h + sum(obs); act = h'. Records the thread and device of every run."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.threads: set[int] = set()
        self.fail = 0  # fail the next N runs
        self.calls = 0
        self.gate: threading.Event | None = None
        self.entered = threading.Event()  # set when a run starts

    def run(self, names: Sequence[str] | None, feed: Mapping[str, Any]) -> list[Any]:
        self.calls += 1
        self.threads.add(threading.get_ident())
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(5)
        if self.fail:
            self.fail -= 1
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        h = feed["state_in.h"] + feed["obs"].sum()
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


def make(n: int = 2, **kw: Any) -> tuple[MultiGpuDispatcher, dict[str, FakeSession], list[Any]]:
    sessions: dict[str, FakeSession] = {}
    transitions: list[Any] = []

    def factory(device: str) -> FakeSession:
        sessions[device] = FakeSession(device)
        return sessions[device]

    d = MultiGpuDispatcher(
        [f"n/{i}" for i in range(n)],
        factory,
        CONTRACT,
        on_transition=lambda *a: transitions.append(a),
        **kw,
    )
    return d, sessions, transitions


async def test_state_follows_episode_and_token() -> None:
    d, _, _ = make()
    r1 = await d.step("n/0", "ep", 7, True, obs(1))
    r2 = await d.step("n/0", "ep", 7, False, obs(2))
    assert (r1.outputs["act"].item(), r2.outputs["act"].item()) == (1.0, 3.0)
    assert not r1.state_reset and not r2.state_reset and r2.step == 2
    assert "state_out.h" not in r2.outputs, "fed-back state is not an output for clients"
    # a new token (a new claim) starts clean and says so
    r3 = await d.step("n/0", "ep", 9, False, obs(5))
    assert (r3.outputs["act"].item(), r3.state_reset, r3.step) == (5.0, True, 1)


async def test_interleaved_episodes_do_not_disturb_each_other() -> None:
    d, _, _ = make()
    a = b = 0.0
    for i in range(10):
        a = (await d.step("n/0", "a", 1, i == 0, obs(1))).outputs["act"].item()
        b = (await d.step("n/0", "b", 2, i == 0, obs(10))).outputs["act"].item()
    assert (a, b) == (10.0, 100.0)
    assert d.live_episodes("n/0") == 2


async def test_unknown_state_of_a_hit_is_a_reset() -> None:
    d, _, _ = make()
    r = await d.step("n/1", "ep", 3, False, obs(1))
    assert r.state_reset


async def test_each_device_runs_on_its_own_thread() -> None:
    d, sessions, _ = make(3)
    await asyncio.gather(*(d.step(f"n/{i % 3}", f"ep{i}", i, True, obs(1)) for i in range(12)))
    threads = [sessions[f"n/{i}"].threads for i in range(3)]
    assert all(len(t) == 1 for t in threads)
    assert len(set.union(*threads)) == 3
    assert [sessions[f"n/{i}"].calls for i in range(3)] == [4, 4, 4]


async def test_devices_overlap() -> None:
    d, sessions, _ = make(2)
    gate = threading.Event()
    sessions["n/0"].gate = gate
    slow = asyncio.ensure_future(d.step("n/0", "a", 1, True, obs(1)))
    # n/1 answers while n/0 is blocked inside its run
    r = await asyncio.wait_for(d.step("n/1", "b", 2, True, obs(1)), 5)
    assert r.outputs["act"].item() == 1.0 and not slow.done()
    gate.set()
    await slow


async def test_moving_episode_between_devices() -> None:
    d, _, _ = make(2)
    await d.step("n/0", "ep", 1, True, obs(1))
    r = await d.step("n/1", "ep", 2, False, obs(1))
    assert r.state_reset
    assert (d.live_episodes("n/0"), d.live_episodes("n/1")) == (0, 1)


async def test_release_expire_drop() -> None:
    clock = Clock()
    d, _, _ = make(2, clock=clock, idle_ttl_s=10)
    await d.step("n/0", "a", 1, True, obs(1))
    await d.step("n/1", "b", 2, True, obs(1))
    assert d.release("a") and not d.release("a")
    clock.t += 5
    await d.step("n/0", "c", 3, True, obs(1))
    clock.t += 6
    assert d.expire_idle() == 1  # b idle 11s, c idle 6s
    assert not d.has_state("b") and d.has_state("c")
    assert d.drop_all() == 1 and d.live_episodes("n/0") == 0


async def test_crash_tracker_down_probe_up() -> None:
    clock = Clock()
    d, sessions, transitions = make(2, clock=clock, failure_threshold=3, cooldown_s=30)
    await d.step("n/0", "ep", 1, True, obs(1))
    sessions["n/0"].fail = 3
    for _ in range(3):
        with pytest.raises(ModelFailure, match="n/0"):
            await d.step("n/0", "ep", 1, False, obs(1))
    assert transitions == [("n/0", "down", transitions[0][2])]
    assert "illegal memory access" in transitions[0][2]
    with pytest.raises(DeviceDown):
        await d.step("n/0", "ep", 1, False, obs(1))
    # the failed runs did not advance the state
    assert d.token_of("ep") == 1
    assert await d.probe() == []  # cool-down not over
    clock.t += 31
    assert await d.probe() == ["n/0"]
    assert transitions[-1] == ("n/0", "up", "")
    r = await d.step("n/0", "ep", 1, False, obs(1))
    assert r.outputs["act"].item() == 2.0


async def test_failed_probe_restarts_cooldown() -> None:
    clock = Clock()
    d, sessions, transitions = make(1, clock=clock, failure_threshold=1, cooldown_s=10)
    sessions["n/0"].fail = 2
    with pytest.raises(ModelFailure):
        await d.step("n/0", "ep", 1, True, obs(1))
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
    assert out["act"].item() == 4.0 and not d.has_state("") and d.live_episodes("n/0") == 0


async def test_a_step_whose_caller_gave_up_keeps_nothing() -> None:
    d, sessions, _ = make(1)
    await d.step("n/0", "ep", 1, True, obs(1))  # h = 1
    s = sessions["n/0"]
    gate = threading.Event()
    s.gate = gate
    s.entered.clear()
    running = asyncio.ensure_future(d.step("n/0", "ep", 1, False, obs(2)))
    queued = asyncio.ensure_future(d.step("n/0", "other", 2, True, obs(5)))
    await started(s)
    calls = s.calls
    running.cancel()  # the request's deadline passed while the model ran
    queued.cancel()  # ... and while this one still waited in the device's queue
    gate.set()
    s.gate = None
    r = await d.step("n/0", "ep", 1, False, obs(2))
    assert r.outputs["act"].item() == 3.0 and not r.state_reset  # h = 1 + 2, not 1 + 2 + 2
    assert s.calls == calls + 1, "the queued step of a cancelled request never ran"
    assert not d.has_state("other")


async def test_drop_all_during_a_run_keeps_nothing() -> None:
    d, sessions, _ = make(1)
    gate = threading.Event()
    sessions["n/0"].gate = gate
    step = asyncio.ensure_future(d.step("n/0", "ep", 1, True, obs(1)))
    await started(sessions["n/0"])
    d.drop_all()  # the node fenced itself while the model ran
    gate.set()
    await step
    assert not d.has_state("ep")


async def test_a_run_that_outlives_its_deadline_counts_as_a_failure() -> None:
    d, sessions, transitions = make(1, failure_threshold=1)
    gate = threading.Event()
    sessions["n/0"].gate = gate  # the GPU hangs
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await d.step("n/0", "ep", 1, True, obs(1))
    assert transitions and transitions[0][:2] == ("n/0", "down")
    assert "deadline" in transitions[0][2]
    with pytest.raises(DeviceDown):
        await d.step("n/0", "ep", 1, True, obs(1))
    gate.set()
    d.close()  # the hung run returns; its worker ends


async def test_in_flight_and_wait_idle_follow_the_episodes_steps() -> None:
    d, sessions, _ = make(1)
    s = sessions["n/0"]
    assert not d.in_flight("ep")
    await asyncio.wait_for(d.wait_idle("ep"), 5)  # nothing in flight: returns at once
    gate = threading.Event()
    s.gate = gate
    step = asyncio.ensure_future(d.step("n/0", "ep", 1, True, obs(1)))
    await started(s)
    assert d.in_flight("ep") and not d.in_flight("other")
    idle = asyncio.ensure_future(d.wait_idle("ep"))
    await asyncio.sleep(0)
    assert not idle.done(), "wait_idle returned while the step was running"
    gate.set()
    await asyncio.wait_for(idle, 5)
    assert step.done() and step.result().step == 1, "idle before the step's reply"
    assert not d.in_flight("ep")
    assert d.episodes() == [("ep", 1, "n/0")]


async def test_a_cancelled_step_is_not_in_flight() -> None:
    d, sessions, _ = make(1)
    s = sessions["n/0"]
    gate = threading.Event()
    s.gate = gate
    blocker = asyncio.ensure_future(d.step("n/0", "a", 1, True, obs(1)))
    await started(s)
    queued = asyncio.ensure_future(d.step("n/0", "b", 2, True, obs(1)))
    await asyncio.sleep(0)
    assert d.in_flight("b")
    queued.cancel()
    await asyncio.wait_for(d.wait_idle("b"), 5)  # the blocked run does not hold it
    assert not d.in_flight("b") and d.in_flight("a")
    gate.set()
    await blocker
    assert sorted(d.episodes()) == [("a", 1, "n/0")]


async def test_episodes_lists_state_held_here() -> None:
    d, _, _ = make(2)
    await d.step("n/0", "a", 5, True, obs(1))
    await d.step("n/1", "b", 6, True, obs(1))
    await d.step("n/1", "a", 7, False, obs(1))  # a moved with a new token
    assert sorted(d.episodes()) == [("a", 7, "n/1"), ("b", 6, "n/1")]
    d.release("a")
    assert d.episodes() == [("b", 6, "n/1")]
