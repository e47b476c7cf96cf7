"""node/deviceprocs.py with real worker processes, without a node: a run through a worker
process equals the same session's run in this one; an error there is a failed run; a worker
that dies mid-run ends the run at once and is restarted (lost, restarted, back, in that
order); a hung one is killed at the hang bound; a feed too big for its slot is refused
before it is sent; a model the process cannot open stops the start naming it; stop leaves
no process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import struct
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from node import deviceprocs
from node.deviceprocs import DeviceModel, DeviceProcs, RemoteSession, RemoteState
from node.devices import DeviceSpec
from node.errors import StateLost, WorkerFenced, WorkerGone, WorkerRunError
from node.hop import HELD_AT
from node.providers import ProviderSettings, build_session
from tests.procs import pause

pytestmark = pytest.mark.anyio

DEMO = Path(__file__).resolve().parent.parent / "node" / "models" / "demo_policy.onnx"
CPU0 = DeviceSpec(0, "cpu", None, "cpu", "cpu-0", "cpu", 0)
WAIT_S = 60.0  # bound of every wait below (a busy machine: never a measure of speed)


def procs(
    hang_s: float = 60.0, path: Path = DEMO, body: int = 1 << 20, state: tuple[str, ...] = ()
) -> DeviceProcs:
    """A worker process for one CPU device; ``state``: the model's state outputs it holds."""
    return DeviceProcs(
        "n", [CPU0], [DeviceModel("demo", str(path), 1, True, 4 if state else 2, state)],
        ProviderSettings(), max_body_bytes=body, hang_s=hang_s,
    )  # fmt: skip


def watched(p: DeviceProcs) -> asyncio.Event:
    """Supervise ``p``'s process: the event is set once a restarted one is back."""
    back = asyncio.Event()

    async def came_back(device: str) -> None:
        back.set()

    p.supervise(lambda device, why: None, came_back, lambda device: None)
    return back


def feed(batch: int = 1, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "obs": rng.standard_normal((batch, 8)).astype(np.float32),
        "state_in.hidden": rng.standard_normal((batch, 16)).astype(np.float32),
    }


@pytest.fixture
async def started() -> AsyncIterator[DeviceProcs]:
    p = procs()
    await p.start()
    try:
        yield p
    finally:
        await p.stop()


def pid_of(p: DeviceProcs) -> int:
    (pid,) = p.pids()
    return pid


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"  # a zombie has ended
    except FileNotFoundError:
        return True


async def until(check: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def in_thread(session: RemoteSession, given: dict[str, Any]) -> tuple[threading.Thread, list[Any]]:
    """``session.run`` on a thread of its own (as a device's thread runs it): the thread and
    a list that receives what it returned or raised."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(session.run(["actions", "state_out.hidden"], given))
        except Exception as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


async def test_runs_equal_this_process_sessions_and_say_the_provider(
    started: DeviceProcs,
) -> None:
    session = started.sessions[("demo", "n/0")]
    assert started.active[("demo", "n/0")] == "CPUExecutionProvider"
    assert session.batch_sizes == ()  # no CUDA graph: any batch
    local = build_session(DEMO, CPU0, ProviderSettings()).session
    names = ["actions", "state_out.hidden"]
    for batch, seed in ((1, 1), (2, 2), (1, 3)):
        given = feed(batch, seed)
        got = await asyncio.to_thread(session.run, names, given)
        want = local.run(names, given)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
    # every output, in the session's order, when none is named
    got = await asyncio.to_thread(session.run, None, feed())
    assert len(got) == len(local.get_outputs())


async def test_an_error_in_the_process_is_a_failed_run_and_the_process_goes_on(
    started: DeviceProcs,
) -> None:
    session = started.sessions[("demo", "n/0")]
    pid = pid_of(started)
    bad = {"obs": np.zeros((1, 3), np.float32), "state_in.hidden": np.zeros((1, 16), np.float32)}
    with pytest.raises(WorkerRunError, match="obs"):
        await asyncio.to_thread(session.run, ["actions"], bad)
    (actions,) = await asyncio.to_thread(session.run, ["actions"], feed())
    assert actions.shape[0] == 1 and pid_of(started) == pid


async def test_a_feed_too_big_for_its_slot_is_refused_before_it_is_sent() -> None:
    p = procs(body=1024)  # a slot of 2 bodies + the headroom
    await p.start()
    try:
        session = p.sessions[("demo", "n/0")]
        huge = {"obs": np.zeros((1, 8), np.float32), "big": np.zeros(40 << 20, np.uint8)}
        with pytest.raises(WorkerRunError, match="does not fit its slot"):
            await asyncio.to_thread(session.run, ["actions"], huge)
        (actions,) = await asyncio.to_thread(session.run, ["actions"], feed())
        assert actions.shape[0] == 1
    finally:
        await p.stop()


async def test_a_worker_killed_mid_run_ends_the_run_at_once_and_comes_back(
    started: DeviceProcs,
) -> None:
    events: list[str] = []
    back = asyncio.Event()

    async def came_back(device: str) -> None:
        events.append(f"back {device}")
        back.set()

    started.supervise(
        lambda device, why: events.append(f"lost {device} {why}"),
        came_back,
        lambda device: events.append(f"restarted {device}"),
    )
    session = started.sessions[("demo", "n/0")]
    pid = pid_of(started)
    pause(pid)  # the run is in the process, and stays there
    thread, out = in_thread(session, feed())
    await until(lambda: session.since is not None, "the run handed to the process")
    os.kill(pid, signal.SIGKILL)
    await until(lambda: out, "the run's end")
    assert isinstance(out[0], WorkerGone), out
    await asyncio.wait_for(back.wait(), WAIT_S)
    assert events == [
        "lost n/0 its worker process was killed by SIGKILL",
        "restarted n/0",
        "back n/0",
    ]
    assert pid_of(started) != pid and gone(pid)
    (actions,) = await asyncio.to_thread(session.run, ["actions"], feed())
    assert actions.shape == (1, 4, 2)
    thread.join(WAIT_S)


async def test_a_run_while_the_worker_restarts_fails_at_once() -> None:
    p = procs()
    await p.start()
    try:
        lost = asyncio.Event()
        release = asyncio.Event()

        async def back(device: str) -> None:
            await release.wait()

        p.supervise(lambda device, why: lost.set(), back, lambda device: None)
        session = p.sessions[("demo", "n/0")]
        os.kill(pid_of(p), signal.SIGKILL)
        await asyncio.wait_for(lost.wait(), WAIT_S)
        await until(lambda: session.channel is None, "the dead process's channel retired")
        with pytest.raises(WorkerGone, match="restarting"):
            await asyncio.to_thread(session.run, ["actions"], feed())
        release.set()
    finally:
        await p.stop()


async def test_a_hung_worker_is_killed_at_the_hang_bound_and_restarted() -> None:
    p = procs(hang_s=0.5)
    await p.start()
    try:
        back = asyncio.Event()
        reasons: list[str] = []

        async def came_back(device: str) -> None:
            back.set()

        p.supervise(lambda device, why: reasons.append(why), came_back, lambda device: None)
        session = p.sessions[("demo", "n/0")]
        pid = pid_of(p)
        pause(pid)  # hung: alive, never answers
        thread, out = in_thread(session, feed())
        await until(lambda: out, "the hung run's end")
        assert isinstance(out[0], WorkerGone), out
        assert reasons == ["its worker process was killed by SIGKILL"]
        await asyncio.wait_for(back.wait(), WAIT_S)
        assert pid_of(p) != pid
        thread.join(WAIT_S)
    finally:
        await p.stop()


async def test_a_node_paused_as_a_whole_kills_no_worker_for_the_time_it_missed() -> None:
    """The node and its worker stopped together past the hang bound (SIGSTOP of the group,
    a frozen cgroup, a VM paused), then resumed: the hang watch's look that comes late
    counts at most its period and ``LOOK_S``, so the worker, whose answer comes a moment
    later, is not killed as hung; the run ends with its result."""
    p = procs(hang_s=10.0)  # (the worker then has 8.75 s from its resume to answer: a
    # margin for a loaded machine, where the resumed process waits for a core)
    await p.start()
    try:
        p.supervise(lambda device, why: None, _nothing, lambda device: None)
        session = p.sessions[("demo", "n/0")]
        pid = pid_of(p)
        pause(pid)
        thread, out = in_thread(session, feed())
        await until(lambda: session.since is not None, "the run asked")
        key = ("demo", "n/0")
        await until(lambda: key in p._watched, "the watch's look at the run")
        before = p._watched[key]  # (what it counted so far of this run)
        time.sleep(11.0)  # the node's own loop stopped too, past the bound (blocking: on purpose)
        await until(lambda: p._watched.get(key) != before, "the watch's late look")
        since, counted = p._watched[key]
        assert since == before[0] and counted <= before[1] + 1.0 + deviceprocs.LOOK_S + 0.01
        await asyncio.sleep(0.5)  # (a kill it made would be seen by now)
        assert not gone(pid) and pid_of(p) == pid  # not killed for the time it missed
        os.kill(pid, signal.SIGCONT)  # both resumed
        await until(lambda: out, "the run's end")
        assert isinstance(out[0], list), out  # its result: the worker was never killed
        thread.join(WAIT_S)
        assert pid_of(p) == pid
    finally:
        await p.stop()


async def test_a_restart_that_fails_midway_leaks_nothing_and_is_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker's restart that fails midway kills and reaps the process it started, closes
    what it made (the hello pipe too), and is tried again with its backoff: the device
    comes back, with no process and no descriptor left over. Here the first try's
    ``Popen`` raises something other than ``OSError`` (a failure in the child before its
    exec), the second's process starts but its pidfd cannot be opened (no descriptor
    left)."""
    p = procs()
    await p.start()
    try:
        back = watched(p)
        first = pid_of(p)
        fds = len(os.listdir("/proc/self/fd"))
        failed: list[int] = []
        real = os.pidfd_open

        def pidfd_open(pid: int, flags: int = 0) -> int:
            if not failed:
                failed.append(pid)
                pause(pid)  # (alive until killed: its hello's broken pipe would end it)
                raise OSError(24, "Too many open files")
            return real(pid, flags)

        refused: list[bool] = []
        real_popen = subprocess.Popen

        def popen(*args: Any, **kwargs: Any) -> Any:
            if not refused:
                refused.append(True)
                raise subprocess.SubprocessError("the child failed before its exec")
            return real_popen(*args, **kwargs)

        monkeypatch.setattr(deviceprocs.subprocess, "Popen", popen)
        monkeypatch.setattr(os, "pidfd_open", pidfd_open)
        os.kill(first, signal.SIGKILL)
        await asyncio.wait_for(back.wait(), WAIT_S)
        assert refused and failed and gone(failed[0])  # the second try's process: killed
        assert pid_of(p) not in (first, failed[0])
        assert len(os.listdir("/proc/self/fd")) == fds
        out = await asyncio.to_thread(p.sessions[("demo", "n/0")].run, ["actions"], feed())
        assert out[0].shape[0] == 1
    finally:
        await p.stop()
        for pid in failed:  # (a process the restart left behind)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def test_a_run_after_its_worker_died_is_refused_before_the_channel_is_retired(
    started: DeviceProcs,
) -> None:
    """Between a worker's death (its sessions' incarnation passes at once) and the
    supervisor retiring its channels (on a thread, once the runs on it ended), a run from
    the loop is refused at once: sent into the dead process's slot it would wait for an
    answer nobody writes, holding the session's lock the retirement needs."""
    session = started.sessions[("demo", "n/0")]
    session.gen += 1  # what the death does first (DeviceProcs._died)
    with pytest.raises(WorkerGone):
        await asyncio.wait_for(session.run_from_loop(["actions"], feed()), WAIT_S)
    assert not session.lock.locked()
    session.gen -= 1  # (as it was: the process lives)
    out = await asyncio.wait_for(session.run_from_loop(["actions"], feed()), WAIT_S)
    assert out[0].shape[0] == 1


async def test_a_restarted_workers_warm_up_has_the_warm_up_bound_not_the_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A restarted process's warm-up runs (its first on a GPU capture graphs and autotune:
    seconds) are held to ``WARM_HANG_S``, not to ``--act-deadline``: one slower than the
    step's bound is not killed (which would restart it, and again, for ever)."""
    monkeypatch.setattr(deviceprocs, "WARM_HANG_S", 30.0)
    p = procs(hang_s=0.5)
    await p.start()
    try:
        results: list[Any] = []
        back = asyncio.Event()

        async def warm(device: str) -> None:  # its warm-up run, slower than the bound
            pid = pid_of(p)
            pause(pid)
            thread, out = in_thread(p.sessions[("demo", "n/0")], feed())
            await asyncio.sleep(1.5)  # three bounds: the watch looks on time meanwhile
            results.append(gone(pid))
            if results[0]:  # killed as hung: said below at once, not at the wait's end
                back.set()
                return
            os.kill(pid, signal.SIGCONT)
            await until(lambda: out, "the warm-up run's end")
            results.append(out[0])
            thread.join(WAIT_S)
            back.set()

        p.supervise(lambda device, why: None, warm, lambda device: None)
        first = pid_of(p)
        os.kill(first, signal.SIGKILL)
        await asyncio.wait_for(back.wait(), WAIT_S)
        assert results[0] is False, "the warming process was killed as hung"
        assert isinstance(results[1], list), results  # its result
        assert pid_of(p) != first
    finally:
        await p.stop()


async def test_a_recycled_workers_first_run_its_probe_has_the_warm_up_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process restarted because its device's failures took it down (a recycle) is not
    warmed up: the device's probe, after the cool-down, is its first run, and on a GPU as
    slow as a warm-up. It has ``WARM_HANG_S``, not ``--act-deadline`` (killed as hung, the
    process would be restarted once more for nothing); the runs after it have the step's
    bound again."""
    monkeypatch.setattr(deviceprocs, "WARM_HANG_S", 30.0)
    p = procs(hang_s=0.5)
    await p.start()
    try:
        session = p.sessions[("demo", "n/0")]
        p.supervise(lambda device, why: None, _nothing, lambda device: None)
        first = pid_of(p)
        p.recycle_threadsafe("n/0", "its runs failed")
        await until(lambda: p.pids() and pid_of(p) != first and session.channel is not None
                    and session.channel.gen == session.gen, "the recycled process")  # fmt: skip
        pid = pid_of(p)
        pause(pid)  # the probe, slower than the step's bound
        thread, out = in_thread(session, feed())
        await asyncio.sleep(1.5)  # three bounds: the watch looks on time meanwhile
        assert not gone(pid), "the recycled process was killed as hung at its first run"
        os.kill(pid, signal.SIGCONT)
        await until(lambda: out, "the probe's end")
        assert isinstance(out[0], list), out
        thread.join(WAIT_S)
        pause(pid)  # a later run as slow: the step's bound again
        thread, out = in_thread(session, feed())
        await until(lambda: gone(pid), "the hung process killed")
        with contextlib.suppress(ProcessLookupError):  # (reaped already)
            os.kill(pid, signal.SIGCONT)
        await until(lambda: out, "the hung run's end")
        assert isinstance(out[0], WorkerGone), out
        thread.join(WAIT_S)
    finally:
        await p.stop()


async def _nothing(device: str) -> None:
    return None


async def test_a_model_the_process_cannot_open_stops_the_start_naming_it(
    tmp_path: Path,
) -> None:
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a model")
    p = procs(path=broken)
    with pytest.raises(RuntimeError, match=r"device 0 \(cpu\): demo: .*broken\.onnx"):
        await p.start()
    assert p.pids() == [] or all(gone(pid) for pid in p.pids())


async def test_stop_ends_every_process() -> None:
    p = procs()
    await p.start()
    pid = pid_of(p)
    await p.stop()
    assert gone(pid)
    with pytest.raises(WorkerGone):
        p.sessions[("demo", "n/0")].run(["actions"], feed())


def blocked(pid: int) -> int:
    """The signals ``pid`` blocks, as the bit set /proc says."""
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("SigBlk:"))
    return int(line.split()[1], 16)


async def test_a_worker_is_deaf_to_sigint_and_sigterm_from_its_birth(
    started: DeviceProcs,
) -> None:
    pid = pid_of(started)
    mask = blocked(pid)
    assert mask & (1 << (signal.SIGINT - 1)) and mask & (1 << (signal.SIGTERM - 1))
    os.kill(pid, signal.SIGTERM)
    os.kill(pid, signal.SIGINT)
    (actions,) = await asyncio.to_thread(started.sessions[("demo", "n/0")].run, ["actions"], feed())
    assert actions.shape[0] == 1 and not gone(pid)
    # and this process's own mask is as it was
    assert not blocked(os.getpid()) & (1 << (signal.SIGTERM - 1))


async def test_a_device_down_by_failures_gets_a_new_process_and_waits_for_its_probe(
    started: DeviceProcs, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "affinity.node")
    events: list[str] = []

    async def came_back(device: str) -> None:
        events.append("back")

    started.supervise(
        lambda device, why: events.append("lost"),
        came_back,
        lambda device: events.append("restarted"),
    )
    pid = pid_of(started)
    started.recycle_threadsafe("n/0", "3 failures in a row")
    started.recycle_threadsafe("n/0", "3 failures in a row")  # a second model's tracker
    await until(lambda: started.pids() and pid_of(started) != pid, "a new worker process")
    recycled = [r for r in caplog.records if "is restarted" in r.getMessage()]
    assert len(recycled) == 1, recycled  # once per death, not once per model
    session = started.sessions[("demo", "n/0")]
    await until(lambda: session.channel is not None, "its channel")
    (actions,) = await asyncio.to_thread(session.run, ["actions"], feed())
    assert actions.shape[0] == 1
    assert events == ["lost", "restarted"]  # no "back": up at its probe, after the cool-down
    started.recycle_threadsafe("n/9", "no such device")  # nothing to do


async def test_a_run_from_the_loop_ends_when_its_worker_dies_or_the_procs_stop() -> None:
    p = procs()
    await p.start()
    try:
        back = watched(p)
        session = p.sessions[("demo", "n/0")]
        got = await session.run_from_loop(["actions"], feed())  # the loop goes on meanwhile
        assert got[0].shape[0] == 1
        pid = pid_of(p)
        pause(pid)  # the run stays in the process
        run = asyncio.ensure_future(session.run_from_loop(["actions"], feed()))
        await until(lambda: session.since is not None, "the run handed to the process")
        os.kill(pid, signal.SIGKILL)  # told by the supervisor, which watches its pidfd
        with pytest.raises(WorkerGone, match="died during the run"):
            await asyncio.wait_for(run, WAIT_S)
        await asyncio.wait_for(back.wait(), WAIT_S)
        pause(pid_of(p))
        run = asyncio.ensure_future(session.run_from_loop(["actions"], feed()))
        await until(lambda: session.since is not None, "the run handed to the process")
    finally:
        await p.stop()  # nobody watches the pidfd any more: the run still ends
    with pytest.raises(WorkerGone):
        await asyncio.wait_for(run, WAIT_S)


async def test_an_episodes_state_stays_in_the_process_and_only_its_handle_crosses() -> None:
    """With the model's state outputs named (as the node names them), a run's state stays
    in the worker process: the core gets a handle (``RemoteState``: its shape and dtype,
    read back on demand), and the next run names it, so the slot carries neither the state
    in nor the state out. A batch of episodes (one on a handle, one on host zeros) is
    stacked and padded in the process and split back. A handle the core lets go of is
    freed there with its next request; a restarted process holds none of the old ones,
    and a run that names one fails (``StateLost``), never from another state."""
    p = procs(state=("state_out.hidden",))
    await p.start()
    try:
        back = watched(p)
        session = p.sessions[("demo", "n/0")]
        local = build_session(DEMO, CPU0, ProviderSettings()).session
        names = ["actions", "state_out.hidden"]
        rng = np.random.default_rng(11)
        region = session.channel.region  # type: ignore[union-attr]
        write, asked = region.write, []

        def spy(slot: int, state: int, kind: int, meta: Any, arrays: list[Any]) -> None:
            asked.append((meta, [a.shape for a in arrays]))
            write(slot, state, kind, meta, arrays)

        region.write = spy  # type: ignore[method-assign]
        state: Any = np.zeros((1, 16), np.float32)
        want_state = state
        for _ in range(3):
            obs = rng.standard_normal((1, 8)).astype(np.float32)
            actions, held = await asyncio.to_thread(
                session.run, names, {"obs": obs, "state_in.hidden": state}
            )
            want = local.run(names, {"obs": obs, "state_in.hidden": want_state})
            np.testing.assert_array_equal(actions, want[0])
            assert isinstance(held, RemoteState) and (held.shape, held.dtype) == ((1, 16), "<f4")
            assert held.nbytes == 64
            meta, shapes = asked[-1]  # the ask: the state by its handle after the first
            assert shapes == [(1, 8)] + ([(1, 16)] if not isinstance(state, RemoteState) else [])
            assert meta["h"] == (
                {"state_in.hidden": state.id} if isinstance(state, RemoteState) else {}
            )
            _, answer, arrays = region.read(0, copy=True)  # the answer, in the slot
            assert answer["h"] == {"state_out.hidden": [held.id, "<f4", [1, 16]]}
            assert [a.shape for a in arrays] == [(1, 4, 2)]  # the actions alone came back
            np.testing.assert_array_equal(await asyncio.to_thread(np.asarray, held), want[1])
            state, want_state = held, want[1]
        # a batch: one episode on its handle, one from host zeros, padded to 4 in the process
        obs = rng.standard_normal((2, 8)).astype(np.float32)
        rows = await asyncio.to_thread(
            session.run_rows, names,
            [{"obs": obs[:1], "state_in.hidden": state},
             {"obs": obs[1:], "state_in.hidden": np.zeros((1, 16), np.float32)}], 4,
        )  # fmt: skip
        for row, o, s in ((rows[0], obs[:1], want_state), (rows[1], obs[1:], np.zeros((1, 16)))):
            want = local.run(names, {"obs": o, "state_in.hidden": s.astype(np.float32)})
            np.testing.assert_allclose(row["actions"], want[0], rtol=1e-6)
            assert isinstance(row["state_out.hidden"], RemoteState)
            got = await asyncio.to_thread(np.asarray, row["state_out.hidden"])
            np.testing.assert_allclose(got, want[1], rtol=1e-6)
        # let go of in the core: freed in the process with the next request
        gen, freed = state.gen, state.id
        del state, held, rows
        await asyncio.to_thread(session.run, names, feed())
        ghost = RemoteState(session, gen, freed, "<f4", (1, 16))
        with pytest.raises(StateLost):
            await asyncio.to_thread(np.asarray, ghost)
        # a restarted process: the old handles name nothing there
        kept = (await asyncio.to_thread(session.run, names, feed()))[1]
        os.kill(pid_of(p), signal.SIGKILL)
        await asyncio.wait_for(back.wait(), WAIT_S)
        with pytest.raises(StateLost):
            await asyncio.to_thread(session.run, names, {"obs": feed()["obs"],
                                                         "state_in.hidden": kept})  # fmt: skip
        with pytest.raises(StateLost):
            await asyncio.to_thread(np.asarray, kept)
    finally:
        await p.stop()


async def test_a_run_from_the_loop_waits_for_a_state_read_instead_of_failing(
    started: DeviceProcs,
) -> None:
    """A hand-over reading a state back holds the session for its round trip: a lone step
    run from the loop meanwhile waits for it (off the loop) rather than failing as if the
    process were restarting, which counted a failure of a healthy device."""
    session = started.sessions[("demo", "n/0")]
    session.lock.acquire()  # (a state read in progress)
    try:
        run = asyncio.ensure_future(session.run_from_loop(["actions"], feed()))
        await asyncio.sleep(0.05)
        assert not run.done()
    finally:
        session.lock.release()
    (actions,) = await asyncio.wait_for(run, WAIT_S)
    assert actions.shape == (1, 4, 2)


def held_by(session: RemoteSession) -> tuple[int, int]:
    """The states ``session``'s model holds in its worker process, and their bytes, as the
    process says in its control block."""
    channel = session.channel
    assert channel is not None
    states, nbytes = struct.unpack_from("<QQ", channel.region.mm, HELD_AT + 16 * channel.slot)
    return int(states), int(nbytes)


async def test_the_nodes_lease_reaches_the_process_which_serves_no_state_past_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The core tells the process its lease (its end, its generation) through shared
    memory. Past the lease's end, a run that would continue a state held there is refused
    (``WorkerFenced``, not the device's failure), while a run from an initial state is
    not (what it makes is kept only under a valid lease); a lease renewed serves again. A
    later generation (the node dropped every record: a fence, a registration anew) drops
    every live model's state kept under the one before at once, the model idle, without a
    request: the process says it holds none, and a run naming one is refused as fenced. A
    shadow candidate's states (its ghosts' table, which no fence drops) stay. A run asked
    under a generation already past keeps nothing once answered. A state the core lets go
    of while its model is idle is freed by a request of its own. A node that left (its
    lease's end None: it routes its stragglers' steps) serves no state from its processes."""
    monkeypatch.setattr(deviceprocs, "IDLE_FREE_S", 3600.0)  # (no idle frees until the end)
    state = ("state_out.hidden",)
    p = DeviceProcs(
        "n", [CPU0],
        [DeviceModel("demo", str(DEMO), 1, True, 4, state),
         DeviceModel("demo@2", str(DEMO), 1, False, 4, state, live=False)],
        ProviderSettings(), max_body_bytes=1 << 20, hang_s=60.0,
    )  # fmt: skip
    await p.start()
    told: dict[str, Any] = {"until": time.monotonic_ns() + 3_600_000_000_000, "generation": 0}
    try:
        p.supervise(lambda device, why: None, lambda device: asyncio.sleep(0),
                    lambda device: None, lambda: told["until"],
                    lambda: told["generation"])  # fmt: skip
        session, candidate = p.sessions[("demo", "n/0")], p.sessions[("demo@2", "n/0")]
        names = ["actions", "state_out.hidden"]
        zeros = np.zeros((1, 16), np.float32)

        def step(state: Any, on: RemoteSession = session) -> Any:
            return on.run(names, {"obs": feed()["obs"], "state_in.hidden": state})[1]

        held = await asyncio.to_thread(step, zeros)
        held = await asyncio.to_thread(step, held)
        ghost = await asyncio.to_thread(step, zeros, candidate)
        states, nbytes = p.held("n/0")  # (the first one until a request frees it)
        assert states >= 2 and nbytes == 64 * states
        told["until"] = time.monotonic_ns() - 1  # the lease ran out
        p.tell()
        with pytest.raises(WorkerFenced):
            await asyncio.to_thread(step, held)
        fresh = await asyncio.to_thread(step, zeros)  # an initial state is no episode's
        assert isinstance(fresh, RemoteState)
        ghost = await asyncio.to_thread(step, ghost, candidate)  # no live episode's state
        told["until"] = time.monotonic_ns() + 3_600_000_000_000  # renewed
        p.tell()
        held = await asyncio.to_thread(step, held)
        assert p.held("n/0")[0] >= 3  # fresh, held, the ghost's
        told["generation"] = 1  # the node dropped every record
        await until(lambda: held_by(session) == (0, 0), "the live states of generation 0 dropped")
        assert held_by(candidate)[0] >= 1
        with pytest.raises(WorkerFenced, match="dropped here"):
            await asyncio.to_thread(step, held)
        ghost = await asyncio.to_thread(step, ghost, candidate)  # the ghost's goes on
        kept = await asyncio.to_thread(step, zeros)  # kept under generation 1
        assert held_by(session) == (1, 64)
        session.generation = lambda: 0  # a run asked before the drop, answered after it
        late = await asyncio.to_thread(step, zeros)
        await until(lambda: held_by(session) == (1, 64), "the late state dropped once answered")
        with pytest.raises(WorkerFenced):
            await asyncio.to_thread(step, late)
        session.generation = lambda: told["generation"]
        monkeypatch.setattr(deviceprocs, "IDLE_FREE_S", 0.0)
        del kept, ghost  # let go of in the core: the models idle, freed all the same
        await until(lambda: p.held("n/0") == (0, 0), "an idle model's states freed")
        held = await asyncio.to_thread(step, zeros)
        told["until"] = None  # the node left: it routes stragglers' steps, serves no state
        p.tell()
        with pytest.raises(WorkerFenced):
            await asyncio.to_thread(step, held)
    finally:
        await p.stop()


def test_a_run_its_worker_process_died_in_is_not_counted_as_the_devices_failure() -> None:
    """A run that failed because its worker process died (killed as hung, a crash) is
    answered as a model failure but not counted as one: the device goes down by that death,
    once. Counted, a hang was counted twice (once as hung at the step's deadline), and a
    batch whose steps are rerun alone on the dead process counted a failure per step, so
    the device went down for "model failures" rather than for its process's death. A run
    that raised by itself still counts."""
    from types import SimpleNamespace

    from node.errors import ModelFailure, NotKept
    from node.worker import DeviceWorker

    counted: list[str] = []
    answered: list[BaseException] = []
    worker = SimpleNamespace(
        id="n/0",
        count_failure=counted.append,
        answer=lambda future, value, exc: answered.append(exc),
    )
    member = SimpleNamespace(job=SimpleNamespace(future=None, key="e"))
    for exc in (
        WorkerGone("n/0", "was killed by SIGKILL"),
        StateLost("n/0", "restarted"),
        WorkerFenced("n/0", "refused the run"),
        RuntimeError("CUDA error: an illegal memory access"),
    ):
        DeviceWorker._failed(worker, member, exc)  # type: ignore[arg-type]
    assert counted == ["RuntimeError: CUDA error: an illegal memory access"]
    assert [type(a) for a in answered] == [ModelFailure, ModelFailure, NotKept, ModelFailure]


async def test_a_shadow_candidates_slow_run_never_kills_the_live_models_process() -> None:
    """A candidate shares its device's worker process with the live model. Its run going on
    past the live bound is a slower candidate (what a shadow measures), not a hung device:
    killing the process for it would reset every live episode there. It has a bound of its
    own (10x, at least 60 s); the live model's run keeps the node's, in the same process."""
    from node.deviceprocs import CANDIDATE_HANG

    p = DeviceProcs(
        "n", [CPU0], [DeviceModel("demo", str(DEMO), 1, True, 2),
                      DeviceModel("demo@next", str(DEMO), 1, False, 2, (), False)],
        ProviderSettings(), max_body_bytes=1 << 20, hang_s=0.5,
    )  # fmt: skip
    await p.start()
    try:
        reasons: list[str] = []
        back = asyncio.Event()

        async def came_back(device: str) -> None:
            back.set()

        p.supervise(lambda device, why: reasons.append(why), came_back, lambda device: None)
        live, candidate = p.sessions[("demo", "n/0")], p.sessions[("demo@next", "n/0")]
        assert p.hang_bound(live) == 0.5
        assert p.hang_bound(candidate) == max(CANDIDATE_HANG[0] * 0.5, CANDIDATE_HANG[1])
        pid = pid_of(p)
        pause(pid)  # the candidate's run goes on and on
        slow, out = in_thread(candidate, feed())
        await asyncio.sleep(2.0)  # four live bounds (and the watch's turns): never killed
        assert not out and reasons == [] and pid_of(p) == pid
        hung, live_out = in_thread(live, feed())  # the live model's run: killed at its bound
        await until(lambda: live_out and out, "both runs ended by the kill")
        assert isinstance(live_out[0], WorkerGone) and isinstance(out[0], WorkerGone)
        assert reasons == ["its worker process was killed by SIGKILL"]
        await asyncio.wait_for(back.wait(), WAIT_S)
        slow.join(WAIT_S)
        hung.join(WAIT_S)
    finally:
        await p.stop()
