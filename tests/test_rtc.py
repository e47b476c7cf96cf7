"""Real-time chunking kept with the episode (``node/rtc.py``): the ``rtc.*`` contract, the
estimator, the chunk as part of the step record (replay, undo, reset), batched runs, all
against a plain-numpy reference of the packaged ``rtc-demo`` policy."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper

from affinity.errors import InvalidArgument
from node.contract import load_contract
from node.dispatcher import BatchSettings, ChunkSettings, MultiGpuDispatcher
from node.models import DEMO_MODEL, RTC_DEMO_MODEL, build_rtc
from node.models._build import Weights, model, tensor, write
from node.protocols.kserve.request import model_metadata
from node.rtc import Ask, delay_estimate, executed_estimate, rtc_of
from tests.dispatch import dispatch

H, D = build_rtc.HORIZON, build_rtc.ACTION
WEIGHTS = build_rtc.weights()
CONTRACT = load_contract(RTC_DEMO_MODEL)

# ---- the numpy reference -------------------------------------------------------------------


def own_chunk(image: np.ndarray, state: np.ndarray) -> np.ndarray:
    """rtc-demo's own chunk of one observation (``image`` uint8 [224, 224, 3], ``state`` [8])."""
    x = image.astype(np.float64) * (2 / 255) - 1
    grid, pool = build_rtc.GRID, build_rtc.POOL
    pooled = x.reshape(grid, pool, grid, pool, 3).mean(axis=(1, 3))  # [7, 7, 3]
    z = np.concatenate([pooled.transpose(2, 0, 1).reshape(-1), state.astype(np.float64)])
    p = np.tanh(z @ WEIGHTS["Wp"] + WEIGHTS["bp"])
    v = np.tanh(z @ WEIGHTS["Wv"] + WEIGHTS["bv"])
    return p + (np.arange(H) / (H - 1))[:, np.newaxis] * v


def soft_mask(prefix_len: int, delay: int) -> np.ndarray:
    """RTC's weights per row: 1 for the first d, the exponential decay up to P, then 0."""
    i = np.arange(H)
    c = (prefix_len - i) / (prefix_len - delay + 1)
    soft = c * np.expm1(c) / (math.e - 1)
    return np.where(i < delay, 1.0, np.where(i < prefix_len, soft, 0.0))


def reference(
    image: np.ndarray, state: np.ndarray, previous: np.ndarray | None, executed: int, delay: int
) -> tuple[np.ndarray, dict[str, int]]:
    """The chunk rtc-demo answers and the ``rtc`` facts, from the previous chunk (None: no
    prefix) and where the robot is in it."""
    own = own_chunk(image, state)
    if previous is None:
        return own, {"executed": 0, "delay": 0, "prefix_len": 0}
    prefix_len = H - executed
    delay = min(delay, prefix_len)
    prefix = np.zeros((H, D))
    prefix[:prefix_len] = previous[executed:]
    w = soft_mask(prefix_len, delay)[:, np.newaxis]
    chunk = w * prefix + (1 - w) * own
    return chunk, {"executed": executed, "delay": delay, "prefix_len": prefix_len}


def observation(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    image = rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
    return image, rng.standard_normal(8).astype(np.float32)


def inputs(image: np.ndarray, state: np.ndarray) -> dict[str, np.ndarray]:
    return {"image": image[np.newaxis], "state": state[np.newaxis]}


def close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(np.asarray(got, np.float64).reshape(H, D), want, atol=2e-5)


# ---- the contract and the packaged model ---------------------------------------------------


def test_rtc_inputs_are_hidden_and_the_model_is_its_reference() -> None:
    assert [s.name for s in CONTRACT.observation_inputs] == ["image", "state"]
    assert [s.name for s in CONTRACT.rtc_inputs] == ["rtc.prefix", "rtc.prefix_len", "rtc.delay"]
    assert [t["name"] for t in model_metadata(CONTRACT, "rtc_demo")["inputs"]] == ["image", "state"]
    assert [t["name"] for t in CONTRACT.to_json()["inputs"]] == ["image", "state"]
    spec = rtc_of(CONTRACT)
    assert spec is not None and (spec.horizon, spec.size) == (H, D)
    session = onnxruntime.InferenceSession(str(RTC_DEMO_MODEL), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    previous = rng.standard_normal((H, D)).astype(np.float32)
    for executed, delay in [(0, 0), (3, 5), (10, 6), (16, 0), (2, 14)]:
        image, state = observation(rng)
        rows, used = spec.feed((previous, 0.0), Ask(executed, delay), 0.0, (), None)
        (got,) = session.run(["actions"], {**inputs(image, state), **rows})
        want, facts = reference(image, state, previous, executed, delay)
        close(got, want)
        assert used.to_json() == facts
        d = facts["delay"]  # the first d rows are the prefix, exactly
        np.testing.assert_array_equal(got[0, :d], previous[executed : executed + d])


def test_a_bad_rtc_declaration_stops_the_node_at_start_up(tmp_path: Path) -> None:
    def build(names: Sequence[tuple[str, int, tuple[int, ...]]], out: str) -> Path:
        w = Weights(1)
        f = TensorProto.FLOAT
        ins = [tensor("obs", f, 4, 2), *(tensor(n, t, *dims) for n, t, dims in names)]
        nodes = [helper.make_node("Identity", ["obs"], ["actions"])]  # rtc inputs unread
        outs = [tensor("actions", f, 4, 2)]
        path, _ = write(tmp_path / out, "m.onnx", model("m", nodes, ins, outs, w, "t"),
                        {"chunk": "actions", "state": {}})  # fmt: skip
        return path

    i64 = TensorProto.INT64
    good = [("rtc.prefix", TensorProto.FLOAT, (4, 2)), ("rtc.prefix_len", i64, ()),
            ("rtc.delay", i64, ())]  # fmt: skip
    assert rtc_of(load_contract(build(good, "good"))) is not None
    with pytest.raises(ValueError, match=r"takes all of rtc\.prefix, rtc\.prefix_len, rtc\.delay"):
        load_contract(build(good[:2], "two"))
    with pytest.raises(ValueError, match=r"must have the chunk's shape \[4, 2\]"):
        load_contract(build([("rtc.prefix", TensorProto.FLOAT, (3, 2)), *good[1:]], "shape"))
    with pytest.raises(ValueError, match=r"rtc\.delay is float32"):
        load_contract(build([*good[:2], ("rtc.delay", TensorProto.FLOAT, ())], "dtype"))


def test_step_values_are_checked() -> None:
    spec = rtc_of(CONTRACT)
    assert spec is not None
    assert spec.ask(3, 4) == Ask(3, 4, None)  # both given: no rate needed
    assert spec.ask(None, None, 50) == Ask(None, None, 50.0)
    assert spec.ask(node_hz=50.0) == Ask()
    for args, field in [
        ((-1, 0), "executed"),
        ((H + 1, 0), "executed"),
        ((1.0, 0), "executed"),
        ((True, 0), "executed"),
        ((0, H + 1), "inference_delay"),
        ((0, "2"), "inference_delay"),
        ((0, 0, 0), "control_hz"),
        ((0, 0, float("nan")), "control_hz"),
        ((0, 0, "50"), "control_hz"),
        ((0, None), "inference_delay"),  # estimate it: needs a rate
        ((None, 3), "executed"),
    ]:
        with pytest.raises(InvalidArgument) as caught:
            spec.ask(*args)
        assert caught.value.field == field, args


def test_the_estimator() -> None:
    assert delay_estimate([], 50) == 0
    assert delay_estimate([0.1], 50) == 5  # 0.1 s at 50 Hz: 5 steps, not 6 by rounding
    assert delay_estimate([0.101], 50) == 6  # rounded up
    # p90 (nearest rank), not the mean: one slow step in ten counts
    assert delay_estimate([0.02] * 9 + [0.2], 50) == 1
    assert delay_estimate([0.02] * 8 + [0.2, 0.2], 50) == 10
    assert executed_estimate(0.1, 50, H) == 5
    assert executed_estimate(0.119, 50, H) == 5  # whole actions only
    assert executed_estimate(10.0, 50, H) == H  # capped at the chunk
    assert executed_estimate(-1.0, 50, H) == 0


# ---- the dispatcher: the chunk is part of the step record ----------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Gated:
    """rtc-demo on the CPU; records each run's batch size; ``gate`` holds a run."""

    def __init__(self, device: str) -> None:
        self.inner = onnxruntime.InferenceSession(
            str(RTC_DEMO_MODEL), providers=["CPUExecutionProvider"]
        )
        self.sizes: list[int] = []
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def run(self, names: Sequence[str] | None, feed: Mapping[str, Any]) -> list[Any]:
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(10)
        self.sizes.append(len(feed["state"]))
        return list(self.inner.run(names, dict(feed)))


def make(clock: Clock | None = None, **kw: Any) -> tuple[MultiGpuDispatcher, Gated]:
    sessions: dict[str, Gated] = {}

    def factory(device: str) -> Gated:
        sessions[device] = Gated(device)
        return sessions[device]

    d = MultiGpuDispatcher(["n/0"], factory, CONTRACT, clock=clock or Clock(), **kw)
    return d, sessions["n/0"]


@pytest.mark.anyio
async def test_each_chunk_continues_the_last_one_sent() -> None:
    d, _ = make()
    rng = np.random.default_rng(1)
    try:
        previous = None
        for seq, (executed, delay) in enumerate([(0, 0), (4, 5), (9, 3), (0, 16), (16, 2)], 1):
            image, state = observation(rng)
            result = await dispatch(d, "n/0", "e", 1, seq == 1, inputs(image, state),
                                    rtc=Ask(executed, delay))  # fmt: skip
            want, facts = reference(image, state, previous, executed, delay)
            close(result.outputs["actions"], want)
            assert result.rtc is not None and result.rtc.to_json() == facts
            assert result.state_reset is False
            previous = want
    finally:
        d.close()


@pytest.mark.anyio
async def test_a_replay_does_not_move_the_chunk_and_an_undo_restores_it() -> None:
    d, _ = make()
    rng = np.random.default_rng(2)
    try:
        steps = [observation(rng) for _ in range(3)]
        first = await dispatch(d, "n/0", "e", 1, True, inputs(*steps[0]), seq=1, rtc=Ask(0, 0))
        again = await dispatch(d, "n/0", "e", 1, False, inputs(*steps[0]), seq=1, rtc=Ask(5, 5))
        assert again.replayed and again.rtc == first.rtc
        chunk1, _ = reference(*steps[0], None, 0, 0)
        # (no seq: a step that names its seq is held for its retry, never undone)
        second = await dispatch(d, "n/0", "e", 1, False, inputs(*steps[1]), rtc=Ask(3, 2))
        close(second.outputs["actions"], reference(*steps[1], chunk1, 3, 2)[0])
        assert d.undo("e", 2)  # its reply never reached the robot: chunk 1 is the last sent
        third = await dispatch(d, "n/0", "e", 1, False, inputs(*steps[2]), seq=2, rtc=Ask(6, 4))
        close(third.outputs["actions"], reference(*steps[2], chunk1, 6, 4)[0])
    finally:
        d.close()


@pytest.mark.anyio
async def test_a_reset_drops_the_prefix() -> None:
    d, _ = make()
    rng = np.random.default_rng(3)
    try:
        await dispatch(d, "n/0", "e", 1, True, inputs(*observation(rng)), rtc=Ask(0, 0))
        image, state = observation(rng)
        # another claim (a token change, a reassignment): clean state, no prefix
        moved = await dispatch(d, "n/0", "e", 2, False, inputs(image, state), rtc=Ask(2, 2))
        assert moved.state_reset and moved.rtc is not None and moved.rtc.prefix_len == 0
        close(moved.outputs["actions"], own_chunk(image, state))
        d.table.release("e", "end")  # ended or expired: the next step starts over too
        after = await dispatch(d, "n/0", "e", 2, False, inputs(image, state), rtc=Ask(2, 2))
        assert after.state_reset and after.rtc is not None and after.rtc.prefix_len == 0
    finally:
        d.close()


@pytest.mark.anyio
async def test_after_a_crash_the_robots_pending_actions_are_the_prefix() -> None:
    """Nothing of the episode is left (a crash: the state and its chunk are gone): a step
    that sends the actions the robot has not executed yet starts its chunk from them, so
    the motion goes on without a jump; a step of a continuing episode ignores them."""
    d, _ = make()
    rng = np.random.default_rng(11)
    try:
        pending = rng.standard_normal((6, D)).astype(np.float32)
        image, state = observation(rng)
        ask = d.rtc_for(0, 3, None, pending.tolist())  # as /act's JSON brings it
        first = await dispatch(d, "n/0", "e", 1, False, inputs(image, state), rtc=ask)
        assert first.state_reset and first.rtc is not None
        assert first.rtc.to_json() == {"executed": H - 6, "delay": 3, "prefix_len": 6}
        padded = np.vstack([np.zeros((H - 6, D)), pending])  # the chunk it stands for
        want, _ = reference(image, state, padded, H - 6, 3)
        close(first.outputs["actions"], want)
        got = np.asarray(first.outputs["actions"]).reshape(H, D)
        np.testing.assert_allclose(got[:3], pending[:3], atol=1e-6)  # no jump
        image, state = observation(rng)
        nxt = await dispatch(d, "n/0", "e", 1, False, inputs(image, state),
                             rtc=d.rtc_for(2, 1, None, pending.tolist()))  # fmt: skip
        want, facts = reference(image, state, got, 2, 1)  # its own chunk, not the pending
        close(nxt.outputs["actions"], want)
        assert nxt.rtc is not None and nxt.rtc.to_json() == facts
        for bad in ([[1.0] * (D + 1)], [[[0.0] * D] * (H + 1)], [[float("nan")] * D]):
            with pytest.raises(InvalidArgument, match="pending"):
                d.rtc_for(0, 0, None, bad)
    finally:
        d.close()


@pytest.mark.anyio
async def test_a_record_in_doubt_has_no_prefix() -> None:
    d, _ = make()
    rng = np.random.default_rng(6)
    try:
        for seq in (1, 2):
            await dispatch(d, "n/0", "e", 1, seq == 1, inputs(*observation(rng)), seq=seq,
                           rtc=Ask(0, 0))  # fmt: skip
        assert d.undo("e", 1)  # too late: step 2 was applied on it, so the record is in doubt
        image, state = observation(rng)
        third = await dispatch(d, "n/0", "e", 1, False, inputs(image, state), seq=3, rtc=Ask(2, 2))
        assert third.state_reset and third.rtc is not None and third.rtc.prefix_len == 0
        close(third.outputs["actions"], own_chunk(image, state))
    finally:
        d.close()


@pytest.mark.anyio
async def test_executed_and_delay_are_estimated_as_documented() -> None:
    clock = Clock()
    d, _ = make(clock, chunks=ChunkSettings(control_hz=50.0))
    rng = np.random.default_rng(4)
    try:
        steps = [observation(rng) for _ in range(4)]
        first = await dispatch(d, "n/0", "e", 1, True, inputs(*steps[0]))  # sent at t = 1000
        assert first.rtc is not None and first.rtc.to_json() == {
            "executed": 0, "delay": 0, "prefix_len": 0,
        }  # fmt: skip
        d.observed("e", 1, 0.1)  # the step took 100 ms, arrival to reply
        clock.t += 0.1  # the next observation arrives 100 ms after the chunk was sent
        second = await dispatch(d, "n/0", "e", 1, False, inputs(*steps[1]))
        chunk1 = reference(*steps[0], None, 0, 0)[0]
        want, facts = reference(*steps[1], chunk1, 5, 5)  # 0.1 s x 50 Hz: 5 and 5
        assert second.rtc is not None and second.rtc.to_json() == facts
        close(second.outputs["actions"], want)
        d.observed("e", 2, 0.3)  # one slow step: p90 of (0.1, 0.3) is 0.3, 15 steps
        clock.t += 0.22  # 11 actions of chunk 2 executed: 5 left, d capped at them
        third = await dispatch(d, "n/0", "e", 1, False, inputs(*steps[2]))
        want3, facts = reference(*steps[2], want, 11, 15)
        assert facts == {"executed": 11, "delay": 5, "prefix_len": 5}
        assert third.rtc is not None and third.rtc.to_json() == facts
        close(third.outputs["actions"], want3)
        # a step's own rate replaces the node's, and what it sends is not estimated
        clock.t += 0.02
        fourth = await dispatch(d, "n/0", "e", 1, False, inputs(*steps[3]), rtc=Ask(None, 1, 100.0))
        assert fourth.rtc is not None and fourth.rtc.to_json() == {
            "executed": 2, "delay": 1, "prefix_len": H - 2,
        }  # fmt: skip
    finally:
        d.close()


@pytest.mark.anyio
async def test_batched_runs_with_different_executed_and_delay_equal_one_at_a_time() -> None:
    d, session = make(batching=BatchSettings(max_batch=8, batch_delay_us=0))
    rng = np.random.default_rng(5)
    episodes = [f"e{i}" for i in range(5)]
    values = [(0, 0), (3, 7), (8, 2), (12, 12), (16, 3)]
    try:
        firsts = {ep: observation(rng) for ep in episodes}
        for ep in episodes:  # one at a time: each episode's chunk 1
            await dispatch(d, "n/0", ep, 1, True, inputs(*firsts[ep]), rtc=Ask(0, 0))
        seconds = {ep: observation(rng) for ep in episodes}
        gate = threading.Event()
        session.gate, session.entered = gate, threading.Event()
        blocker = asyncio.ensure_future(
            dispatch(d, "n/0", "blocker", 1, True, inputs(*observation(rng)), rtc=Ask(0, 0))
        )
        assert await asyncio.to_thread(session.entered.wait, 10)
        tasks = [
            asyncio.ensure_future(
                dispatch(d, "n/0", ep, 1, False, inputs(*seconds[ep]), rtc=Ask(*values[i]))
            )
            for i, ep in enumerate(episodes)
        ]
        await asyncio.sleep(0)
        gate.set()
        results = await asyncio.wait_for(asyncio.gather(blocker, *tasks), 20)
        assert session.sizes[-2:] == [1, len(episodes)]  # the five ran as one batch
        for i, (ep, result) in enumerate(zip(episodes, results[1:], strict=True)):
            chunk1 = reference(*firsts[ep], None, 0, 0)[0]
            want, facts = reference(*seconds[ep], chunk1, *values[i])
            close(result.outputs["actions"], want)
            assert result.rtc is not None and result.rtc.to_json() == facts
    finally:
        d.close()


def test_rtc_values_to_a_model_without_rtc_inputs_are_refused_but_a_rate_is_not() -> None:
    d = MultiGpuDispatcher(
        ["n/0"],
        lambda _: onnxruntime.InferenceSession(str(DEMO_MODEL), providers=["CPUExecutionProvider"]),
        load_contract(DEMO_MODEL),
    )
    try:
        assert d.rtc_for() is None
        with pytest.raises(InvalidArgument, match="takes no rtc"):
            d.rtc_for(executed=2)
        with pytest.raises(InvalidArgument, match="takes no rtc"):
            d.rtc_for(inference_delay=1)
        # any model's step may name its control rate (its period: the step's deadline)
        assert d.rtc_for(control_hz=50) is None
        with pytest.raises(InvalidArgument, match="control_hz"):
            d.rtc_for(control_hz=0)
    finally:
        d.close()
