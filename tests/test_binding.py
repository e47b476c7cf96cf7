"""BoundSession (the I/O-binding path CUDA graphs need) on the CPU: state kept in device
buffers, and warm-up (the CUDA graph capture) on the thread that runs the device's steps."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import fakeredis
import numpy as np
import pytest

from node.binding import BoundSession, DeviceTensor
from node.config import NodeConfig
from node.contract import PolicyContract, TensorSpec, load_contract
from node.devices import DeviceSpec, discover
from node.dispatcher import MultiGpuDispatcher
from node.models import DEMO_MODEL
from node.providers import ProviderSettings, build_session
from node.startup import build_service
from tests.dispatch import dispatch
from tests.rollout import reference_rollout

pytestmark = pytest.mark.anyio

CONTRACT = load_contract(DEMO_MODEL)
NAMES = [o.name for o in CONTRACT.outputs]


def bound(**kw: Any) -> BoundSession:
    spec = discover("cpu:1")[0]
    session = build_session(DEMO_MODEL, spec, ProviderSettings()).session
    return BoundSession(session, CONTRACT, "cpu", 0, **kw)


def observations(n: int, seed: int = 7) -> list[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, 8)).astype(np.float32) for _ in range(n)]


def test_bound_runs_match_reference_with_state_kept_in_device_buffers() -> None:
    b = bound()
    obs = observations(20)
    state: dict[str, Any] = CONTRACT.initial_state()
    for o, want in zip(obs, reference_rollout(DEMO_MODEL, obs), strict=True):
        out = dict(zip(NAMES, b.run(NAMES, {"obs": o, **state}), strict=True))
        np.testing.assert_allclose(out["actions"], want["actions"], rtol=1e-6)
        hidden = out["state_out.hidden"]
        assert isinstance(hidden, DeviceTensor) and hidden.device == "cpu"  # never a host array
        np.testing.assert_allclose(np.asarray(hidden), want["state_out.hidden"], rtol=1e-6)
        state = {"state_in.hidden": hidden}
    # what a client receives is a copy: a later run does not change an earlier result
    first = b.run(NAMES, {"obs": obs[0], **CONTRACT.initial_state()})[0]
    kept = first.copy()
    b.run(NAMES, {"obs": obs[1], **CONTRACT.initial_state()})
    np.testing.assert_array_equal(first, kept)


def test_a_step_whose_result_is_not_kept_leaves_the_state_as_it_was() -> None:
    """The dispatcher drops the result of a step whose caller gave up; the state it read must
    still be the episode's state (double buffers: a step never writes what it read)."""
    b = bound()
    o1, o2, o3 = observations(3)
    [_, h1] = b.run(NAMES, {"obs": o1, **CONTRACT.initial_state()})
    before = np.asarray(h1).copy()
    [abandoned, h2] = b.run(NAMES, {"obs": o2, "state_in.hidden": h1})  # result not kept
    np.testing.assert_array_equal(np.asarray(h1), before)
    [retried, h2_again] = b.run(NAMES, {"obs": o2, "state_in.hidden": h1})  # the retry
    np.testing.assert_array_equal(retried, abandoned)
    np.testing.assert_array_equal(np.asarray(h2_again), np.asarray(h2))
    want = reference_rollout(DEMO_MODEL, [o1, o2, o3])
    [actions, _] = b.run(NAMES, {"obs": o3, "state_in.hidden": h2_again})
    np.testing.assert_allclose(actions, want[2]["actions"], rtol=1e-6)


def test_host_state_mode_returns_arrays() -> None:
    b = bound(state_on_device=False)
    [actions, hidden] = b.run(NAMES, {"obs": observations(1)[0], **CONTRACT.initial_state()})
    assert isinstance(hidden, np.ndarray) and isinstance(actions, np.ndarray)


def test_the_batch_axis_is_pinned_other_dynamic_axes_are_refused() -> None:
    spec = discover("cpu:1")[0]
    session = build_session(DEMO_MODEL, spec, ProviderSettings()).session
    batched = PolicyContract(
        inputs=(
            TensorSpec("obs", ("batch", 8), "float32"),
            TensorSpec("state_in.hidden", ("batch", 16), "float32"),
        ),
        outputs=(
            TensorSpec("actions", ("batch", 4, 2), "float32"),
            TensorSpec("state_out.hidden", ("batch", 16), "float32"),
        ),
        state=CONTRACT.state,
        batch_axis=True,
    )
    b = BoundSession(session, batched, "cpu", 0)
    assert b.inputs["obs"][2] == (1, 8) and b.outputs["actions"][2] == (1, 4, 2)
    ragged = replace(batched, inputs=(TensorSpec("obs", ("batch", "width"), "float32"),))
    with pytest.raises(ValueError, match=r"fixed shapes.*obs.*only the batch axis may be dynamic"):
        BoundSession(session, ragged, "cpu", 0)


async def test_dispatcher_keeps_state_on_the_device_and_matches_reference() -> None:
    fed: list[Any] = []

    class Spy(BoundSession):
        def run(self, names: Sequence[str] | None, feed: Mapping[str, Any]) -> list[Any]:
            fed.append(feed["state_in.hidden"])
            return super().run(names, feed)

    spec = discover("cpu:1")[0]
    session = build_session(DEMO_MODEL, spec, ProviderSettings()).session
    d = MultiGpuDispatcher(["n/0"], lambda _: Spy(session, CONTRACT, "cpu", 0), CONTRACT)
    try:
        obs = observations(6)
        for i, (o, want) in enumerate(zip(obs, reference_rollout(DEMO_MODEL, obs), strict=True)):
            result = await dispatch(d, "n/0", "ep", 1, i == 0, {"obs": o})
            np.testing.assert_allclose(result.outputs["actions"], want["actions"], rtol=1e-6)
            assert set(result.outputs) == {"actions"}
        # the first step starts from host zeros; every later one is fed the device handle
        assert isinstance(fed[0], np.ndarray)
        assert all(isinstance(h, DeviceTensor) for h in fed[1:])
    finally:
        d.close()


# -- warm-up on the device's worker --------------------------------------------------------


class Recording:
    """A session that records the thread of its warm-up (capture) and of every run."""

    def __init__(
        self, name: str, order: list[str], others_started: threading.Event | None = None
    ) -> None:
        self.name = name
        self.order = order
        self.warm_threads: list[int] = []
        self.run_threads: list[int] = []
        self.started = threading.Event()
        self.others_started = others_started

    def warm_up(self) -> None:
        self.warm_threads.append(threading.get_ident())
        self.order.append(f"start {self.name}")
        self.started.set()
        if self.others_started is not None:
            # would be set at once by a concurrent warm-up of the other device
            self.others_started.wait(0.3)
        self.order.append(f"end {self.name}")

    def run(self, names: Sequence[str] | None, feed: Mapping[str, Any]) -> list[Any]:
        self.run_threads.append(threading.get_ident())
        return [np.zeros((1, 4, 2), np.float32), np.zeros((1, 16), np.float32)]


async def test_warm_up_runs_on_each_devices_worker_one_device_at_a_time() -> None:
    order: list[str] = []
    second = Recording("b", order)
    first = Recording("a", order, others_started=second.started)
    sessions = {"n/0": first, "n/1": second}
    d = MultiGpuDispatcher(list(sessions), sessions.__getitem__, CONTRACT)
    try:
        await d.warm_up()
        assert order == ["start a", "end a", "start b", "end b"]
        for device, session in sessions.items():
            for _ in range(3):
                await dispatch(
                    d, device, f"ep-{device}", 1, True, {"obs": np.zeros((1, 8), np.float32)}
                )
            # captured on the thread that runs the steps, which is not the caller's thread
            [warm] = session.warm_threads
            assert set(session.run_threads) == {warm}
            assert warm != threading.get_ident()
        assert first.warm_threads != second.warm_threads  # one worker per device
    finally:
        d.close()


async def test_warm_up_of_a_plain_session_is_one_run_from_zeros() -> None:
    seen: list[dict[str, Any]] = []

    class Plain:
        def run(self, names: Sequence[str] | None, feed: Mapping[str, Any]) -> list[Any]:
            seen.append(dict(feed))
            return [np.zeros((1, 4, 2), np.float32), np.zeros((1, 16), np.float32)]

    d = MultiGpuDispatcher(["n/0"], lambda _: Plain(), CONTRACT)
    try:
        await d.warm_up()
        [feed] = seen
        assert set(feed) == {"obs", "state_in.hidden"}
        assert not any(np.any(v) for v in feed.values())
        assert d.table.get("anything") is None and d.tracker("n/0").failures == 0
    finally:
        d.close()


async def test_the_node_warms_its_devices_up_at_start_up() -> None:
    """build_service: a CUDA-graph session is captured on its device's worker, not at import."""
    sessions: dict[int, Recording] = {}

    def factory(spec: DeviceSpec) -> tuple[Any, str]:
        sessions[spec.index] = Recording(str(spec.index), [])
        return sessions[spec.index], "CUDAExecutionProvider"

    config = NodeConfig(node_id="gpu-a", advertise_url="http://gpu-a.test", devices="cpu:2")
    redis = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    service = await build_service(
        config, redis=redis, specs=discover("cpu:2"), session_factory=factory
    )()
    try:
        assert [len(s.warm_threads) for s in sessions.values()] == [1, 1]
        await dispatch(
            service.dispatchers["demo_policy"], "gpu-a/1", "ep", 1, True, {"obs": np.zeros((1, 8))}
        )
        assert sessions[1].run_threads == sessions[1].warm_threads
        assert threading.get_ident() not in sessions[0].warm_threads + sessions[1].warm_threads
    finally:
        service.health.close()
        await redis.aclose()


def test_a_state_one_step_back_is_intact_after_a_step_not_kept_for_an_undo() -> None:
    """An episode's record holds its state and, until its next step is kept, the one
    before (an undo goes back to it). A step on the current state that is not kept (its
    caller gave up) must leave both as they were: with two buffers it wrote over the
    earlier one, and an undo then went on from another state, unsaid."""
    b = bound()
    obs = observations(3, seed=9)
    first = dict(zip(NAMES, b.run(NAMES, {"obs": obs[0], **CONTRACT.initial_state()}), strict=True))
    before = first["state_out.hidden"]  # the record's ``previous`` once step 2 is kept
    kept = np.asarray(before).copy()
    second = dict(zip(NAMES, b.run(NAMES, {"obs": obs[1], "state_in.hidden": before}), strict=True))
    b.run(NAMES, {"obs": obs[2], "state_in.hidden": second["state_out.hidden"]})  # not kept
    np.testing.assert_array_equal(np.asarray(before), kept)
