"""The supervisor of a node's front doors (``node/fronts.py``, issue 43), without starting a
node: a front whose restart cannot start a process (no fork: memory, file descriptors) is
tried again with its backoff, leaking nothing, until one starts, and one whose fork
server is starting again is forked once it is ready, without a backoff; the hang watch's bounds
(a starting front's grace, a late look, the timeout's floor) on a clock of the test's; the
undo of a message of rows a front could not deliver, its local rows first."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from node import fronts as fronts_module
from node.errors import ForkServerStarting
from node.fronts import Fronts
from node.metrics import Metrics

pytestmark = pytest.mark.anyio


def supervisor_of(service: Any, listener: socket.socket) -> Fronts:
    """A supervisor of one front on ``listener``, which is closed if it cannot be made
    (never a socket left for the garbage collector to warn about)."""
    try:
        return Fronts(service, [listener], "core", {"max_body_bytes": 4096})
    except BaseException:
        listener.close()
        raise


def let_go(
    supervisor: Fronts, started: list[subprocess.Popen[bytes]], listener: socket.socket
) -> None:
    """End a test's supervisor: nothing restarted, the processes it started killed, its
    fronts' hops dropped, its listener closed."""
    supervisor.stopping = True
    for proc in started:
        proc.kill()
        proc.wait()
    for front in supervisor.fronts:
        if front.hop is not None:
            front.hop.drop()
    listener.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_a_front_whose_restart_cannot_start_is_tried_again_leaking_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    service = SimpleNamespace(
        metrics=Metrics(["a/0"], 8), config=SimpleNamespace(front_hang_s=30.0)
    )
    listener = socket.socket()
    started: list[subprocess.Popen[bytes]] = []
    failures = [OSError(12, "Cannot allocate memory"), OSError(24, "Too many open files")]

    async def spawn(
        index: int, core_hex: str, fds: tuple[int, ...], spec: dict[str, Any]
    ) -> subprocess.Popen[bytes]:
        if failures:  # what the fork server answers when it cannot fork
            raise failures.pop(0)
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        started.append(proc)
        return proc

    monkeypatch.setattr(fronts_module, "BACKOFF_S", (0.01, 0.05))
    supervisor = supervisor_of(service, listener)
    monkeypatch.setattr(supervisor.forks, "spawn", spawn)
    front = supervisor.fronts[0]
    try:
        before = open_fds()
        supervisor._respawn(front)  # what a front's death schedules
        for _ in range(500):  # (bounded) its first try, which fails
            if len(failures) == 1:
                break
            await asyncio.sleep(0.001)
        assert len(failures) == 1 and front.process is None and front.hop is None
        assert open_fds() == before  # its region and doorbells closed again
        for _ in range(500):  # tried again, bounded: the second failure, then a start
            if front.process is not None:
                break
            await asyncio.sleep(0.01)
        assert front.process is not None and started == [front.process] and not failures
        assert front.hop is not None and front.hop.alive
    finally:
        let_go(supervisor, started, listener)


@pytest.mark.parametrize("ready", [True, False])
async def test_a_restart_of_the_fork_server_is_no_failure_of_the_front(
    monkeypatch: pytest.MonkeyPatch, ready: bool
) -> None:
    """A front whose fork server died with it finds the server starting again
    (``ForkServerStarting``): it is forked as soon as the server is ready, its backoff left
    as it was (else each try during the server's imports doubled it, and a front that died
    again soon after waited seconds); a server that does not get ready backs off as a
    failure."""
    service = SimpleNamespace(
        metrics=Metrics(["a/0"], 8), config=SimpleNamespace(front_hang_s=30.0)
    )
    listener = socket.socket()
    started: list[subprocess.Popen[bytes]] = []
    imported = asyncio.Event()
    asked: list[int] = []

    async def spawn(
        index: int, core_hex: str, fds: tuple[int, ...], spec: dict[str, Any]
    ) -> subprocess.Popen[bytes]:
        asked.append(index)
        if len(asked) == 1:  # the server found dead: started again
            raise ForkServerStarting("the front fork server is starting")
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        started.append(proc)
        return proc

    async def wait_ready(timeout: float) -> bool:
        await imported.wait()
        return ready

    # a backoff of minutes: a front backed off for the server's start is not back in the test
    monkeypatch.setattr(fronts_module, "BACKOFF_S", (300.0, 600.0) if ready else (0.01, 0.05))
    supervisor = supervisor_of(service, listener)
    monkeypatch.setattr(supervisor.forks, "spawn", spawn)
    monkeypatch.setattr(supervisor.forks, "wait_ready", wait_ready)
    front = supervisor.fronts[0]
    try:
        supervisor._respawn(front)
        for _ in range(500):  # (bounded) its first try, which finds the server starting
            if asked:
                break
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)
        assert asked == [0] and front.process is None  # it waits for the server's imports
        imported.set()
        for _ in range(3000):  # (bounded) forked once the server is ready
            if front.process is not None:
                break
            await asyncio.sleep(0.01)
        assert front.process is not None and started == [front.process]
        assert front.restarts == (0 if ready else 1)
    finally:
        let_go(supervisor, started, listener)


async def test_a_stop_while_a_front_is_being_forked_leaves_no_front(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A front's restart asked of the fork server while the node begins to stop: the front
    forked meanwhile is killed, never served (its region and doorbells closed); and a
    second restart scheduled while the first waits forks nothing more."""
    service = SimpleNamespace(
        metrics=Metrics(["a/0"], 8), config=SimpleNamespace(front_hang_s=30.0)
    )
    listener = socket.socket()
    asked: list[int] = []
    release = asyncio.Event()
    started: list[subprocess.Popen[bytes]] = []

    async def spawn(
        index: int, core_hex: str, fds: tuple[int, ...], spec: dict[str, Any]
    ) -> subprocess.Popen[bytes]:
        asked.append(index)
        await release.wait()  # (the server forks while the core stops)
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        started.append(proc)
        return proc

    supervisor = supervisor_of(service, listener)
    monkeypatch.setattr(supervisor.forks, "spawn", spawn)
    front = supervisor.fronts[0]
    try:
        before = open_fds()
        supervisor._respawn(front)
        for _ in range(500):  # (bounded) until it asked
            if asked:
                break
            await asyncio.sleep(0.001)
        supervisor._respawn(front)  # a second, while the first waits: nothing more asked
        await asyncio.sleep(0.05)
        assert asked == [0]
        supervisor.stopping = True  # what Fronts.stop sets first
        release.set()
        await asyncio.wait(set(supervisor._ending), timeout=30)
        assert len(started) == 1 and started[0].wait(30) == -9  # killed, not served
        assert front.process is None and front.hop is None
        assert open_fds() == before
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        listener.close()


async def test_a_front_whose_doorbell_cannot_be_made_leaks_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A restart that runs out of descriptors midway (its second doorbell) closes its
    region and first doorbell before it is tried again."""
    service = SimpleNamespace(
        metrics=Metrics(["a/0"], 8), config=SimpleNamespace(front_hang_s=30.0)
    )
    listener = socket.socket()
    real = os.eventfd
    made: list[int] = []

    def eventfd(initval: int, flags: int = 0) -> int:
        if len(made) == 1:
            made.append(-1)
            raise OSError(24, "Too many open files")
        fd = real(initval, flags)
        made.append(fd)
        return fd

    supervisor = supervisor_of(service, listener)
    front = supervisor.fronts[0]
    try:
        supervisor.stopping = True  # (no retry scheduled to start a process)
        before = open_fds()
        monkeypatch.setattr(os, "eventfd", eventfd)
        with pytest.raises(OSError):
            await supervisor._spawn(front)
        monkeypatch.setattr(os, "eventfd", real)
        assert len(made) == 2 and open_fds() == before  # the region and the first closed
        assert front.process is None and front.hop is None
    finally:
        listener.close()


async def test_the_hang_watch_gives_a_starting_front_its_grace_and_counts_no_late_look(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hang watch (``--front-hang-timeout``, here below its 2 s floor): a front that
    has not sampled its loop yet (its imports) is killed only past ``START_HANG_S``; once it
    samples, a loop still for the timeout is killed; a look of the core's that came late
    counts at most ``LOOK_S`` (the node paused as a whole judges no front); a sample resets
    the count."""
    now = [1000.0]
    monkeypatch.setattr(fronts_module, "time", SimpleNamespace(monotonic=lambda: now[0],
                                                               time=lambda: now[0]))  # fmt: skip
    service = SimpleNamespace(metrics=Metrics(["a/0"], 8), config=SimpleNamespace(front_hang_s=0.5))
    listener = socket.socket()
    supervisor = supervisor_of(service, listener)
    assert supervisor.hang_s == fronts_module.MIN_HANG_S
    front = supervisor.fronts[0]
    samples = [0]
    front.lag = SimpleNamespace(samples=lambda: samples[0])  # type: ignore[assignment]
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    front.process = proc

    def look(seconds: float) -> None:
        now[0] += seconds
        supervisor._watch_hangs()

    try:
        look(0.05)  # its first look sets what it has seen
        for _ in range(int(fronts_module.START_HANG_S / 0.05) - 2):  # starting: no sample yet
            look(0.05)
        assert proc.poll() is None, "a front still starting was killed before START_HANG_S"
        samples[0] = 1  # its loop runs: the count starts again, at the timeout
        look(0.05)
        look(600.0)  # the core's own look came late (paused): counts LOOK_S at most
        assert proc.poll() is None and front.still == fronts_module.LOOK_S
        samples[0] = 2  # it beat again
        look(0.05)
        assert front.still == 0.0
        for _ in range(int(fronts_module.MIN_HANG_S / 0.05) - 1):
            look(0.05)
        assert proc.poll() is None and front.still > fronts_module.MIN_HANG_S - 0.1  # not killed
        for _ in range(3):
            look(0.05)
        assert proc.wait(timeout=30) == -9  # still past the timeout: killed
    finally:
        supervisor.stopping = True
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        listener.close()


async def test_a_message_of_rows_not_delivered_undoes_its_rows_served_here_first() -> None:
    """The rows a front could not deliver are undone rows served here first, before the
    first wait (a row forwarded to another node is undone by a request to it): a retry the
    core serves next finds every local row undone."""
    from node.fronts import undeliver
    from node.step import Reply

    order: list[str] = []

    class Router:
        async def undelivered(self, reply: Reply, doubt: bool = False) -> None:
            if reply.origin:
                order.append(f"asked {reply.episode}")
                await asyncio.sleep(0)  # its request to the owner
            else:
                order.append(f"undone {reply.episode}")

    def row(episode: str, origin: str = "") -> Reply:
        return Reply({}, episode, "a/0", "n", 1, "hit", False, False, origin=origin)

    service = SimpleNamespace(router=Router())
    task = asyncio.ensure_future(
        undeliver(service, [row("far", "fw-1"), row("near"), row("other"), "not a reply"])  # type: ignore[arg-type]
    )
    await asyncio.sleep(0)  # its first turn: up to the first wait
    assert order == ["undone near", "undone other", "asked far"]
    await task
