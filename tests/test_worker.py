"""DeviceWorker (node/worker.py) through the dispatcher: a thread per device, inline runs
on the event loop, the queue and the batch window, padding to a session's batch sizes, and
batched runs of a real ONNX Runtime model equal to one step at a time."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node.binding import BoundSession
from node.contract import PolicyContract, load_contract
from node.devices import DeviceSpec, discover, pin_pci_bus_order
from node.dispatcher import BatchSettings, CrashSettings, MultiGpuDispatcher, WorkerHooks
from node.errors import DeviceDown, ModelFailure
from node.models import DEMO_MODEL
from node.providers import ProviderSettings, build_session
from tests.dispatch import dispatch
from tests.rollout import reference_rollout
from tests.test_dispatcher import (  # the dispatcher's fakes; its fixture closes what make() opens
    BATCHED,
    CONTRACT,
    POISON,
    FakeSession,
    _close_dispatchers,  # noqa: F401
    _open,
    episodes,
    make,
    obs,
    settled,
    started,
)

pytestmark = pytest.mark.anyio


async def test_each_device_runs_on_its_own_thread() -> None:
    d, sessions, _ = make(3)
    await asyncio.gather(*(dispatch(d, f"n/{i % 3}", f"ep{i}", i, True, obs(1)) for i in range(12)))
    threads = [sessions[f"n/{i}"].threads for i in range(3)]
    assert all(len(t) == 1 for t in threads)
    assert len(set.union(*threads)) == 3
    assert [sessions[f"n/{i}"].calls for i in range(3)] == [4, 4, 4]


async def test_devices_overlap() -> None:
    d, sessions, _ = make(2)
    gate = threading.Event()
    sessions["n/0"].gate = gate
    slow = asyncio.ensure_future(dispatch(d, "n/0", "a", 1, True, obs(1)))
    # n/1 answers while n/0 is blocked inside its run
    r = await asyncio.wait_for(dispatch(d, "n/1", "b", 2, True, obs(1)), 5)
    assert r.outputs["act"].item() == 1.0 and not slow.done()
    gate.set()
    await slow


class Overlaps(FakeSession):
    """A FakeSession that counts runs in progress at once on it (the most seen)."""

    def __init__(self, device: str) -> None:
        super().__init__(device)
        self.running = 0
        self.most = 0
        self.lock = threading.Lock()

    def run(self, names: Sequence[str] | None, feed: Mapping[str, Any]) -> list[Any]:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            time.sleep(0.0002)  # long enough for another thread to enter, were it let in
            return super().run(names, feed)
        finally:
            with self.lock:
                self.running -= 1


async def test_a_quick_idle_device_in_inline_devices_runs_on_the_event_loop() -> None:
    loop_thread = threading.get_ident()
    d, sessions, _ = make(
        1, batching=BatchSettings(inline_under_us=1_000_000, inline_devices=frozenset(["n/0"]))
    )
    s, dev = sessions["n/0"], d._devices["n/0"]
    # The worker hands its answer over before it frees the device, so an awaited step can
    # return while the device is still busy (a next step then goes to the worker: this
    # test failed once under load). Take the worst order every time: the worker frees the
    # device only once the step has returned; then wait, on an event, until it waits for
    # work again, as a step that comes later would find it.
    returned, idle = threading.Event(), threading.Event()
    flush, wait = dev.flush, dev.cond.wait

    def flush_then_lag() -> None:
        handed = bool(dev.outbox)
        flush()
        if handed:
            assert returned.wait(10), "the step never returned"

    def worker_waits(timeout: float | None = None) -> bool:
        if not (dev.busy or dev.pending):  # called holding dev.cond: the device is free
            idle.set()
        return wait(timeout)

    dev.flush, dev.cond.wait = flush_then_lag, worker_waits  # type: ignore[method-assign]
    await dispatch(d, "n/0", "ep", 1, True, obs(1))  # no run measured yet: the worker runs it
    assert s.threads and loop_thread not in s.threads
    assert dev.busy, "the worst order: the step returned before the worker freed the device"
    returned.set()
    assert await asyncio.to_thread(idle.wait, 10), "the worker never freed the device"
    r = None
    for x in range(2, 6):
        r = await dispatch(d, "n/0", "ep", 1, False, obs(x))
    assert r is not None and (r.outputs["act"].item(), r.seq) == (15.0, 5)
    assert loop_thread in s.threads and len(s.threads) == 2
    # the same steps elsewhere: off (0), a device not listed, runs slower than the bound
    for batching in (
        BatchSettings(inline_under_us=0, inline_devices=frozenset(["n/0"])),
        BatchSettings(inline_under_us=1_000_000, inline_devices=frozenset(["n/1"])),
        BatchSettings(inline_under_us=1, inline_devices=frozenset(["n/0"])),
    ):
        d, sessions, _ = make(1, session=Overlaps, batching=batching)
        for x in range(5):
            await dispatch(d, "n/0", "ep", 1, x == 0, obs(x))
        assert loop_thread not in sessions["n/0"].threads, batching


@pytest.mark.parametrize("devices", [1, 2])
async def test_inline_runs_and_worker_runs_never_overlap_on_a_device(devices: int) -> None:
    """Concurrent steps of many episodes (the worker takes them while the device is busy,
    the loop when it is idle): one run at a time per device, every episode's steps in
    order and each counted once."""
    loop_thread = threading.get_ident()
    ids = [f"n/{i}" for i in range(devices)]
    d, sessions, _ = make(
        devices,
        session=Overlaps,
        batching=BatchSettings(inline_under_us=1_000_000, inline_devices=frozenset(ids)),
    )

    async def episode(i: int, xs: range) -> list[float]:
        out = []
        for x in xs:
            r = await dispatch(d, ids[i % devices], f"ep{i}", 1, x == 1, obs(x))
            out.append(r.outputs["act"].item())
            if x % 2:
                await asyncio.sleep(0)
        return out

    async def together(xs: range) -> list[list[float]]:
        return await asyncio.wait_for(asyncio.gather(*(episode(i, xs) for i in range(16))), 60)

    first = await together(range(1, 4))  # all at once: the worker, mostly
    middle = [await episode(i, range(4, 5)) for i in range(16)]  # one by one: inline
    last = await together(range(5, 7))
    want = [1.0, 3.0, 6.0, 10.0, 15.0, 21.0]
    assert all(a + b + c == want for a, b, c in zip(first, middle, last, strict=True))
    assert sum(s.calls for s in sessions.values()) <= 16 * 6  # batched or not, never twice
    for dev in ids:
        assert sessions[dev].most == 1, f"{dev}: {sessions[dev].most} runs at once"
    if devices == 1:
        assert len(sessions["n/0"].threads) == 2 and loop_thread in sessions["n/0"].threads


async def test_no_inline_run_while_another_device_is_busy() -> None:
    """The loop would wait for an inline run: not while another device runs (its steps'
    answers, and steps for it, would wait too). n/1 is not listed: its runs stay on its
    worker, where one can be held."""
    loop_thread = threading.get_ident()
    d, sessions, _ = make(
        2, batching=BatchSettings(inline_under_us=1_000_000, inline_devices=frozenset(["n/0"]))
    )
    for dev in ("n/0", "n/1"):
        await dispatch(d, dev, f"warm-{dev}", 1, True, obs(1))
    sessions["n/0"].threads.clear()
    gate = sessions["n/1"].gate = threading.Event()
    sessions["n/1"].entered.clear()
    slow = asyncio.ensure_future(dispatch(d, "n/1", "slow", 1, True, obs(1)))
    await started(sessions["n/1"])
    r = await asyncio.wait_for(dispatch(d, "n/0", "quick", 1, True, obs(2)), 10)
    assert r.outputs["act"].item() == 2.0 and not slow.done()
    assert loop_thread not in sessions["n/0"].threads
    gate.set()
    await slow
    # a worker hands its answers over before it frees its device (an inline round must
    # not share its outbox): wait, bounded, until both are free, as a next step would find
    # them (n/0's worker ran the first quick step)
    for _ in range(10_000):
        if not any(w.busy or w.pending for w in d._devices.values()):
            break
        await asyncio.sleep(0.001)
    await dispatch(d, "n/0", "quick", 1, False, obs(1))  # nothing else busy: inline again
    assert loop_thread in sessions["n/0"].threads


# ---- batching ---------------------------------------------------------------------------


async def blocked(d: MultiGpuDispatcher, session: FakeSession) -> tuple[Any, threading.Event]:
    """Hold ``session``'s worker inside a run of episode "blocker" (obs 100) until the
    returned gate is set, so the steps queued meanwhile are there when it looks next."""
    gate = threading.Event()
    session.gate = gate
    session.entered.clear()
    task = asyncio.ensure_future(dispatch(d, "n/0", "blocker", 99, True, obs(100)))
    await started(session)
    return task, gate


def queue(d: MultiGpuDispatcher, *steps: tuple[str, float]) -> list[asyncio.Future[Any]]:
    """Queue one step per (episode, observation), in this order (token 1; an episode's
    first step is its fresh claim)."""
    seen: set[str] = set()
    tasks = []
    for ep, x in steps:
        tasks.append(asyncio.ensure_future(dispatch(d, "n/0", ep, 1, ep not in seen, obs(x))))
        seen.add(ep)
    return tasks


async def test_a_model_without_a_batch_axis_runs_unbatched_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("INFO", "affinity.node"):
        d, sessions, _ = make(1, batching=BatchSettings(max_batch=8))
        fixed, _, _ = make(1, replace(CONTRACT, batch_axis=True))
    assert d.max_batch == 1 and fixed.max_batch == 1
    said = [r.getMessage() for r in caplog.records if "batching" in r.getMessage()]
    assert said == [
        'batching is off: the model has no batch axis (see the sidecar\'s "batch"); '
        "every step runs alone",
        "batching is off: obs is float32 [1, 2]: its batch axis is fixed; every step runs alone",
    ]
    s = sessions["n/0"]
    blocker, gate = await blocked(d, s)
    tasks = queue(d, ("a", 1), ("b", 2), ("c", 3))
    await asyncio.sleep(0)
    gate.set()
    await settled([blocker, *tasks])
    assert s.runs == [[100.0], [1.0], [2.0], [3.0]]


async def test_each_models_batching_line_names_the_model(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A node serving two models says batching once for each, naming which (issue 42)."""
    with caplog.at_level("INFO", "affinity.node"):
        make(1, BATCHED, model="demo@v1")
        make(1, CONTRACT, model="vla_demo@v3")
    said = [r.getMessage() for r in caplog.records if "batching" in r.getMessage()]
    assert said == [
        "batching is on for demo@v1: up to 8 steps per model run",
        "batching is off for vla_demo@v3: the model has no batch axis "
        '(see the sidecar\'s "batch"); every step runs alone',
    ]
    assert {r.name for r in caplog.records} == {"affinity.node"}


def test_every_node_module_logs_as_affinity_node() -> None:
    """One logger name for the node's log lines (a start-up line from another name stood
    out, issue 42): every logger a node module writes to (``name = logging.getLogger(...)``;
    a library's logger only quietened, such as httpx's in a front, is not one)."""
    import re

    root = Path(__file__).resolve().parent.parent / "node"
    names = {
        (path.name, name)
        for path in root.rglob("*.py")
        for name in re.findall(
            r"^\s*\w+(?:\s*:\s*[\w.]+)?\s*=\s*logging\.getLogger\(([^)]*)\)", path.read_text(), re.M
        )
    }
    assert names and {name for _, name in names} == {'"affinity.node"'}, names


async def test_batching_defaults_to_eight_for_a_model_with_a_batch_axis(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("INFO", "affinity.node"):
        d, _, _ = make(1, BATCHED)
    assert d.max_batch == 8 and d.batching_off == ""
    assert any("batching is on: up to 8" in r.getMessage() for r in caplog.records)
    off, _, _ = make(1, BATCHED, batching=BatchSettings(max_batch=1))
    assert off.max_batch == 1
    with pytest.raises(ValueError, match=r"^batch size limit 0: must be >= 1"):
        make(1, BATCHED, batching=BatchSettings(max_batch=0))
    with pytest.raises(ValueError, match="batch_delay_us"):
        make(1, BATCHED, batching=BatchSettings(batch_delay_us=-1))


async def test_waiting_steps_of_different_episodes_run_as_one_batch() -> None:
    d, sessions, _ = make(1, BATCHED)
    s = sessions["n/0"]
    blocker, gate = await blocked(d, s)
    tasks = queue(d, *((f"e{i}", float(i)) for i in range(1, 6)))
    await asyncio.sleep(0)
    gate.set()
    results = await settled([blocker, *tasks])
    assert s.runs == [[100.0], [1.0, 2.0, 3.0, 4.0, 5.0]]
    assert [r.outputs["act"].item() for r in results[1:]] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert all(r.outputs["act"].shape == (1, 1) and r.seq == 1 for r in results[1:])
    assert [d.table.state_of(f"e{i}")["state_in.h"].item() for i in range(1, 6)] == [1, 2, 3, 4, 5]


async def test_an_episode_has_one_step_per_run_and_its_steps_keep_their_order() -> None:
    d, sessions, _ = make(1, BATCHED)
    s = sessions["n/0"]
    blocker, gate = await blocked(d, s)
    tasks = queue(d, ("a", 1), ("a", 2), ("b", 10), ("a", 3), ("c", 20))
    await asyncio.sleep(0)
    gate.set()
    a1, a2, b, a3, c = (await settled([blocker, *tasks]))[1:]
    assert s.runs == [[100.0], [1.0, 10.0, 20.0], [2.0], [3.0]]
    assert [r.outputs["act"].item() for r in (a1, a2, a3)] == [1.0, 3.0, 6.0]
    assert [r.seq for r in (a1, a2, a3)] == [1, 2, 3]
    assert (b.outputs["act"].item(), c.outputs["act"].item()) == (10.0, 20.0)


async def test_max_batch_caps_a_run() -> None:
    d, sessions, _ = make(1, BATCHED, batching=BatchSettings(max_batch=4))
    s = sessions["n/0"]
    blocker, gate = await blocked(d, s)
    tasks = queue(d, *((f"e{i}", float(i)) for i in range(1, 11)))
    await asyncio.sleep(0)
    gate.set()
    await settled([blocker, *tasks])
    assert [len(r) for r in s.runs] == [1, 4, 4, 2]


async def test_a_failed_batch_is_rerun_one_by_one_and_only_the_bad_step_fails() -> None:
    d, sessions, transitions = make(1, BATCHED, crashes=CrashSettings(failure_threshold=2))
    s = sessions["n/0"]
    blocker, gate = await blocked(d, s)
    tasks = queue(d, ("a", 1), ("bad", POISON), ("b", 2), ("c", 3))
    await asyncio.sleep(0)
    gate.set()
    a, bad, b, c = (await settled([blocker, *tasks]))[1:]
    assert s.runs[1] == [1.0, POISON, 2.0, 3.0]  # the batch, then each step alone
    assert s.runs[2:] == [[1.0], [POISON], [2.0], [3.0]]
    assert isinstance(bad, ModelFailure)
    assert [r.outputs["act"].item() for r in (a, b, c)] == [1.0, 2.0, 3.0]
    assert d.tracker("n/0").failures == 0, "the good steps after the bad one reset the count"
    assert transitions == [] and d.table.get("bad") is None
    # the failed batch did not count: one bad step alone counts once
    s.gate = None
    with pytest.raises(ModelFailure):
        await dispatch(d, "n/0", "bad", 1, True, obs(POISON))
    assert d.tracker("n/0").failures == 1 and transitions == []


async def test_a_broken_device_goes_down_from_the_single_reruns() -> None:
    d, sessions, transitions = make(1, BATCHED, crashes=CrashSettings(failure_threshold=3))
    s = sessions["n/0"]
    blocker, gate = await blocked(d, s)
    tasks = queue(d, ("a", 1), ("b", 2), ("c", 3))
    await asyncio.sleep(0)
    s.fail = 100  # the GPU breaks during the blocker's run
    gate.set()
    results = await settled([blocker, *tasks])
    # blocker 1, (the batch does not count), a 2, b 3: down; c is not run any more
    assert [type(r) for r in results] == [ModelFailure] * 3 + [DeviceDown]
    assert [t[1] for t in transitions] == ["down"]
    assert s.runs[1:] == [[1.0, 2.0, 3.0], [1.0], [2.0]]


async def test_a_step_whose_caller_gave_up_is_left_out_of_the_batch() -> None:
    d, sessions, _ = make(1, BATCHED)
    s = sessions["n/0"]
    blocker, gate = await blocked(d, s)
    tasks = queue(d, ("a", 1), ("gone", 2), ("b", 3))
    await asyncio.sleep(0)
    tasks[1].cancel()
    gate.set()
    await settled([blocker, *tasks])
    assert s.runs[1] == [1.0, 3.0]
    assert d.table.get("gone") is None and not d.table.in_flight("gone")


async def test_a_step_cancelled_during_a_batched_run_keeps_nothing_and_counts_once() -> None:
    d, sessions, transitions = make(1, BATCHED, crashes=CrashSettings(failure_threshold=2))
    s = sessions["n/0"]
    _, gate = await blocked(d, s)
    tasks = queue(d, ("a", 1), ("b", 2), ("c", 3))
    await asyncio.sleep(0)
    hang = s.hold[1.0] = threading.Event()  # the batched run hangs ...
    gate.set()
    assert await asyncio.to_thread(s.held.wait, 10)
    tasks[0].cancel()  # ... past the deadlines of two of its steps
    tasks[1].cancel()
    await asyncio.sleep(0)
    hang.set()
    results = await settled(tasks)
    assert isinstance(results[0], asyncio.CancelledError) and results[2].seq == 1
    assert s.runs[-1] == [1.0, 2.0, 3.0]
    assert d.table.get("a") is None and d.table.get("b") is None and d.table.get("c") is not None
    assert transitions == [], "one hung run counts one failure, not one per step"
    assert d.tracker("n/0").failures == 0  # ... and the run's success reset it


class Bucketed(FakeSession):
    """A session that runs only at some batch sizes (one captured CUDA graph each)."""

    batch_sizes = (1, 2, 4)

    def run(self, names: Sequence[str] | None, feed: Mapping[str, Any]) -> list[Any]:
        assert all(len(v) in self.batch_sizes for v in feed.values()), "not padded"
        return super().run(names, feed)


async def test_runs_are_padded_to_the_sessions_batch_sizes() -> None:
    d, sessions, _ = make(1, BATCHED, session=Bucketed)
    s = sessions["n/0"]
    assert d._devices["n/0"].max_batch == 4  # never larger than the largest size
    blocker, gate = await blocked(d, s)
    tasks = queue(d, *((f"e{i}", float(i)) for i in range(1, 8)))
    await asyncio.sleep(0)
    gate.set()
    results = await settled([blocker, *tasks])
    # 7 steps: a run of 4, then 3 padded to 4 with copies of the first step's row
    assert s.runs[1:] == [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 5.0]]
    assert [r.outputs["act"].item() for r in results[1:]] == [1, 2, 3, 4, 5, 6, 7]
    assert all(r.outputs["act"].shape == (1, 1) for r in results[1:])
    assert d.table.state_of("e5")["state_in.h"].shape == (1, 1)


async def test_warm_up_runs_every_batch_size_on_each_devices_worker() -> None:
    d, sessions, _ = make(2, BATCHED, session=Bucketed)
    await d.warm_up()
    for s in sessions.values():
        assert [len(r) for r in s.runs] == [1, 2, 4] and len(s.threads) == 1
    plain, fakes, _ = make(1, BATCHED)
    await plain.warm_up()
    assert [len(r) for r in fakes["n/0"].runs] == [1]


async def test_hooks_see_every_run_and_every_queue_wait() -> None:
    batches: list[tuple[str, int]] = []
    waits: list[tuple[str, float]] = []
    d, sessions, _ = make(
        1,
        BATCHED,
        hooks=WorkerHooks(
            on_batch=lambda dev, n: batches.append((dev, n)),
            on_queue_wait=lambda dev, s: waits.append((dev, s)),
        ),
    )
    blocker, gate = await blocked(d, sessions["n/0"])
    tasks = queue(d, ("a", 1), ("b", 2), ("c", 3))
    await asyncio.sleep(0)
    gate.set()
    await settled([blocker, *tasks])
    assert batches == [("n/0", 1), ("n/0", 3)]
    assert len(waits) == 4 and all(dev == "n/0" and s >= 0 for dev, s in waits)


async def test_a_failing_hook_fails_no_step() -> None:
    def boom(device: str, value: Any) -> None:
        raise RuntimeError("metrics broke")

    d, _, _ = make(1, BATCHED, hooks=WorkerHooks(on_batch=boom, on_queue_wait=boom))
    r = await dispatch(d, "n/0", "a", 1, True, obs(2))
    assert r.outputs["act"].item() == 2.0 and d.tracker("n/0").failures == 0


async def test_steps_that_are_not_on_their_way_are_not_waited_for() -> None:
    # one client stepping many episodes in turn: each was active a moment ago, but nothing
    # is being routed while a step waits, so no step waits for another
    d, _, _ = make(1, BATCHED, batching=BatchSettings(batch_delay_us=120e6))
    await settled(queue(d, ("a", 1), ("b", 1), ("c", 1)))
    for i in range(6):
        r = await asyncio.wait_for(dispatch(d, "n/0", "abc"[i % 3], 1, False, obs(1)), 60)
        assert r.outputs["act"].shape == (1, 1)


async def test_a_lone_episode_never_waits_for_a_batch() -> None:
    # a 2-minute delay, never paid
    d, _, _ = make(1, BATCHED, batching=BatchSettings(batch_delay_us=120e6))
    for i in range(5):
        r = await asyncio.wait_for(dispatch(d, "n/0", "solo", 1, i == 0, obs(1)), 60)
        assert r.seq == i + 1


async def test_a_step_waits_for_an_episode_that_is_likely_to_send_one() -> None:
    d, sessions, _ = make(1, BATCHED, batching=BatchSettings(batch_delay_us=120e6))
    s = sessions["n/0"]
    await settled(queue(d, ("a", 1), ("b", 1)))  # both episodes are active here
    on_its_way = d.arrival()  # b's next step is being routed through the node
    first = asyncio.ensure_future(dispatch(d, "n/0", "a", 1, False, obs(2)))
    dev = d._devices["n/0"]
    for _ in range(10_000):  # until the worker holds it, waiting for b (bounded)
        await asyncio.sleep(0.001)
        with dev.cond:
            if not dev.pending:
                break
    assert not first.done()
    on_its_way.done()
    second = asyncio.ensure_future(dispatch(d, "n/0", "b", 1, False, obs(3)))
    await settled([first, second])
    assert s.runs[-1] == [2.0, 3.0], "the waiting step did not wait for b"


# ---- batching with a real model: the same steps, batched or one at a time ---------------

EPISODES, STEPS = 32, 3


class Gated:
    """A real ONNX Runtime session whose runs wait while ``gate`` is clear."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.rows: list[int] = []

    def run(self, names: Sequence[str] | None, feed: Mapping[str, Any]) -> list[Any]:
        self.entered.set()
        self.gate.wait(10)
        self.rows.append(len(next(iter(feed.values()))))
        return list(self.inner.run(names, dict(feed)))


@pytest.fixture(scope="module")
def batched_demo() -> Any:
    """The demo policy (it has a batch axis), its contract, and each episode's observations
    with the reference outputs of running them one at a time from the initial state."""
    path = DEMO_MODEL
    contract = load_contract(path)
    assert contract.batchable
    rng = np.random.default_rng(14)
    observations = rng.uniform(-1, 1, (EPISODES, STEPS, 1, 8)).astype(np.float32)
    reference = [reference_rollout(path, list(observations[e])) for e in range(EPISODES)]
    return path, contract, observations, reference


def cpu_session(path: Path) -> Any:
    return build_session(path, discover("cpu:1")[0], ProviderSettings()).session


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(order=st.permutations([e for e in range(EPISODES) for _ in range(STEPS)]))
def test_batched_steps_equal_one_at_a_time(batched_demo: Any, order: list[int]) -> None:
    """32 concurrent episodes, their steps arriving in a random order, give step for step
    the outputs and states of each episode run alone."""
    path, contract, observations, reference = batched_demo
    session = Gated(cpu_session(path))

    async def scenario() -> None:
        d = MultiGpuDispatcher(["n/0"], lambda _: session, contract)
        _open.append(d)
        assert d.max_batch == 8
        session.gate.clear()  # hold the worker so that the steps queue up behind it
        first = asyncio.ensure_future(
            dispatch(d, "n/0", "warm", 1, True, {"obs": observations[0, 0]})
        )
        assert await asyncio.to_thread(session.entered.wait, 10)
        sent = [0] * EPISODES
        tasks = []
        for e in order:  # each episode's k-th arrival carries its k-th observation
            inputs = {"obs": observations[e, sent[e]]}
            tasks.append((e, sent[e], dispatch(d, "n/0", f"ep{e}", 1, sent[e] == 0, inputs)))
            sent[e] += 1
        futures = [asyncio.ensure_future(t) for _, _, t in tasks]
        await asyncio.sleep(0)
        session.gate.set()
        results = await asyncio.wait_for(asyncio.gather(first, *futures), 60)
        for (e, k, _), r in zip(tasks, results[1:], strict=True):
            np.testing.assert_allclose(
                r.outputs["actions"], reference[e][k]["actions"], rtol=1e-5, atol=1e-6
            )
            assert r.seq == k + 1 and not r.state_reset
        for e in range(EPISODES):
            np.testing.assert_allclose(
                d.table.state_of(f"ep{e}")["state_in.hidden"],
                reference[e][-1]["state_out.hidden"],
                rtol=1e-5,
                atol=1e-6,
            )
        assert max(session.rows) == 8, "the steps never ran batched"

    asyncio.run(scenario())


class BoundBuckets:
    """One I/O-bound session per batch size, chosen by the rows of each feed: the shape of
    a session with one CUDA graph captured per batch size (``cuda_graph`` on a GPU)."""

    def __init__(
        self, path: Path, device: DeviceSpec, sizes: tuple[int, ...], cuda_graph: bool
    ) -> None:
        self.batch_sizes = sizes
        contract = load_contract(path)
        kind = "cuda" if device.kind == "cuda" else "cpu"
        self.by_size = {}
        for size in sizes:
            fixed = PolicyContract(
                inputs=tuple(replace(s, shape=(size, *s.shape[1:])) for s in contract.inputs),
                outputs=tuple(replace(s, shape=(size, *s.shape[1:])) for s in contract.outputs),
                state=contract.state,
            )
            built = build_session(path, device, ProviderSettings(cuda_graph=cuda_graph))
            bound = BoundSession(built.session, fixed, kind, device.ordinal or 0)
            self.by_size[size] = bound
        self.rows: list[int] = []

    def run(self, names: Sequence[str] | None, feed: Mapping[str, Any]) -> list[Any]:
        rows = next(iter(feed.values())).shape[0]  # arrays and DeviceTensor handles
        self.rows.append(rows)
        return self.by_size[rows].run(names, feed)


async def bucketed_steps_equal_reference(session: BoundBuckets, batched_demo: Any) -> None:
    _, contract, observations, reference = batched_demo
    d = MultiGpuDispatcher(["n/0"], lambda _: session, contract)
    _open.append(d)
    await d.warm_up()  # each size runs once (captures its graph) on the device's worker
    assert sorted(session.rows) == sorted(session.batch_sizes)
    for k in range(STEPS):  # 7 episodes at once: each run padded to the next size up
        results = await asyncio.gather(
            *(
                dispatch(d, "n/0", f"ep{e}", 1, k == 0, {"obs": observations[e, k]})
                for e in range(7)
            )
        )
        for e, r in enumerate(results):
            np.testing.assert_allclose(
                r.outputs["actions"], reference[e][k]["actions"], rtol=1e-4, atol=1e-5
            )
    assert set(session.rows) <= set(session.batch_sizes)


async def test_bucketed_io_bound_sessions_give_the_reference_outputs(batched_demo: Any) -> None:
    session = BoundBuckets(batched_demo[0], discover("cpu:1")[0], (1, 2, 4, 8), False)
    await bucketed_steps_equal_reference(session, batched_demo)


@pytest.mark.hardware
@pytest.mark.skipif(
    os.environ.get("RUN_HARDWARE_TESTS") != "1", reason="needs a GPU; set RUN_HARDWARE_TESTS=1"
)
async def test_cuda_graph_per_batch_size_gives_the_reference_outputs(batched_demo: Any) -> None:
    pin_pci_bus_order(os.environ)
    gpu = discover("auto")[0]
    assert gpu.kind == "cuda", f"no GPU discovered: {gpu}"
    session = BoundBuckets(batched_demo[0], gpu, (1, 2, 4, 8), True)
    for bound in session.by_size.values():
        assert bound.session.get_providers()[0] == "CUDAExecutionProvider"
    await bucketed_steps_equal_reference(session, batched_demo)


async def test_stateless_runs_batch_with_each_other_and_with_steps() -> None:
    d, sessions, _ = make(1, BATCHED)
    s = sessions["n/0"]
    blocker, gate = await blocked(d, s)
    tasks = [asyncio.ensure_future(d.run_stateless("n/0", obs(x))) for x in (1, 2)]
    tasks += queue(d, ("a", 3))
    tasks.append(asyncio.ensure_future(d.run_stateless("n/0", obs(4))))
    await asyncio.sleep(0)
    gate.set()
    results = await settled([blocker, *tasks])
    assert s.runs[1:] == [[1.0, 2.0, 3.0, 4.0]]
    assert [r["act"].item() for r in (results[1], results[2], results[4])] == [1.0, 2.0, 4.0]
    assert episodes(d) == [("blocker", 99, "n/0"), ("a", 1, "n/0")]
